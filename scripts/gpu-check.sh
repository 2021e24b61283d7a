#!/usr/bin/env bash
# One call on a lent GPU (one H100 or H200, under ten minutes): `ptdp calibrate` for the
# GPU, the one-GPU MFU benchmark for the ~125M and ~1.3B models beside the peers
# benchmarks/mfu.py compares (predicted by the file just calibrated, with the memory each
# run holds beside its tensors), every CUDA-only test, the memory of a 1.3B and a 4B model
# phase by phase against the performance model's count (benchmarks/memory_phases.py; the 4B
# one near the capacity of an 80 GB GPU), one MoE layer's grouped GEMM against its loop over
# experts and a small MoE model's MFU beside the dense one of the same active size
# (benchmarks/moe_gpu.py), and last a short bf16 training demo on a local text corpus (no
# network needed). Every figure goes into one results folder, with BENCHMARKS-snippet.md, a
# markdown table for BENCHMARKS.md.
#
# Without CUDA it says so, runs the CPU parts (calibrate --quick, a tiny CPU MFU run, a tiny
# MoE run of the loop kernel, a few fp32 demo steps), lists what it skipped and exits 0.
#
# Environment: PTDP_GPU_CHECK_OUT=DIR the results folder (default runs/gpu-check/DATE);
# PTDP_GPU_CHECK_QUICK=1 only calibrate --quick and the report (the script's own test);
# PTDP_GPU_CHECK_BUDGET_S=N seconds for the whole check (default 540, so that a lent GPU's
# ten-minute call still returns the report): each part's time limit is cut to what is left,
# and a part that would start with under 30 s left is skipped and named;
# PYTHON the interpreter with torch (default: python3). Writes no tracked file.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${PTDP_GPU_CHECK_OUT:-runs/gpu-check/$(date +%Y-%m-%d-%H%M%S)}
QUICK=${PTDP_GPU_CHECK_QUICK:-0}
BUDGET=${PTDP_GPU_CHECK_BUDGET_S:-540}
mkdir -p "$OUT"
: > "$OUT/status.tsv"
tracked_before=$(git status --porcelain --untracked-files=no 2>/dev/null || true)

# part NAME SECONDS COMMAND...: run it with a time limit (cut to the budget left), log it,
# record ok/failed; skipped when the budget has under 30 s left.
part() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 30 ]; then
    skip "$name" "out of time: ${left}s of the ${BUDGET}s budget left"
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name (up to ${limit}s): $*"
  local start=$SECONDS
  if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
    printf '%s\tok (%ss)\n' "$name" $((SECONDS - start)) >> "$OUT/status.tsv"
  else
    printf '%s\tFAILED (exit %s, %ss; see %s.log)\n' "$name" "$?" $((SECONDS - start)) "$name" >> "$OUT/status.tsv"
  fi
  tail -n 15 "$OUT/$name.log"
}
skip() {
  echo "== $1: skipped ($2)"
  printf '%s\tskipped: %s\n' "$1" "$2" >> "$OUT/status.tsv"
}

if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  CUDA=1
  "$PY" -c 'import torch; print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__)'
else
  CUDA=0
  echo "no CUDA device here: running the CPU parts only"
fi
mapfile -t CUDA_TESTS < <("$PY" scripts/gpu_check_report.py cuda-tests)

