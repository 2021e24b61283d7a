"""The fused MoE dispatch and combine against the reference path, on CPU ranks (gloo).

The MoE version of the demo model that `expert_parallel.py` trains (6 layers, h = 256,
s = 256; 8 experts of the MLP's width, 2 per token, the Switch balancing loss), on 4 ranks
of one thread each at ep = 4 (the experts split over the 4 data-parallel ranks), micro-batch
4, global batch 16, on a byte-level corpus made from this repository's text. Three ways of
running the MoE layers, switched on the same processes between rounds:

- `reference`: the path before `ptdp.model.dispatch` (two sorts in the plan, a sort and an
  unsort on the receiving member, a [t * k, h] buffer and a weighted sum to combine) with
  one GEMM per expert (`GemmKernel.LOOP`): the code as it was;
- `fused-loop`: the fused dispatch (`Dispatcher.FUSED`) with the same loop of GEMMs: what
  the dispatch alone changes;
- `fused`: the fused dispatch with grouped_mm's CPU kernel (`GemmKernel.UNPADDED`, the
  default on a CPU now).

1. One MoE layer's forward and backward on its own (the demo's layer shapes; every rank its
   own 1024 tokens), ms per pass.
2. Training steps of the whole model, tokens/s.

Each part times alternating rounds (the order rotates every round, so machine noise hits
every variant alike) and reports medians. The figures go to runs/benchmarks/moe_dispatch.json
(`--out`); a run rewrites no tracked file.

    python benchmarks/parallelism/moe_dispatch.py [--steps 2 --rounds 5 --layer-rounds 9]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.corpus import repo_corpus
from benchmarks.common.spawn import spawn
from ptdp.config.files import apply_updates, load_toml
from ptdp.model.dispatch import Dispatcher
from ptdp.model.moe import MoE, MoEState
from ptdp.model.parts import TPContext
from ptdp.parallel import comm, grouped, wgrad
from ptdp.parallel.env import LaunchEnv
from ptdp.parallel.grouped import GemmKernel
from ptdp.train.run import prepare
from ptdp.train.step.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
MOE = {"num_experts": 8, "moe_top_k": 2, "moe_aux_loss_coeff": 0.01}
MICRO, GLOBAL, WORLD = 4, 16, 4
VARIANTS = {
    "reference": (Dispatcher.REFERENCE, GemmKernel.LOOP),
    "fused-loop": (Dispatcher.FUSED, GemmKernel.LOOP),
    "fused": (Dispatcher.FUSED, None),  # None: choose_gemm's own choice
}


def _config(data: str, run_dir: str):
    cfg = load_toml(ROOT / "configs" / "demo.toml")
    return apply_updates(
        cfg,
        {
            "model": MOE,
            "data": {"path": data},
            "parallel": {"ep": WORLD},
            "train": {
                "micro_batch_size": MICRO, "global_batch_size": GLOBAL, "progress": False,
                "device": "cpu", "run_dir": run_dir, "log_interval": 1000,
            },
        },
        "benchmark",
    )  # fmt: skip


@contextlib.contextmanager
def variant(blocks: list[MoE], name: str) -> Iterator[None]:
    """Run `blocks` the variant's way: its dispatcher, and its GEMM kernel forced (as
    benchmarks/speed/moe_gpu.py forces one: `grouped_linear` asks `choose_gemm` once per
    forward, its backward reuses the answer)."""
    dispatcher, kernel = VARIANTS[name]
    for block in blocks:
        block.dispatcher = dispatcher
    if kernel is None:
        yield
        return
    choose = lambda x, weight: kernel  # noqa: E731
    with mock.patch.object(wgrad, "choose_gemm", choose):
        with mock.patch.object(grouped, "choose_gemm", choose):
            yield


def _rounds(run, names: list[str], rounds: int, repeat: int) -> dict[str, list[float]]:
    """Seconds per call of `run(name)`, `repeat` calls a round, the order rotated each round."""
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up
        run(name)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeat):
                run(name)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / repeat)
    return times


def layer_worker(rank: int, world: int, data: str, root: str, rounds: int) -> dict:
    """One MoE layer of the demo model, experts over the 4 ranks: forward and backward."""
    cfg, _, _ = prepare(_config(data, f"{root}/layer"), LaunchEnv(rank, world, rank))
    m = cfg.model
    torch.manual_seed(rank)
    block = MoE(m, TPContext(ep=comm.world_group()), layer=1, state=MoEState()).train()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    x = torch.randn(m.seq_length, MICRO, m.hidden_size, requires_grad=True)
    dy = torch.randn_like(x)

    def run(name: str) -> None:
        with variant([block], name):
            block.zero_grad()
            block(x).backward(dy)

    times = _rounds(run, list(VARIANTS), rounds, 3)
    return {k: [1e3 * t for t in v] for k, v in times.items()}


def step_worker(rank: int, world: int, data: str, root: str, steps: int, rounds: int) -> dict:
    env = LaunchEnv(rank, world, rank)
    cfg, layout, run_data = prepare(_config(data, f"{root}/steps"), env)
    trainer = Trainer(cfg, layout, env, run_data)
    blocks = [b for chunk in trainer.chunks for b in chunk.moe_layers().values()]

    def run(name: str) -> None:
        with variant(blocks, name):
            trainer.train_step()

    times = _rounds(run, list(VARIANTS), rounds, steps)
    return {k: [trainer.tokens_per_step / t for t in v] for k, v in times.items()}


def _table(values: dict[str, list[float]], unit: str, better_high: bool) -> dict[str, float]:
    med = {k: statistics.median(v) for k, v in values.items()}
    base = med["reference"]
    for name, value in med.items():
        ratio = value / base if better_high else base / value
        print(f"   {name:>10}: median {value:,.1f} {unit}, speed-up {ratio:.3f} x the reference")
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="training steps per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per variant, training")
    parser.add_argument("--layer-rounds", type=int, default=9, help="rounds per variant, layer")
    parser.add_argument("--part", choices=("1", "2", "all"), default="all")
    parser.add_argument("--out", default=str(ROOT / "runs" / "benchmarks" / "moe_dispatch.json"))
    args = parser.parse_args()
    result: dict = {"world": WORLD, "ep": WORLD, "variants": list(VARIANTS)}
    with tempfile.TemporaryDirectory() as tmp:
        data, root = repo_corpus(Path(tmp) / "data"), str(Path(tmp) / "runs")
        if args.part in ("1", "all"):
            print(f"1. one MoE layer, forward + backward, {WORLD} ranks at ep = {WORLD}")
            ms = spawn(layer_worker, WORLD, data, root, args.layer_rounds, timeout_s=1800)
            result["layer_ms"] = ms
            result["layer_ms_median"] = _table(ms, "ms", better_high=False)
        if args.part in ("2", "all"):
            print(f"2. training, {WORLD} ranks at ep = {WORLD}, global batch {GLOBAL} x 256")
            speeds = spawn(step_worker, WORLD, data, root, args.steps, args.rounds, timeout_s=1800)
            result["tokens_per_s"] = speeds
            result["tokens_per_s_median"] = _table(speeds, "tokens/s", better_high=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
