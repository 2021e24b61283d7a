#!/usr/bin/env bash
# The test suite on a fresh clone: make a virtual environment, install ptdp with its test
# extras, run pytest: the tests on two pytest-xdist workers, then the ones marked `serial`
# (timed faults, tests/conftest.py) alone. Extra arguments go to one plain pytest run
# instead, e.g. `bash scripts/test.sh -k config`.
set -euo pipefail
cd "$(dirname "$0")/.."

PTDP_EXTRAS="[test,tensorboard]" . scripts/venv.sh
if [ "$#" -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
python -m pytest -q -n "${PTDP_TEST_WORKERS:-2}" -m "not serial"
python -m pytest -q -m serial
