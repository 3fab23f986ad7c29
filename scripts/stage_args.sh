# Sourced by build_base.sh and build_readout.sh, which take MINUTES [INIT|-] [options...]:
# $minutes, $init ("-": none) and $ngpu (every GPU of this machine, at least one process),
# the options left in "$@"; join_parts DIR FILE: FILE from the FILE.part.* pieces a device
# run returned it in (files of at most 16 MiB come back), when FILE itself is not there.
minutes=${1:?minutes}
init=${2:--}
shift $(($# >= 2 ? 2 : 1))
ngpu=$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')
join_parts() {
  if [ ! -f "$1/$2" ] && ls "$1/$2".part.* >/dev/null 2>&1; then
    cat "$1/$2".part.* >"$1/$2"
  fi
}
