#!/usr/bin/env bash
# One call on a lent GPU (one H100 or H200, under ten minutes), the most wanted figures first:
# the peers installed from peers/wheels (scripts/fetch-peers.sh, run beforehand where an index
# is reachable), then benchmarks/speed/mfu.py with Llama layers for the ~125M and ~1.3B models: ptdp,
# TorchTitan and Megatron-Core side by side in bf16, then the 1.3B in fp8 (tensorwise, rowwise)
# for each (a row that cannot run says why), ptdp's own GPT rows, every CUDA-only test,
# `ptdp calibrate` for the GPU, and as time allows the memory phases of a 1.3B and a 4B model
# (benchmarks/memory/memory_phases.py), the MoE kernels and model (benchmarks/speed/moe_gpu.py), the
# experts in bf16 and fp8 (benchmarks/speed/moe_layer.py) and a short
# bf16 training demo on a local text corpus. Every figure goes into one results folder, with
# BENCHMARKS-snippet.md, a markdown table for BENCHMARKS.md, and pip-freeze.txt (the
# machine's packages: PTDP_PEER_HAVE for the next fetch).
#
#   bash scripts/gpu-check.sh            # the ten-minute check
#   bash scripts/gpu-check.sh --suite    # a second call: the whole CPU test suite under this
#                                        # machine's own torch (pytest -n 16), counts recorded
#
# Without CUDA it says so, runs the CPU parts (calibrate --quick, a tiny CPU MFU run, a tiny
# MoE run of the loop kernel, a few fp32 demo steps), lists what it skipped and exits 0.
#
# Environment: PTDP_GPU_CHECK_OUT=DIR the results folder (default runs/gpu-check/DATE);
# PTDP_GPU_CHECK_QUICK=1 only calibrate --quick and the report (the script's own test);
# PTDP_GPU_CHECK_BUDGET_S=N seconds for the whole check (default 540, so that a lent GPU's
# ten-minute call still returns the report): each part's time limit is cut to what is left,
# and a part that would start with under 30 s left is skipped and named;
# PTDP_GPU_CHECK_PARTS=a,b only these parts (names as in the table; --suite: peers-install,suite);
# PTDP_PEER_WHEELS=DIR the peers' wheels (default peers/wheels);
# PYTHON the interpreter with torch (default: python3). Writes no tracked file.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${PTDP_GPU_CHECK_OUT:-runs/gpu-check/$(date +%Y-%m-%d-%H%M%S)}
QUICK=${PTDP_GPU_CHECK_QUICK:-0}
BUDGET=${PTDP_GPU_CHECK_BUDGET_S:-540}
PARTS=${PTDP_GPU_CHECK_PARTS:-}
WHEELS=${PTDP_PEER_WHEELS:-peers/wheels}
[ "${1:-}" = "--suite" ] && PARTS=peers-install,suite
SUITE=0
[[ ",$PARTS," == *",suite,"* ]] && SUITE=1
mkdir -p "$OUT"
: > "$OUT/status.tsv"
tracked_before=$(git status --porcelain --untracked-files=no 2>/dev/null || true)

# part NAME SECONDS COMMAND...: run it with a time limit (cut to the budget left), log it,
# record ok/failed; skipped when the budget has under 30 s left or PARTS leaves it out.
part() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ -n "$PARTS" ] && [[ ",$PARTS," != *",$name,"* ]]; then
    skip "$name" "not in PTDP_GPU_CHECK_PARTS=$PARTS"
    return
  fi
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
# The peers and what else the machine lacks of peers/wheels, into peers/site (on PYTHONPATH
# after this repository); the machine's own torch is never replaced.
install_peers() {
  if [ ! -f "$WHEELS/pins.txt" ]; then
    skip peers-install "no $WHEELS/pins.txt: run scripts/fetch-peers.sh where an index is reachable"
    return
  fi
  mapfile -t PINS < <("$PY" scripts/gpu_check_report.py peer-pins "$WHEELS/pins.txt")
  part peers-install 30 "$PY" -m pip install --quiet --no-index --no-deps --no-compile \
    --upgrade --target peers/site --find-links "$WHEELS" "${PINS[@]}"
  export PYTHONPATH="$PYTHONPATH:$PWD/peers/site"
}

if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  CUDA=1
  "$PY" -c 'import torch; print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__)'
else
  CUDA=0
  echo "no CUDA device here: running the CPU parts only"
fi
"$PY" -c 'import sys, torch; print(torch.__version__, sys.version.split()[0])' > "$OUT/torch.txt" 2>&1
"$PY" -m pip freeze > "$OUT/pip-freeze.txt" 2>/dev/null || true
mapfile -t CUDA_TESTS < <("$PY" scripts/gpu_check_report.py cuda-tests)

if [ "$SUITE" = 1 ]; then
  # The whole CPU suite under this machine's torch (the bound in pyproject.toml is the oldest
  # torch it has passed on); pytest-xdist spreads it over the cores when it is there.
  [ "$CUDA" = 1 ] && install_peers
  XDIST=()
  "$PY" -c 'import xdist' 2>/dev/null && XDIST=(-n "${PTDP_GPU_CHECK_WORKERS:-16}")
  part suite 540 "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" \
    --junitxml "$OUT/suite.xml" tests
