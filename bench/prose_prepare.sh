#!/usr/bin/env bash
# The folder a `prose-chain` device call carries (issue 41), made here from nothing: Debian's
# documentation packages installed and turned into the corpus (data/prose, docs/CORPUS.md),
# its BPE tokenizer (data/prose-tokenizer), the tokenizer, the held-out ids and both splits'
# counts (prose_shards), the corpus's train text gzipped (its ids and the train prompts are
# made on the machine) and the held-out prompts alone (the train prompts there are more than
# a call carries). Each step is skipped when its output is there. About 5 minutes on 2 cores.
#
# Also .whl-prose: the wheels the prose stages need beyond the GPU image (5 MB): blake3 (the
# model loader's digests) and cryptography with cffi and pycparser (the loader imports the
# block envelope); the service wheels and DATA together would not fit a call.
#
# Usage (repo root, as root for apt-get): bash bench/prose_prepare.sh [DATA=.gpu_prose]
# Then, with models/ moved out of the working tree (DATA and the tree fit 64 MiB only so):
#   WHL=.whl-prose bash bench/gpu_session.sh prose-chain DATA  # carry [".whl-prose", "DATA"]
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-.gpu_prose}
PY=.venv/bin/python

if [ ! -f data/prose/train.txt ]; then
  apt-get update -qq
  # shellcheck disable=SC2046  # one word a package
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    $($PY -m stateblock.train.corpus packages) > /dev/null
  $PY -m stateblock.train.corpus build --out data/prose
fi
if [ ! -f data/prose-tokenizer/tokenizer.json ]; then
  $PY -m stateblock.train.prose_tokenizer --corpus data/prose --out data/prose-tokenizer
fi
if [ ! -f "$DATA/meta.json" ]; then
  $PY -m stateblock.train.prose_shards --corpus data/prose --tokenizer data/prose-tokenizer \
    --out "$DATA"
  # made again on the machine from corpus/train.txt.gz (gpu_session.sh: prose_shards --splits
  # train, checked against meta.json's counts): ids and text together do not fit a call
  rm -f "$DATA/train.npy"
fi
mkdir -p "$DATA/corpus"
if [ ! -f "$DATA/corpus/train.txt.gz" ]; then
  gzip -c data/prose/train.txt > "$DATA/corpus/train.txt.gz"
fi
if [ ! -f "$DATA/readout/tasks/heldout.jsonl.gz" ]; then
  $PY -m stateblock.train.prose_readout --corpus data/prose --work "$DATA/readout" \
    --scale bench --until tasks
  rm -f "$DATA/readout/tasks/train.jsonl.gz"  # made on the machine, as many as the tuning reads
fi
mkdir -p .whl-prose
for pkg in blake3 cryptography cffi pycparser; do  # the versions installed here
  if ! ls .whl-prose/"$pkg"-*.whl > /dev/null 2>&1; then
    $PY -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl-prose "$($PY -m pip freeze | grep -i "^$pkg==")"
  fi
done
du -sb "$DATA" | awk '{printf "%s: %.1f MB\n", $2, $1 / 1e6}'
