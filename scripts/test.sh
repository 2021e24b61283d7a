#!/usr/bin/env bash
# The test suite on a fresh clone: make a virtual environment, install ptdp with its test
# extras, run pytest. Extra arguments go to pytest, e.g. `bash scripts/test.sh -k config`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate
python -c "import torch" 2>/dev/null || pip install --quiet torch==2.13.0
pip install --quiet -e ".[test,tensorboard]"
python -m pytest -q "$@"