if [ "$CUDA" = 1 ]; then
  # The measurements first (a lent GPU's call may end before the rest); each MFU row is
  # written as it is measured, so a cut run keeps the rows it has.
  part calibrate 180 "$PY" -m ptdp calibrate --out "$OUT/calibration.toml"
  part mfu 300 "$PY" benchmarks/mfu.py --models 125m,1.3b --compare --steps 10 --warmup 3 \
    --predict "$OUT/calibration.toml" --json "$OUT/mfu.json"
  part cuda-tests 180 "$PY" -m pytest -q -rs -p no:cacheprovider "${CUDA_TESTS[@]}"
  part memory 120 "$PY" benchmarks/memory_phases.py --models 1.3b,4b --no-compile \
    --json "$OUT/memory.json"
  part moe 120 "$PY" benchmarks/moe_gpu.py --reps 20 --steps 10 --warmup 3 --json "$OUT/moe.json"
  # The zero-bubble split's (B + W) / fused on the 1.3B layer phase by phase (calibrate
  # wrote the model's figure above), launch overhead at 125M (eager, fused AdamW, compile,
  # CUDA graphs; rows written as measured) and a profiler trace of the 1.3B step (eager +
  # fused AdamW: no compile time in the part): issue 43 items 6, 3 and 4.
  part split-backward 40 "$PY" benchmarks/split_backward.py --device cuda --dtype bf16 \
    --preset 1.3b --rounds 5 --json "$OUT/split_backward.json"
  part small-speed 90 "$PY" benchmarks/small_model_speed.py --models 125m --steps 10 \
    --warmup 3 --json "$OUT/small_speed.json"
  part profile-1.3b 60 "$PY" benchmarks/small_model_speed.py --models 1.3b --modes fused-adamw \
    --steps 3 --warmup 2 --profile "$OUT/profile" --json "$OUT/profile_1.3b.json"
  DEMO_ARGS=(--train.precision bf16 --train.device cuda --train.steps 60)
else
  skip cuda-tests "no CUDA: ${#CUDA_TESTS[@]} tests need a GPU: ${CUDA_TESTS[*]}"
  part calibrate 300 "$PY" -m ptdp calibrate --quick --out "$OUT/calibration.toml"
  if [ "$QUICK" = 1 ]; then
    skip mfu "no CUDA; quick mode: no CPU run either"
    skip moe "no CUDA; quick mode: no CPU run either"
  else
    part mfu 300 "$PY" benchmarks/mfu.py --device cpu --models tiny --steps 3 --warmup 1 \
      --no-compile --compare --peers plain-gpt --precision fp32 \
      --predict "$OUT/calibration.toml" --json "$OUT/mfu.json"
    part moe 60 "$PY" benchmarks/moe_gpu.py --device cpu --reps 3 --steps 2 --warmup 1 \
      --vocab-size 512 --json "$OUT/moe.json"
  fi
  skip small-speed "no CUDA: fused AdamW, compile and CUDA graphs are measured on a GPU"
  skip profile-1.3b "no CUDA: the 1.3B step is profiled on a GPU"
  if [ "$QUICK" = 1 ]; then
    skip split-backward "quick mode"
  else
    part split-backward 60 "$PY" benchmarks/split_backward.py --hidden 256 --rounds 3 \
      --json "$OUT/split_backward.json"
  fi
  DEMO_ARGS=(--train.device cpu --train.steps 6)
fi

if [ "$QUICK" = 1 ]; then
  skip demo "quick mode"
else
  # A local corpus (this repository's documentation), bytes as tokens: no download.
  part preprocess 120 "$PY" -m ptdp preprocess --input README.md BENCHMARKS.md \
    --output-prefix "$OUT/data/docs" --tokenizer bytes
  part demo 240 "$PY" -m ptdp train --config configs/demo.toml --data.path "$OUT/data/docs" \
    --train.run_dir "$OUT/demo" --train.eval_interval 0 --train.save_interval 0 "${DEMO_ARGS[@]}"
fi
if [ "$CUDA" = 0 ]; then
  skip memory "no CUDA: it reads torch.cuda's memory counters"
  echo "skipped without CUDA: the CUDA-only tests, ptdp calibrate's full GPU sweep, the 125M/1.3B MFU runs, the bf16 demo, the memory phases, the grouped MoE kernel"
fi

"$PY" scripts/gpu_check_report.py report "$OUT"
tracked_after=$(git status --porcelain --untracked-files=no 2>/dev/null || true)
if [ "$tracked_before" != "$tracked_after" ]; then
  echo "warning: tracked files changed during the check:"; echo "$tracked_after"
fi
echo "results in $OUT (table: $OUT/BENCHMARKS-snippet.md)"
exit 0
