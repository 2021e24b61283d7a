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

1. The dispatch and combine alone, forward and backward: the plan, the rows to the experts'
   members and back, weighted into their tokens, with a scaling for the experts (the
   demo's layer shapes: every rank its own 1024 tokens, routed by the layer's router), ms
   per pass, at ep = 1 (every rank on its own) and ep = 4; the GEMM kernel plays no part.
2. One MoE layer's forward and backward on its own, ms per pass.
3. Training steps of the whole model, tokens/s.

Each part times alternating rounds (the order rotates every round, so machine noise hits
every variant alike) and reports medians of the wall time and of the CPU time the ranks
spent (summed over the ranks, per pass or per token): on a shared machine the CPU time
moves less with the neighbours' load than the wall time does. The figures go to
runs/benchmarks/moe_dispatch.json (`--out`); a run rewrites no tracked file.

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

import benchmarks.parallelism.expert_parallel as ep_bench
from benchmarks.common.corpus import repo_corpus
from benchmarks.common.spawn import spawn
from ptdp.model.dispatch import PLANS, Dispatcher, capacity, dispatch_combine
from ptdp.model.moe import MoE, MoEState
from ptdp.model.parts import TPContext
from ptdp.parallel import comm, grouped, wgrad
from ptdp.parallel.comm import Group
from ptdp.parallel.env import LaunchEnv
from ptdp.parallel.grouped import GemmKernel
from ptdp.train.run import prepare
from ptdp.train.step.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
MICRO, GLOBAL, WORLD = ep_bench.MICRO, ep_bench.GLOBAL, 4
VARIANTS = {
    "reference": (Dispatcher.REFERENCE, GemmKernel.LOOP),
    "fused-loop": (Dispatcher.FUSED, GemmKernel.LOOP),
    "fused": (Dispatcher.FUSED, None),  # None: choose_gemm's own choice
}


def _config(data: str, run_dir: str):
    """expert_parallel.py's MoE demo model (the same model and batch) at ep = WORLD."""
    return ep_bench._config(data, run_dir, {"ep": WORLD})


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


def _rounds(run, names: list[str], rounds: int, repeat: int) -> dict[str, dict[str, list]]:
    """Wall seconds per call of `run(name)` and CPU seconds per call summed over the ranks,
    `repeat` calls a round, the order rotated each round."""
    times = {n: {"wall": [], "cpu": []} for n in names}
    for name in names:  # warm-up
        run(name)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(repeat):
                run(name)
            spent = torch.tensor(time.process_time() - cpu, dtype=torch.float64)
            dist.barrier()
            times[name]["wall"].append((time.perf_counter() - start) / repeat)
            dist.all_reduce(spent)
            times[name]["cpu"].append(spent.item() / repeat)
    return times


def _scaled(times: dict[str, dict[str, list]], factor: float, invert: bool = False) -> dict:
    """times * factor (or factor / times)."""
    return {
        n: {k: [factor / t if invert else t * factor for t in v] for k, v in kinds.items()}
        for n, kinds in times.items()
    }


