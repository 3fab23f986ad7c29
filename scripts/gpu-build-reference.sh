#!/usr/bin/env bash
# How the shipped reference model was built on one H200 (device tool) inside one 10-minute
# call: bash scripts/gpu-build-reference.sh OUTDIR. Each stage is written out as it ends.
set -euo pipefail
OUT=${1:?out dir}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/gpu.txt"
python -m stateblock.cli build-reference --device cuda --stage base --base-minutes 3.6 \
  > "$OUT/base.log" 2>&1
tar czf "$OUT/base.tgz" models/reference/base
grep '^{' "$OUT/base.log"
timeout 330 python -m stateblock.cli build-reference --device cuda --stage decoder \
  --decoder-minutes 3.4 --decode-limit 1024 --decode-budget 4300000 > "$OUT/decoder.log" 2>&1
tar czf "$OUT/decoder.tgz" models/reference/decoder
gzip -c data/teacher-*.jsonl > "$OUT/teacher.jsonl.gz"
grep '^{' "$OUT/decoder.log"
