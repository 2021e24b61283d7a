"""Pipeline schedules on real model chunks at p = 2: step time against each plan's ideal.

Issue 17's real-chunk benchmark. Two ranks (gloo, one thread each) hold the demo model's
layers (configs/demo.toml's model section: 6 layers, h 256, vocabulary 4,096 as the demo's
tokenizer gives), fp32 on CPU, split into the chunks of each schedule: 3 + 3 layers for
gpipe, 1f1b, zb-h1 and zb-h2; for zb-v (two chunks per rank in a V) stages of 2, 1, 2, 1
layers, so rank 0 (stages 0 and 3) and rank 1 (stages 1 and 2) hold 3 layers each as well.

Each round runs one step of every (schedule, m), so the machine's load drifts over all of
them alike; a step's time runs from the first rank's start to the last rank's end. Each
compute action is timed through the runtime's `around_action` hook, less the time it
waited inside for its received input (`around_wait`), so F, B and W (or BW) per chunk are
compute only; replaying the plan with their medians and free transfers (`ptdp.perf.simulate.replay`)
gives the schedule's ideal step time, over all measured steps and per step (a step against
its own compute times, which load drifting between steps moves alike). Targets: measured /
ideal <= 1.05 and zb-h1 at least 8% faster than 1f1b at m = 4. One measured zb-v iteration
is drawn above its replay.

    python benchmarks/pipeline/pipeline_real.py                 # about 4 minutes on 2 cores
    python benchmarks/pipeline/pipeline_real.py --seq 32 --micro-batch 1 --ms 2 --iters 1  # s
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.spawn import spawn
from ptdp.config.files import apply_updates, load_toml
from ptdp.config.sections import RunConfig
from ptdp.parallel.mesh import MeshShape, ParallelMesh
from ptdp.perf.simulate.plot import plot_timelines
from ptdp.perf.simulate.replay import PipelineCosts, replay
from ptdp.pipeline.actions import Action, Kind
from ptdp.pipeline.plan import PipelinePlan
from ptdp.pipeline.timeline import Event, from_dicts, to_dicts
from ptdp.rules.layout import validate
from ptdp.train.step.pipelined import (
    Microbatch,
    PipelineStep,
    StepHooks,
    boundary_shape,
    build_chunks,
    build_p2p,
)

ROOT = Path(__file__).resolve().parents[2]
PNG = ROOT / "runs" / "benchmarks" / "zb_v_timeline.png"  # ignored runs/: no tracked file
PP = 2
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v")
LAYERS = {"zb-v": (2, 1, 2, 1)}  # layers per virtual stage; the others split evenly
VOCAB = 4096  # the demo's tokenizer (configs/demo.toml takes it from the data)


def demo_config(name: str, m: int, args: argparse.Namespace) -> RunConfig:
    """The demo's model section at `--seq`, over pp = 2 ranks with schedule `name`."""
    model = load_toml(ROOT / "configs" / "demo.toml").model
    model = replace(model, vocab_size=VOCAB, seq_length=args.seq)
    vpp = 2 if name == "zb-v" else 1
    parallel = {"pp": PP, "vpp": vpp, "schedule": name, "pipeline_layers": LAYERS.get(name, ())}
    train = {"micro_batch_size": args.micro_batch, "global_batch_size": args.micro_batch * m}
    updates = {"parallel": parallel, "train": train}
    return replace(apply_updates(RunConfig(), updates, "pipeline_real"), model=model)


