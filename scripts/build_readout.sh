#!/usr/bin/env bash
# One build stage of the shipped readout decoder (docs/QUALITY.md, "The rebuild"): trains for
# MINUTES on every GPU of this machine (torchrun, DDP), resuming from $STATEBLOCK_BUILD_DIR/state.pt
# when this machine ran the last stage, else from INIT (a decoder dir a stage left behind, when
# given), then copies the decoder and its stats to $OUT (where device runs collect results).
# A device run returns files of at most 16 MiB: the weights come back split
# (decoder.safetensors.part.aa, .ab, ...); an INIT dir holding such parts is joined first.
#   scripts/build_readout.sh MINUTES [INIT|-] [readout_ddp options...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/stage_args.sh
out=${STATEBLOCK_BUILD_DIR:-/tmp/readout-build}
extra=()
if [ "$init" != "-" ]; then
  join_parts "$init" decoder.safetensors
  extra+=(--init "$init")
fi
# whatever happens, what the stage left goes back (a crash after the save still returns it)
give_back() {
  [ -n "${OUT:-}" ] && [ -d "$out/decoder" ] || return 0
  mkdir -p "$OUT/decoder"
  cp "$out/decoder/manifest.json" "$out/stats.json" "$OUT/decoder/" 2>/dev/null || true
  cp "$out/profile.txt" "$OUT/decoder/" 2>/dev/null || true  # --profile-steps
  split -b 15M "$out/decoder/decoder.safetensors" "$OUT/decoder/decoder.safetensors.part."
}
trap give_back EXIT
torchrun --standalone --nproc_per_node="$ngpu" -m stateblock.train.readout_ddp \
  --base models/reference/base --out "$out" --minutes "$minutes" "${extra[@]}" "$@"