def layer_worker(rank: int, world: int, data: str, root: str, rounds: int) -> dict:
    """The dispatch and combine alone, then one MoE layer of the demo model, experts over
    the 4 ranks: forward and backward."""
    cfg, _, _ = prepare(_config(data, f"{root}/layer"), LaunchEnv(rank, world, rank))
    m = cfg.model
    torch.manual_seed(rank)
    block = MoE(m, TPContext(ep=comm.world_group()), layer=1, state=MoEState()).train()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    x = torch.randn(m.seq_length, MICRO, m.hidden_size, requires_grad=True)
    dy = torch.randn_like(x)

    tokens = x.detach().reshape(-1, m.hidden_size).requires_grad_()
    with torch.no_grad():
        routing = block.router(tokens)
    weights = routing.weights.requires_grad_()
    cap = capacity(m.moe_capacity_factor, len(tokens), m.moe_top_k, m.num_experts)

    def scaled(rows: torch.Tensor, counts: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        return rows * 1.5

    def move(name: str, ep: Group = block.ctx.ep) -> None:
        dispatcher = Dispatcher(name)
        plan = PLANS[dispatcher](routing, m.num_experts, cap)
        out, _ = dispatch_combine(tokens, plan, weights, scaled, ep, dispatcher)
        out.backward(dy.view_as(out))

    def alone(name: str) -> None:  # every rank all the experts: no all-to-all
        move(name, Group.single())

    def run(name: str) -> None:
        with variant([block], name):
            block.zero_grad()
            block(x).backward(dy)

    names = [d.value for d in Dispatcher]
    return {
        "dispatch_ep1_ms": _scaled(_rounds(alone, names, rounds, 5), 1e3),
        "dispatch_ms": _scaled(_rounds(move, names, rounds, 5), 1e3),
        "layer_ms": _scaled(_rounds(run, list(VARIANTS), rounds, 3), 1e3),
    }


def step_worker(rank: int, world: int, data: str, root: str, steps: int, rounds: int) -> dict:
    env = LaunchEnv(rank, world, rank)
    cfg, layout, run_data = prepare(_config(data, f"{root}/steps"), env)
    trainer = Trainer(cfg, layout, env, run_data)
    blocks = [b for chunk in trainer.chunks for b in chunk.moe_layers().values()]

    def run(name: str) -> None:
        with variant(blocks, name):
            trainer.train_step()

    times = _rounds(run, list(VARIANTS), rounds, steps)
    return _scaled(times, trainer.tokens_per_step, invert=True)


def _table(values: dict[str, dict[str, list]], unit: str, better_high: bool) -> dict:
    """Print and return the medians, wall and CPU, with each one's ratio to the reference."""
    med = {n: {k: statistics.median(v) for k, v in kinds.items()} for n, kinds in values.items()}
    base = med["reference"]
    for name, kinds in med.items():
        cells = []
        for kind, value in kinds.items():
            ratio = value / base[kind] if better_high else base[kind] / value
            cells.append(f"{kind} {value:,.1f} {unit} ({ratio:.3f} x)")
        print(f"   {name:>10}: " + ", ".join(cells))
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="training steps per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per variant, training")
    parser.add_argument("--layer-rounds", type=int, default=9, help="rounds per variant, layer")
    parser.add_argument("--part", choices=("1", "2", "all"), default="all", help="1: parts 1-2")
    parser.add_argument("--out", default=str(ROOT / "runs" / "benchmarks" / "moe_dispatch.json"))
    args = parser.parse_args()
    result: dict = {"world": WORLD, "ep": WORLD, "variants": list(VARIANTS)}
    with tempfile.TemporaryDirectory() as tmp:
        data, root = repo_corpus(Path(tmp) / "data"), str(Path(tmp) / "runs")
        if args.part in ("1", "all"):
            ms = spawn(layer_worker, WORLD, data, root, args.layer_rounds, timeout_s=1800)
            print("1. dispatch and combine alone, forward + backward, ep = 1 (each rank alone)")
            print("   (wall ms per pass; CPU ms per pass, all ranks; the speed-up over reference)")
            result["dispatch_ep1_ms"] = ms["dispatch_ep1_ms"]
            result["dispatch_ep1_ms_median"] = _table(ms["dispatch_ep1_ms"], "ms", False)
            print(f"   and at ep = {WORLD}")
            result["dispatch_ms"] = ms["dispatch_ms"]
            result["dispatch_ms_median"] = _table(ms["dispatch_ms"], "ms", better_high=False)
            print(f"2. one MoE layer, forward + backward, {WORLD} ranks at ep = {WORLD}")
            result["layer_ms"] = ms["layer_ms"]
            result["layer_ms_median"] = _table(ms["layer_ms"], "ms", better_high=False)
        if args.part in ("2", "all"):
            print(f"3. training, {WORLD} ranks at ep = {WORLD}, global batch {GLOBAL} x 256")
            print("   (tokens per wall second; tokens per CPU second of all ranks)")
            speeds = spawn(step_worker, WORLD, data, root, args.steps, args.rounds, timeout_s=1800)
            result["tokens_per_s"] = speeds
            result["tokens_per_s_median"] = _table(speeds, "tokens/s", better_high=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
