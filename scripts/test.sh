#!/usr/bin/env bash
# The whole test suite: set up, lint, format check, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff format --check .
.venv/bin/ruff check .
# unbuffered: a log cut short shows where it stopped; the slowest tests listed at the end
PYTHONUNBUFFERED=1 .venv/bin/python -m pytest -q --durations=15 "$@"
