#!/usr/bin/env bash
# The carried folder of a prose call that goes on distilling (issue 41): a returned pair
# (`cat pair.tar.xz.* | xz -d | tar x` gives PAIR/tuned, PAIR/decoder, PAIR/teacher) and the
# first call's folder (its tokenizer and held-out prompts) into OUT, the weights and the
# teacher's answers as .xz (bench.unpack unpacks them on the machine); about 60 MB, under a
# call's 64 MiB with the code (models/ moved out, .whl-prose from bench/prose_prepare.sh). Then:
#   bash bench/gpu_session.sh prose-readout OUT --distill-init OUT/decoder-prev --distill-minutes 7
set -euo pipefail
PAIR=${1:?the unpacked pair: tuned/, decoder/, teacher/}
PREV=${2:?the first folder: tokenizer/, readout/tasks/heldout.jsonl.gz}
OUT=${3:?the folder to write}
mkdir -p "$OUT/readout/tuned" "$OUT/readout/teacher" "$OUT/readout/tasks" "$OUT/decoder-prev"
cp -r "$PREV/tokenizer" "$OUT/"
cp "$PREV/readout/tasks/heldout.jsonl.gz" "$OUT/readout/tasks/"
find "$PAIR/tuned" -maxdepth 1 -type f ! -name model.safetensors -exec cp {} "$OUT/readout/tuned/" \;
xz -T0 -6 -c "$PAIR/tuned/model.safetensors" > "$OUT/readout/tuned/model.safetensors.xz"
xz -T0 -9 -c "$PAIR/teacher/train.jsonl" > "$OUT/readout/teacher/train.jsonl.xz"
cp "$PAIR/teacher/heldout.jsonl" "$OUT/readout/teacher/"
xz -T0 -6 -c "$PAIR/decoder/decoder.safetensors" > "$OUT/decoder-prev/decoder.safetensors.xz"
cp "$PAIR/decoder/manifest.json" "$OUT/decoder-prev/"
du -sb "$OUT"
