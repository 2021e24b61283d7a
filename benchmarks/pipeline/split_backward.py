"""The cost of a split backward (zero-bubble B then W) against the fused one, one process.

A zero-bubble schedule pays nothing for its split only if time(B) + time(W) equals the
fused backward's time (issue 17's target: at most 1.05 of it). Measured on a chunk of
transformer layers (no embedding, no output layer: a middle pipeline stage) of ptdp's
own `GPT`, in each round, alternately:

* fused: forward, then `torch.autograd.backward` (the runtime's BW);
* split: forward under the chunk's `WeightGradStore.capture`, B = the whole backward under
  `deferring` (input gradient, non-linear parameters' gradients, the linear layers' dW
  GEMMs kept), W = `flush` + one accumulation, as `PipelineRuntime` runs them;
* before: the split as the runtime did it until the layers could defer their weight
  gradients: B = `autograd.grad(out, x, retain_graph=True)`, W = a second backward over
  the parameters (re-walking the graph).

Times are medians over `--rounds` rounds; each ratio is the median over rounds of the
ratio within a round (the machine's load drifts less within one round than across rounds).
W's share is time(W) / (time(B) + time(W)). Prints a table; writes a JSON file only with
`--json PATH`. On a GPU (`--device cuda --dtype bf16`) each phase is timed between device
synchronisations; `--preset 1.3b` is the 1.3B GPT's layer (h 2048, 16 heads, s 2048,
micro-batch 8: benchmarks/speed/mfu.py's shape), the (B + W) / fused that `ptdp calibrate`
writes for a GPU as `split_backward_ratio` (scripts/gpu-check.sh runs both).

    python benchmarks/pipeline/split_backward.py                        # h 256 (demo) and h 512
    python benchmarks/pipeline/split_backward.py --hidden 256 1024 --rounds 9
    python benchmarks/pipeline/split_backward.py --device cuda --dtype bf16 --preset 1.3b \\
        --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ptdp.config.sections import ModelConfig
from ptdp.model.gpt import GPT
from ptdp.parallel.wgrad import accumulate_grads

PRESETS = {"1.3b": {"hidden": [2048], "heads": 16, "seq": 2048, "batch": 8, "layers": 2}}
"""Named layer shapes (benchmarks/speed/mfu.py's 1.3B: two of its 24 layers, a stage's chunk)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(hidden: int, args: argparse.Namespace) -> GPT:
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=hidden,
        num_heads=args.heads,
        seq_length=args.seq,
        vocab_size=128,  # unused: the chunk has neither embedding nor output layer
        dropout=0.0,
    )
    chunk = GPT(cfg, seed=0, has_embedding=False, has_head=False)
    return chunk.to(device=args.device, dtype=DTYPES[args.dtype])


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object]) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def fused(chunk: GPT, x: torch.Tensor, dy: torch.Tensor) -> dict[str, float]:
    out = chunk(x)
    return {"fused": _timed(lambda: torch.autograd.backward(out, dy))}


def split(chunk: GPT, x: torch.Tensor, dy: torch.Tensor) -> dict[str, float]:
    store, params = chunk.wgrad, list(chunk.parameters())
    with store.capture():
        out = chunk(x)
    held = []

    def b() -> None:
        with store.deferring(0):
            grads = torch.autograd.grad(out, [x, *params], dy, allow_unused=True)
        held.extend((p, g) for p, g in zip(params, grads[1:]) if g is not None)

    def w() -> None:
        accumulate_grads(held + store.flush(0))

    return {"B": _timed(b), "W": _timed(w)}


def before(chunk: GPT, x: torch.Tensor, dy: torch.Tensor) -> dict[str, float]:
    out = chunk(x)
    params = list(chunk.parameters())
    b = _timed(lambda: torch.autograd.grad(out, x, dy, retain_graph=True))
    w = _timed(lambda: torch.autograd.backward(out, dy, inputs=params))
    return {"old B": b, "old W": w}


def measure(hidden: int, args: argparse.Namespace) -> dict[str, list[float]]:
    chunk = build(hidden, args)
    g = torch.Generator().manual_seed(0)
    like = {"device": args.device, "dtype": DTYPES[args.dtype]}
    x = torch.randn(args.seq, args.batch, hidden, generator=g).to(**like).requires_grad_()
    dy = torch.randn(args.seq, args.batch, hidden, generator=g).to(**like)
    times: dict[str, list[float]] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for run in (fused, split, before):
            for p in chunk.parameters():
                p.grad = None
            for name, seconds in run(chunk, x, dy).items():
                if round_:
                    times.setdefault(name, []).append(seconds)
    return times


def per_round(rounds: dict[str, list[float]], *parts: str) -> float:
    """Median over rounds of sum(parts) / fused, each within one round."""
    each = zip(*(rounds[p] for p in parts), rounds["fused"])
    return statistics.median(sum(x[:-1]) / x[-1] for x in each)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a named layer shape")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    for key, value in PRESETS.get(args.preset, {}).items():
        setattr(args, key, value)
    machine = (
        torch.cuda.get_device_name(args.device)
        if args.device.startswith("cuda")
        else f"{platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} threads"
    )
    print(
        f"{machine}, torch {torch.__version__}, {args.dtype}; {args.layers} layers, "
        f"s {args.seq}, b {args.batch}, {args.heads} heads, median of {args.rounds} rounds"
    )
    print(
        "| h | fused ms | B ms | W ms | (B+W)/fused | W share | before: (B+W)/fused |\n"
        "|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = []
    for hidden in args.hidden:
        rounds = measure(hidden, args)
        t = {k: statistics.median(v) * 1e3 for k, v in rounds.items()}
        share = statistics.median(w / (b + w) for b, w in zip(rounds["B"], rounds["W"]))
        ratio, old = per_round(rounds, "B", "W"), per_round(rounds, "old B", "old W")
        print(
            f"| {hidden} | {t['fused']:.1f} | {t['B']:.1f} | {t['W']:.1f} | {ratio:.3f} "
            f"| {share:.1%} | {old:.3f} |"
        )
        rows.append({"hidden": hidden, "ms": t, "split_over_fused": ratio, "w_share": share})
        rows[-1]["before_over_fused"] = old
    if args.json:
        shape = {k: getattr(args, k) for k in ("layers", "heads", "seq", "batch", "dtype")}
        record = {"machine": machine, "torch": torch.__version__, **shape, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
