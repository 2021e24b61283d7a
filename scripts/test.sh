#!/usr/bin/env bash
# The test suite on a fresh clone: make a virtual environment, install ptdp with its test
# extras, run pytest. Extra arguments go to pytest, e.g. `bash scripts/test.sh -k config`.
set -euo pipefail
cd "$(dirname "$0")/.."

PTDP_EXTRAS="[test,tensorboard]" . scripts/venv.sh
python -m pytest -q "$@"
