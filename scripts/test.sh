#!/usr/bin/env bash
# The test suite on a fresh clone: make a virtual environment, install ptdp with its test
# and development extras, lint (ruff check and the format check), run pytest. Extra
# arguments go to pytest, e.g. `bash scripts/test.sh -k config`.
set -euo pipefail
cd "$(dirname "$0")/.."

PTDP_EXTRAS="[test,tensorboard,dev]" . scripts/venv.sh
ruff check --quiet . || { echo "ruff check failed: fix the lines above (ruff check --fix fixes some)"; exit 1; }
ruff format --check --quiet . || { echo "not formatted: run ruff format on the files above"; exit 1; }
if [ $# -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
# The one-process tests (unit, docs) on one worker per core (at most 4: each docs worker
# holds a warm ptdp of ~1 GB), then the multi-process tests alone: each of their launches
# spreads its ranks over the cores itself. Both parts run even if the first fails.
workers=$(python -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))")
status=0
python -m pytest -q -n "$workers" tests/unit tests/docs || status=$?
python -m pytest -q tests/dist || status=$?
exit "$status"