class ComputeClock:
    """Times each compute action without its waits for received tensors.

    The runtime waits for an action's input inside the action (F for its activation, B or BW
    for its output gradient), before any compute, so the compute is [start + waited, end].
    """

    def __init__(self, rank: int) -> None:
        self.rank, self.recording = rank, False
        self.events: list[Event] = []
        self._waited = 0.0

    @contextmanager
    def around_action(self, a: Action) -> Iterator[None]:
        self._waited = 0.0
        start = time.perf_counter()
        yield
        end = time.perf_counter()
        if self.recording:
            compute_start = start + self._waited
            self.events.append(Event(self.rank, a.stage, a.mb, a.kind.value, compute_start, end))

    @contextmanager
    def around_wait(self, what: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self._waited += time.perf_counter() - start


class Case:
    """One (schedule, m) on this rank: its chunks, its step and what it measured."""

    def __init__(
        self, name: str, m: int, mesh: ParallelMesh, args: argparse.Namespace, shared: dict
    ) -> None:
        """`shared`: chunks by schedule, built once for all m of a schedule."""
        self.name, self.m = name, m
        cfg = demo_config(name, m, args)
        layout = validate(cfg, PP)
        self.plan: PipelinePlan = layout.pipeline
        if name not in shared:
            shared[name] = build_chunks(
                cfg.model, layout, mesh, seed=cfg.train.seed, recompute=cfg.parallel.recompute
            )
        self.chunks = shared[name]
        shape = boundary_shape(cfg.model, layout, args.micro_batch)
        cpu = torch.device("cpu")
        p2p = build_p2p(mesh, layout, shape, torch.float32, cpu, scatter_gather=False)
        self.clock = ComputeClock(mesh.coord("pp"))
        hooks = StepHooks(
            around_action=self.clock.around_action, around_wait=self.clock.around_wait
        )
        self.step = PipelineStep(self.plan, self.chunks, p2p, nullcontext, hooks)
        g = torch.Generator().manual_seed(m)
        self.tokens = torch.randint(0, VOCAB, (m * args.micro_batch, args.seq + 1), generator=g)
        self.mbs = args.micro_batch
        self.times: list[float] = []
        self.steps: list[list[Event]] = []  # per measured step, this rank's compute actions

    def batch(self, mb: int) -> Microbatch:
        rows = self.tokens[mb * self.mbs : (mb + 1) * self.mbs]
        return Microbatch(rows[:, :-1], rows[:, 1:])

    def run(self, measured: bool) -> None:
        for chunk in self.chunks.values():
            for p in chunk.parameters():
                p.grad = None
        self.clock.recording, self.clock.events = measured, []
        took = _span(_timed(lambda: self.step.train(self.batch)))
        if measured:
            self.times.append(took)
            self.steps.append(self.clock.events)


def _timed(step: Callable[[], object]) -> tuple[float, float]:
    """(start, end) of one step on this rank, started together with the other rank."""
    dist.barrier()
    start = time.perf_counter()
    step()
    return start, time.perf_counter()


def _span(start_end: tuple[float, float]) -> float:
    """The step's time over all ranks (perf_counter is one machine-wide clock)."""
    every: list[tuple[float, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, start_end)
    return max(e for _, e in every) - min(s for s, _ in every)


def _gather(steps: list[list[Event]]) -> list[list[dict]]:
    """Per step, every rank's events."""
    every: list[list[list[dict]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, [to_dicts(events) for events in steps])
    return [[row for rank in every for row in rank[i]] for i in range(len(steps))]


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    """Rounds over every (schedule, m); per case its step times and every rank's events."""
    mesh = ParallelMesh.build(MeshShape(tp=1, dp=1, pp=PP), rank)
    shared: dict = {}
    cases = [Case(name, m, mesh, args, shared) for name in args.schedules for m in args.ms]
    for i in range(args.warmup + args.iters):
        for case in cases:
            case.run(measured=i >= args.warmup)
        if rank == 0:
            print(f"  round {i + 1} of {args.warmup + args.iters} done", flush=True)
    return [
        {"schedule": c.name, "m": c.m, "times": c.times, "steps": _gather(c.steps)} for c in cases
    ]


# ----------------------------------------------------------------------------- report


def measured_costs(plan: PipelinePlan, events: list[Event]) -> PipelineCosts:
    """Per-chunk medians of the measured compute times: F, B and W, or BW (as B, W = 0)."""
    durations: dict[tuple[str, int], list[float]] = {}
    for e in events:
        durations.setdefault((e.kind, e.stage), []).append(e.seconds)

    def median(kind: Kind, stage: int) -> float:
        return statistics.median(durations.get((kind.value, stage), [0.0]))

    stages = range(plan.stages.stages)
    forward = tuple(median(Kind.F, s) for s in stages)
    split = any(k == Kind.B.value for k, _ in durations)
    first = Kind.B if split else Kind.BW
    backward = tuple(median(first, s) for s in stages)
    weight = tuple(median(Kind.W, s) if split else 0.0 for s in stages)
    zeros = (0.0,) * len(stages)
    return PipelineCosts(forward, backward, weight, zeros, zeros)


def analyse(row: dict, args: argparse.Namespace) -> dict:
    """The row's medians, its measured per-chunk costs and the ideal replay of its plan:
    over all measured steps, and per step (each step against its own compute times, which
    the machine's load drifting between steps moves alike)."""
    plan = validate(demo_config(row["schedule"], row["m"], args), PP).pipeline
    steps = [from_dicts(rows) for rows in row["steps"]]
    costs = measured_costs(plan, [e for events in steps for e in events])
    ideal = replay(plan.lowered, plan.stages, costs)
    own = [replay(plan.lowered, plan.stages, measured_costs(plan, events)) for events in steps]
    per_step = [took / run.makespan for took, run in zip(row["times"], own)]
    measured = statistics.median(row["times"])
    return row | {
        "plan": plan,
        "costs": costs,
        "ideal": ideal,
        "measured": measured,
        "per_step": statistics.median(per_step),
        "events": [e for events in steps for e in events],
        "last": steps[-1],
        "last_replay": own[-1],
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def tables(results: list[dict]) -> list[str]:
    lines = [
        "| schedule | m | measured ms | ideal ms | measured/ideal | per step | busiest rank's "
        "compute ms | ideal bubble | measured bubble |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        run, measured = r["ideal"], r["measured"]
        lines.append(
            f"| {r['schedule']} | {r['m']} | {_ms(measured)} | {_ms(run.makespan)} | "
            f"{measured / run.makespan:.3f} | {r['per_step']:.3f} | {_ms(run.ideal)} | "
            f"{run.bubble_fraction:.3f} | {(measured - run.ideal) / run.ideal:.3f} |"
        )
    lines += ["", "| schedule | m | per stage: F / B / W ms (BW: B, W = 0) |", "|---|---:|---|"]
    for r in results:
        c = r["costs"]
        parts = zip(c.forward, c.backward_input, c.backward_weight)
        stages = "; ".join(
            f"{s}: {f * 1e3:.0f}/{b * 1e3:.0f}/{w * 1e3:.0f}" for s, (f, b, w) in enumerate(parts)
        )
        lines.append(f"| {r['schedule']} | {r['m']} | {stages} |")
    return lines


def zb_h1_against_1f1b(results: list[dict]) -> list[str]:
    """zb-h1's step time over 1f1b's at each m: the ratio of medians and the median of the
    ratios within a round (less sensitive to load drifting between rounds)."""
    by = {(r["schedule"], r["m"]): r for r in results}
    lines = []
    for m in sorted({r["m"] for r in results}):
        zb, base = by.get(("zb-h1", m)), by.get(("1f1b", m))
        if zb is None or base is None:
            continue
        ratio = zb["measured"] / base["measured"]
        rounds = statistics.median(z / b for z, b in zip(zb["times"], base["times"]))
        verdict = f" (target <= 0.92: {'met' if ratio <= 0.92 else 'not met'})" if m == 4 else ""
        faster = "faster" if ratio < 1 else "slower"
        lines.append(
            f"m={m}: zb-h1 / 1f1b step time {ratio:.3f} ({abs(1 - ratio):.1%} {faster}; per round "
            f"{rounds:.3f}); ideal {zb['ideal'].makespan / base['ideal'].makespan:.3f}{verdict}"
        )
    return lines


def draw(result: dict, path: Path) -> Path:
    """The last measured zb-v iteration above its plan replayed with that step's per-chunk
    compute medians."""
    measured, run = result["last"], result["last_replay"]
    simulated = [e for e in run.events if e.lane == "compute"]
    m, took = result["m"], result["times"][-1]
    return plot_timelines(
        path,
        {
            f"measured (compute only: waits for input left out): step {_ms(took)} ms": measured,
            f"the plan replayed with this step's per-chunk F, B, W and free transfers: "
            f"{_ms(run.makespan)} ms": simulated,
        },
        title=f"zb-v on real chunks, p={PP}, v=2, m={m} (labels: stage.microbatch)",
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--ms", type=int, nargs="+", default=[2, 4, 8], help="microbatches")
    parser.add_argument("--seq", type=int, default=256, help="sequence length (demo: 256)")
    parser.add_argument("--micro-batch", type=int, default=4, help="micro-batch (demo: 8)")
    parser.add_argument("--iters", type=int, default=3, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=1, help="rounds before measuring")
    parser.add_argument("--timeout", type=float, default=600.0, help="gloo timeout, seconds")
    parser.add_argument("--png", default=str(PNG))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = spawn(worker, PP, args, timeout_s=args.timeout)
    took = time.perf_counter() - start
    results = [analyse(row, args) for row in rows]
    script = "benchmarks/pipeline/pipeline_real.py"
    command = " ".join(sys.argv if argv is None else [script, *argv])
    print(f"\ncommand: python {command}  ({took:.0f} s, {date.today()})")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, gloo, "
        f"{PP} ranks with 1 thread each; demo model (6 layers, h 256, vocab {VOCAB}), seq "
        f"{args.seq}, micro-batch {args.micro_batch}, fp32; median of {args.iters} rounds "
        f"after {args.warmup} warm-up"
    )
    print("\n" + "\n".join(tables(results)) + "\n")
    print("\n".join(zb_h1_against_1f1b(results)))
    print(
        "ideal: the plan replayed with its measured per-chunk compute medians (all measured "
        "steps) and free transfers; per step: median over steps of the step's time over the "
        "plan replayed with that step's own medians; bubbles are (time - busiest rank's "
        "compute) / busiest rank's compute"
    )
    zb_v = [r for r in results if r["schedule"] == "zb-v"]
    if zb_v:
        print(f"timeline of one measured zb-v iteration: {draw(zb_v[-1], Path(args.png))}")
    return results


if __name__ == "__main__":
    main()
