#!/usr/bin/env bash
# The test suite on a fresh clone: make a virtual environment, install ptdp with its test
# and development extras, lint (ruff check and the format check), run pytest. Extra
# arguments go to pytest, e.g. `bash scripts/test.sh -k config`.
set -euo pipefail
cd "$(dirname "$0")/.."

PTDP_EXTRAS="[test,tensorboard,dev]" . scripts/venv.sh
ruff check --quiet . || { echo "ruff check failed: fix the lines above (ruff check --fix fixes some)"; exit 1; }
ruff format --check --quiet . || { echo "not formatted: run ruff format on the files above"; exit 1; }
python -m pytest -q "$@"