elif [ "$CUDA" = 1 ]; then
  # Each MFU row is written as it is measured, so a part cut at its limit keeps its rows.
  install_peers
  part mfu 330 "$PY" benchmarks/speed/mfu.py --arch llama --models 125m,1.3b --compare \
    --fp8 tensorwise,rowwise --fp8-models 1.3b --steps 10 --warmup 3 --time-limit 300 \
    --json "$OUT/mfu.json"
  part mfu-gpt 90 "$PY" benchmarks/speed/mfu.py --models 125m,1.3b --steps 10 --warmup 3 \
    --json "$OUT/mfu-gpt.json"
  part cuda-tests 50 "$PY" -m pytest -q -rs -p no:cacheprovider "${CUDA_TESTS[@]}"
  part calibrate 40 "$PY" -m ptdp calibrate --out "$OUT/calibration.toml"
  part memory 120 "$PY" benchmarks/memory/memory_phases.py --models 1.3b,4b --no-compile \
    --json "$OUT/memory.json"
  part moe 120 "$PY" benchmarks/speed/moe_gpu.py --reps 20 --steps 10 --warmup 3 --json "$OUT/moe.json"
  part moe-fp8 60 "$PY" benchmarks/speed/moe_layer.py --reps 20 --json "$OUT/moe_layer.json"
  # The zero-bubble split's (B + W) / fused on the 1.3B layer phase by phase (calibrate
  # wrote the model's figure above), launch overhead at 125M (eager, fused AdamW, compile,
  # CUDA graphs; rows written as measured) and a profiler trace of the 1.3B step (eager +
  # fused AdamW: no compile time in the part): issue 43 items 6, 3 and 4.
  part split-backward 40 "$PY" benchmarks/pipeline/split_backward.py --device cuda --dtype bf16 \
    --preset 1.3b --rounds 5 --json "$OUT/split_backward.json"
  part small-speed 90 "$PY" benchmarks/speed/small_model_speed.py --models 125m --steps 10 \
    --warmup 3 --json "$OUT/small_speed.json"
  part profile-1.3b 60 "$PY" benchmarks/speed/small_model_speed.py --models 1.3b --modes fused-adamw \
    --steps 3 --warmup 2 --profile "$OUT/profile" --json "$OUT/profile_1.3b.json"
  DEMO_ARGS=(--train.precision bf16 --train.device cuda --train.steps 60)
else
  skip cuda-tests "no CUDA: ${#CUDA_TESTS[@]} tests need a GPU: ${CUDA_TESTS[*]}"
  part calibrate 300 "$PY" -m ptdp calibrate --quick --out "$OUT/calibration.toml"
  if [ "$QUICK" = 1 ]; then
    skip mfu "no CUDA; quick mode: no CPU run either"
    skip moe "no CUDA; quick mode: no CPU run either"
  else
    part mfu 300 "$PY" benchmarks/speed/mfu.py --device cpu --models tiny --steps 3 --warmup 1 \
      --no-compile --compare --arch llama --fp8 tensorwise --precision fp32 \
      --predict "$OUT/calibration.toml" --json "$OUT/mfu.json"
    part moe 60 "$PY" benchmarks/speed/moe_gpu.py --device cpu --reps 3 --steps 2 --warmup 1 \
      --vocab-size 512 --json "$OUT/moe.json"
  fi
  skip moe-fp8 "no CUDA: the experts' float8 kernels run on a GPU (tests/unit/test_fp8_moe.py checks the CPU emulation)"
  skip small-speed "no CUDA: fused AdamW, compile and CUDA graphs are measured on a GPU"
  skip profile-1.3b "no CUDA: the 1.3B step is profiled on a GPU"
  if [ "$QUICK" = 1 ]; then
    skip split-backward "quick mode"
  else
    part split-backward 60 "$PY" benchmarks/pipeline/split_backward.py --hidden 256 --rounds 3 \
      --json "$OUT/split_backward.json"
  fi
  DEMO_ARGS=(--train.device cpu --train.steps 6)
fi

if [ "$SUITE" = 1 ]; then
  :
elif [ "$QUICK" = 1 ]; then
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
  echo "skipped without CUDA: the CUDA-only tests, ptdp calibrate's full GPU sweep, the 125M/1.3B MFU runs beside TorchTitan and Megatron-Core (bf16 and fp8), the bf16 demo, the memory phases, the grouped MoE kernel"
fi

"$PY" scripts/gpu_check_report.py report "$OUT"
tracked_after=$(git status --porcelain --untracked-files=no 2>/dev/null || true)
if [ "$tracked_before" != "$tracked_after" ]; then
  echo "warning: tracked files changed during the check:"; echo "$tracked_after"
fi
echo "results in $OUT (table: $OUT/BENCHMARKS-snippet.md)"
exit 0
