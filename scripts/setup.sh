#!/usr/bin/env bash
# Creates .venv and installs stateblock with everything it needs, from the package registry only.
# torch is pinned to the CPU build that lies on this workplace's disk; an unpinned torch pulls CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${STATEBLOCK_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[dev]"
