#!/usr/bin/env bash
# One build stage of the shipped base model (docs/QUALITY.md, "The base model"): trains for
# MINUTES on every GPU of this machine (torchrun, DDP), resuming from $STATEBLOCK_BUILD_DIR/state.pt
# when this machine ran the last stage, else from INIT (a saved base dir: its bf16 weights, a
# new optimizer), then copies the model and its stats to $OUT (where device runs collect results).
# A device run returns files of at most 16 MiB: the weights come back split
# (model.safetensors.part.aa, .ab, ...); an INIT dir holding such parts is joined first.
#   scripts/build_base.sh MINUTES [INIT|-] [base_ddp options...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/stage_args.sh
out=${STATEBLOCK_BUILD_DIR:-/tmp/base-build}
extra=()
if [ "$init" != "-" ] && [ ! -f "$out/state.pt" ]; then
  join_parts "$init" model.safetensors
  extra+=(--init "$init")
fi
give_back() {
  [ -n "${OUT:-}" ] && [ -f "$out/base/model.safetensors" ] || return 0
  mkdir -p "$OUT/base"
  cp "$out/base_stats.json" "$OUT/base/" 2>/dev/null || true
  split -b 15M "$out/base/model.safetensors" "$OUT/base/model.safetensors.part."
}
trap give_back EXIT
torchrun --standalone --nproc_per_node="$ngpu" -m stateblock.train.base_ddp \
  --out "$out" --state "$out/state.pt" --minutes "$minutes" "${extra[@]}" "$@"
