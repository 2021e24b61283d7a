#!/usr/bin/env bash
# Fine-tuning from a Hugging Face model directory, on the demo corpus, in about two minutes
# on 2 CPU cores:
#   1. train a small GPT-2-shaped model briefly (configs/demo.toml shrunk to 2 layers, h=128);
#   2. export it with `ptdp convert --to hf` (config.json, model.safetensors, tokenizer.json);
#   3. start a new run from that directory with --checkpoint.init_from: the model settings
#      come from its config.json, the optimizer is fresh, the step and the data start at 0;
#   4. compare its first loss with the base run's last one, and with a fresh model's.
# Uses the active environment if it has ptdp, else makes .venv as scripts/demo.sh does.
# Extra arguments go to the fine-tuning `ptdp train`, e.g. `--parallel.tp 2` under torchrun.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v ptdp >/dev/null; then
  PTDP_EXTRAS="[hf]" . scripts/venv.sh
fi

. scripts/demo_data.sh

OUT=runs/finetune-example
rm -rf "$OUT"
COMMON=(--train.eval_interval 0 --train.progress false --train.global_batch_size 16)

echo "== 1. base model: 2 layers, h=128, 128-token context, 100 steps"
ptdp train --config configs/demo.toml --train.run_dir "$OUT/base" "${COMMON[@]}" \
  --model.num_layers 2 --model.hidden_size 128 --model.num_heads 4 --model.seq_length 128 \
  --train.steps 100 --train.log_interval 25

echo "== 2. export to Hugging Face transformers"
ptdp convert --to hf "$OUT/base" "$OUT/hf"

echo "== 3. fine-tune from the exported directory (no model keys: they come from config.json)"
ptdp train --data.path "$DATA/shakespeare" --train.run_dir "$OUT/finetune" "${COMMON[@]}" \
  --checkpoint.init_from "$OUT/hf" --train.steps 30 --train.log_interval 1 \
  --optim.lr 1e-3 --optim.min_lr 1e-4 --optim.warmup_steps 5 "$@"

echo "== 4. one step of the same model from a fresh initialisation, for comparison"
ptdp train --data.path "$DATA/shakespeare" --train.run_dir "$OUT/scratch" "${COMMON[@]}" \
  --config "$OUT/finetune/config.toml" --checkpoint.init_from "" --train.steps 1 > /dev/null

python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def losses(run):
    lines = (out / run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if "loss" in json.loads(line)]

base, tuned, fresh = losses("base")[-1], losses("finetune"), losses("scratch")[0]
print(f"base run, loss logged at step {base['step']}:        {base['loss']:.3f}")
print(f"fine-tune from the HF export, step 1:     {tuned[0]['loss']:.3f}")
print(f"fine-tune, step {tuned[-1]['step']}:                       {tuned[-1]['loss']:.3f}")
print(f"fresh initialisation, step 1:             {fresh['loss']:.3f}")
if not tuned[0]["loss"] < fresh["loss"] - 1.0:
    sys.exit("the fine-tune did not start from the exported weights")
EOF
