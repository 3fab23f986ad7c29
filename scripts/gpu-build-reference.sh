#!/usr/bin/env bash
# How the shipped reference model is built on one H200 (device tool), one stage per
# 10-minute call: bash scripts/gpu-build-reference.sh OUTDIR base|decoder.
# Each stage writes its outputs to OUTDIR as it ends.
set -euo pipefail
OUT=${1:?out dir}
STAGE=${2:?base or decoder}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/gpu.txt"
if [ "$STAGE" = base ]; then
  python -m stateblock.app.cli build-reference --device cuda --stage base --base-minutes 0 \
    --base-steps ${BASE_STEPS:-9000} > "$OUT/base.log" 2>&1
  tar czf "$OUT/base.tgz" models/reference/base
  grep '^{' "$OUT/base.log"
else
  timeout 520 python -m stateblock.app.cli build-reference --device cuda --stage decoder \
    --decoder-steps ${DECODER_STEPS:-10000} --decoder-minutes 0 --max-answer 3100 \
    --decode-limit ${DECODE_LIMIT:-4096} --decode-budget 4300000 > "$OUT/decoder.log" 2>&1
  tar czf "$OUT/decoder.tgz" models/reference/decoder
  gzip -c data/teacher-*.jsonl > "$OUT/teacher.jsonl.gz"
  grep '^{' "$OUT/decoder.log"
  timeout 120 python -m stateblock.app.cli eval --device cuda --n-each 10 --json "$OUT/quality.json" \
    > "$OUT/eval.log" 2>&1 || echo "eval did not finish"
fi
