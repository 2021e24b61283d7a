"""Pipeline efficiency on CPU: ptdp's schedules on synthetic stages of known cost, and PyTorch's.

Every stage's F, B and W sleep a fixed time and pass an [8, 8] tensor, so ranks do not compete
for cores and the ideal time of a schedule is known exactly: the makespan of its action lists
replayed with these durations and free communication. For p = 4 ranks (4 processes, gloo) and
m in {4, 8, 16, 32}, each schedule reports measured / ideal (target <= 1.05) and the measured
bubble against the paper's formula. The same stages then run under `torch.distributed.pipelining`
in the same process group, iterations alternating with ours: ours / theirs (target <= 1.0),
ZB-V beside `ScheduleZBVZeroBubble` (both V-placed: rank r holds stages r and 2p - 1 - r).
One measured iteration of interleaved 1F1B (v = 2, m = 8) is drawn as a timeline PNG above
the same plan replayed.

    python benchmarks/pipeline/pipeline_efficiency.py            # about 6 minutes
    python benchmarks/pipeline/pipeline_efficiency.py --quick    # about 1.5 minute sanity run
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.spawn import spawn
from ptdp.parallel.comm import Group
from ptdp.perf.simulate.plot import plot_timelines
from ptdp.perf.simulate.replay import PipelineCosts, replay
from ptdp.pipeline.actions import Action
from ptdp.pipeline.p2p import P2P
from ptdp.pipeline.placement import Placement, StageMap
from ptdp.pipeline.plan import PipelinePlan, build_plan
from ptdp.pipeline.runtime import PipelineRuntime
from ptdp.pipeline.schedules import theory_bubble
from ptdp.pipeline.timeline import Event

ROOT = Path(__file__).resolve().parents[2]
# Under the ignored runs/, so that running the benchmark never rewrites a tracked file.
PNG = ROOT / "runs" / "benchmarks" / "interleaved_timeline.png"
PP = 4
SHAPE = (8, 8)
TIMELINE = ("interleaved", 2, 8)  # (schedule, v, m) of the iteration drawn
PAIRS = [  # (ours, v, theirs): the torch schedule run next to ours (None: torch has none)
    ("gpipe", 1, "ScheduleGPipe"),
    ("1f1b", 1, "Schedule1F1B"),
    ("zb-h1", 1, "ScheduleInterleavedZeroBubble"),  # theirs needs v = 2: a different schedule
    ("zb-h2", 1, None),
    ("interleaved", 2, "ScheduleInterleaved1F1B"),
    ("zb-v", 2, "ScheduleZBVZeroBubble"),
]
TORCH_V = {"ScheduleInterleavedZeroBubble": 2}  # torch schedules run at another v than ours
TORCH_V_PLACED = {"ScheduleZBVZeroBubble"}  # stages r and 2p - 1 - r on rank r, as ours
NO_TORCH = "torch has no such schedule"


# ----------------------------------------------------------------------------- stage costs


@dataclass(frozen=True)
class Costs:
    """Seconds that one microbatch's F, B and W take on one model chunk."""

    f: float
    b: float
    w: float

    def pipeline(self, stages: int) -> PipelineCosts:
        """Durations of ptdp's compute actions on the synthetic stages (free transfers).

        Every stage alike, stage 0 included: ptdp's B runs the whole backward but the kept
        weight-gradient pass (`DeferredSleep`), so stage 0's B walks the input path for its
        `embed` gradient. PyTorch's first stage instead runs nothing in B and both paths in W.
        """
        zeros = (0.0,) * stages
        return PipelineCosts(
            (self.f,) * stages, (self.b,) * stages, (self.w,) * stages, zeros, zeros
        )


# ----------------------------------------------------------------------------- synthetic stage

_trace: list[tuple[Action | None, float, float]] | None = None  # sleeps, when recording
_current: Action | None = None  # the ptdp action whose handler is running


def _sleep(seconds: float) -> None:
    """Sleep (the stage's "compute") and log the interval against the running action."""
    start = time.perf_counter()
    time.sleep(seconds)
    if _trace is not None:
        _trace.append((_current, start, time.perf_counter()))


class _InputPath(torch.autograd.Function):
    """Identity whose backward, the input-gradient path, sleeps T_B."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _sleep(ctx.seconds)
        return grad, None


class DeferredSleep:
    """A synthetic chunk's weight-gradient store (what the runtime's `wgrad` stores do).

    Inside ptdp's B (`deferring`) the weight path keeps (w, x, dy) instead of sleeping; W
    (`flush`) sleeps T_W and returns w's gradient, as `WeightGradStore` runs the linear
    layers' kept GEMMs. Any other backward (BW, PyTorch's) sleeps where it stands.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.key: tuple[int, int] | None = None
        self.pending: dict = {}

    @contextmanager
    def capture(self) -> Iterator[None]:
        yield  # every forward of the weight path can defer

    @contextmanager
    def deferring(self, key: tuple[int, int]) -> Iterator[None]:
        self.key = key
        try:
            yield
        finally:
            self.key = None

    def flush(self, key: tuple[int, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        grads = []
        for w, x, dy in self.pending.pop(key, []):
            _sleep(self.seconds)
            grads.append((w, dy * x))
        return grads


class _WeightPath(torch.autograd.Function):
    """w * x with x detached, whose backward, the weight-gradient path, sleeps T_W (or, in a
    split backward, leaves that to W)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, x: torch.Tensor, store: DeferredSleep) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.w, ctx.store = w, store
        return w * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (x,) = ctx.saved_tensors
        store = ctx.store
        if store.key is not None:
            store.pending.setdefault(store.key, []).append((ctx.w, x, grad))
            return None, None, None
        _sleep(store.seconds)
        return grad * x, None, None


class SleepStage(nn.Module):
    """One model chunk: forward sleeps T_F; y = x + w * x, the two terms' backwards apart.

    The input-gradient pass reaches only `_InputPath` and the weight-gradient pass only
    `_WeightPath`, so ptdp's B sleeps T_B (the weight path kept in `wgrad`), its W T_W and
    BW both; PyTorch's I and W likewise. Stage 0 scales its input by an `embed` parameter
    that stands for the embedding: its weight gradient needs the input-gradient path, as in
    a real model.
    """

    def __init__(self, costs: Costs, first: bool) -> None:
        super().__init__()
        self.costs = costs
        self.weight = nn.Parameter(torch.full(SHAPE, 0.01))
        self.embed = nn.Parameter(torch.ones(SHAPE)) if first else None
        self.wgrad = DeferredSleep(costs.w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _sleep(self.costs.f)
        if self.embed is not None:
            x = x * self.embed
        return _InputPath.apply(x, self.costs.b) + _WeightPath.apply(
            self.weight, x.detach(), self.wgrad
        )


def make_chunks(rank: int, stages: StageMap, costs: Costs) -> dict[int, SleepStage]:
    """This rank's chunks by global stage, placed by `stages` (looped, or ZB-V's V)."""
    return {s: SleepStage(costs, s == 0) for s in stages.stages_of(rank)}


def loss_of(out: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
    """The last stage's loss (PyTorch's loss_fn signature; the target is not needed)."""
    return out.mean()


# ----------------------------------------------------------------------------- ideal time


def planned(name: str, v: int, m: int) -> PipelinePlan:
    """Schedule `name` with its comms; its replay checked against verify's unit-time dry run."""
    plan = build_plan(name, PP, m, v)
    unit = replay(plan.lowered, plan.stages, PipelineCosts.unit(PP * v)).makespan
    if unit != plan.report.makespan:
        raise AssertionError(f"{name} m={m}: replay {unit} != verify {plan.report.makespan}")
    return plan


def ideal(name: str, v: int, m: int, chunk: Costs) -> float:
    """The plan's makespan replayed with the stages' sleep times and free communication."""
    plan = planned(name, v, m)
    return replay(plan.lowered, plan.stages, chunk.pipeline(PP * v)).makespan


def formula_bubble(name: str, v: int, m: int, c: Costs) -> float:
    """The papers' bubble fraction, bubble time over m * v * (T_F + T_B + T_W).

    ZB-H1's formula takes the three costs; ZB-H2's and ZB-V's are the registry's unit-cost
    ones (`theory_bubble`), exact when T_F = T_B = T_W (the default).
    """
    if name == "zb-h1":
        return (PP - 1) * (c.f + c.b - c.w) / (m * (c.f + c.b + c.w))
    if name in ("zb-h2", "zb-v"):
        return theory_bubble(name, PP, m, v)
    return (PP - 1) / (v * m)


# ----------------------------------------------------------------------------- ranks


@contextmanager
def _tag(a: Action) -> Iterator[None]:
    """Tags the sleeps each compute action runs with that action (for the timeline only)."""
    global _current
    _current = a
    try:
        yield
    finally:
        _current = None


def _timed(step: Callable[[], object], chunks: dict[int, SleepStage]) -> tuple[float, float]:
    """(start, end) of one iteration on this rank, started together with the other ranks."""
    for p in (p for c in chunks.values() for p in c.parameters()):
        p.grad = None
    dist.barrier()
    start = time.perf_counter()
    step()
    return start, time.perf_counter()


def _span(start_end: tuple[float, float]) -> tuple[float, float]:
    """(iteration time over all ranks, earliest start); perf_counter is one machine clock."""
    every: list[tuple[float, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, start_end)
    t0 = min(s for s, _ in every)
    return max(e for _, e in every) - t0, t0


class Ours:
    """ptdp's runtime executing this rank's action list of one schedule."""

    def __init__(self, rank: int, name: str, v: int, m: int, costs: Costs) -> None:
        self.rank, self.v, self.m = rank, v, m
        plan = planned(name, v, m)
        self.actions, self.stages = plan.actions(rank), plan.stages
        self.chunks = make_chunks(rank, self.stages, costs)
        tp = Group(None, 1, 0)
        self.p2p = P2P(list(range(PP)), SHAPE, torch.float32, torch.device("cpu"), tp)
        self.input = torch.ones(SHAPE)

    def forward_step(self, stage: int, mb: int, x: torch.Tensor | None) -> torch.Tensor:
        out = self.chunks[stage](self.input if x is None else x)
        return loss_of(out) if stage == PP * self.v - 1 else out

    def step(self) -> None:
        runtime = PipelineRuntime(
            self.chunks,
            self.forward_step,
            self.p2p,
            self.stages,
            around_action=_tag,
            wgrad={s: chunk.wgrad for s, chunk in self.chunks.items()},
        )
        runtime.run(self.actions)


class Theirs:
    """The same stages under a `torch.distributed.pipelining` schedule."""

    def __init__(
        self, rank: int, name: str, v: int, m: int, costs: Costs, group: dist.ProcessGroup
    ) -> None:
        from torch.distributed import pipelining

        self.rank, self.m = rank, m
        placement = Placement.V if name in TORCH_V_PLACED else Placement.LOOPED
        self.chunks = make_chunks(rank, StageMap(PP, v, placement), costs)
        # Shapes are inferred at the first step: passing input_args/output_args alone makes
        # torch 2.13 skip receiving output gradients ("grad can be implicitly created only for
        # scalar outputs" on every stage but the last).
        cpu = torch.device("cpu")
        stages = [
            pipelining.PipelineStage(chunk, s, PP * v, cpu, group=group)
            for s, chunk in self.chunks.items()
        ]
        cls = getattr(pipelining, name)
        self.schedule = cls(stages[0] if v == 1 else stages, m, loss_fn=loss_of)
        self.first, self.last = 0 in self.chunks, PP * v - 1 in self.chunks
        self.batch = torch.ones(m * SHAPE[0], *SHAPE[1:])

    def step(self) -> None:
        args = (self.batch,) if self.first else ()
        self.schedule.step(*args, target=self.batch if self.last else None)


def _agree(error: str | None) -> str | None:
    """One error on every rank, so that all skip a failed torch schedule.

    A rank that fails makes its peers time out on their receives: report the cause, not that.
    """
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, error)
    errors = sorted((e for e in every if e), key=lambda e: "timed out" in e.lower())
    return errors[0] if errors else None


def _brief(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")
    return " ".join(text.split())[:200]


def _build_theirs(
    rank: int, name: str, v: int, m: int, costs: Costs, timeout: float
) -> tuple[Theirs | None, str | None]:
    """(Theirs, None) or (None, error) for a schedule that refuses these settings.

    Each torch schedule gets its own process group with a short timeout: if one fails on some
    ranks, the others give up waiting on their receives and the default group stays usable.
    """
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    try:
        return Theirs(rank, name, v, m, costs, group), None
    except Exception as exc:
        return None, _brief(exc)


def _measure_pair(
    rank: int, pair: tuple[str, int, str], m: int, costs: Costs, args: argparse.Namespace
) -> dict:
    """Alternate iterations of ours and theirs; medians of the measured ones."""
    name, v, torch_name = pair
    tv = TORCH_V.get(torch_name, v)
    torch_costs = Costs(*(t * v / tv for t in (costs.f, costs.b, costs.w)))  # same work per rank
    ours = Ours(rank, name, v, m, costs)
    if torch_name is None:
        theirs, error = None, NO_TORCH
    else:
        theirs, error = _build_theirs(rank, torch_name, tv, m, torch_costs, args.torch_timeout)
        error = _agree(error)
    global _trace
    ours_t, theirs_t, row = [], [], {}
    for i in range(args.warmup + args.iters):
        record = (name, v, m) == TIMELINE and i == args.warmup + args.iters - 1
        _trace = [] if record else None
        took, t0 = _span(_timed(ours.step, ours.chunks))
        if record:
            row["timeline"] = _timeline(_trace, t0, took)
        _trace = None
        if i >= args.warmup:
            ours_t.append(took)
        if error is None:
            try:
                span = _timed(theirs.step, theirs.chunks)
                failure = None
            except Exception as exc:
                span, failure = (0.0, 0.0), _brief(exc)
            error = _agree(failure)
            took, _ = _span(span)
            if i >= args.warmup and error is None:
                theirs_t.append(took)
    row.update(schedule=name, v=v, m=m, torch=torch_name, torch_v=tv, ours=ours_t)
    row.update(theirs=theirs_t if error is None else [], error=error)
    return row


def _timeline(trace: list, t0: float, took: float) -> dict:
    """Every rank's compute intervals of this iteration, one per action, from the first start."""
    spans: dict[str, list[float]] = {}
    for a, s, e in trace:
        key = str(a)
        s, e = s - t0, e - t0
        old = spans.get(key)
        spans[key] = [s, e] if old is None else [min(old[0], s), max(old[1], e)]
    every: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, spans)
    return {"took": took, "ranks": every}


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    """Every pair's rows; rank 0 prints each as it finishes."""
    costs = Costs(args.f_ms / 1e3, args.b_ms / 1e3, args.w_ms / 1e3)
    rows = []
    for pair in (p for p in PAIRS if p[0] in args.schedules):
        v = pair[1]
        chunk_costs = Costs(costs.f / v, costs.b / v, costs.w / v)
        for m in args.ms:
            rows.append(_measure_pair(rank, pair, m, chunk_costs, args))
            if rank == 0:
                r = rows[-1]
                theirs = f"{statistics.median(r['theirs']) * 1e3:.0f}" if r["theirs"] else "-"
                print(
                    f"  {pair[0]} v={v} m={m}: ours {statistics.median(r['ours']) * 1e3:.0f} ms, "
                    f"{pair[2] or 'no torch schedule'} {theirs} ms",
                    flush=True,
                )
    return rows


# ----------------------------------------------------------------------------- report


def table(rows: list[dict], costs: Costs) -> list[str]:
    lines = [
        "| schedule | v | m | ideal ms | measured ms | measured/ideal | measured bubble | "
        "ideal bubble | formula bubble | torch schedule | torch ms | ours/torch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        name, v, m = r["schedule"], r["v"], r["m"]
        chunk = Costs(costs.f / v, costs.b / v, costs.w / v)
        best = ideal(name, v, m, chunk)
        work = m * v * (chunk.f + chunk.b + chunk.w)
        measured = statistics.median(r["ours"])
        torch_name = f"{r['torch']} (v={r['torch_v']})" if r["torch"] else "-"
        if r["error"] == NO_TORCH:
            theirs, ratio = "-", "-"
        elif r["error"]:
            theirs, ratio = f"failed: {r['error']}", "-"
        else:
            t = statistics.median(r["theirs"])
            theirs, ratio = f"{t * 1e3:.1f}", f"{measured / t:.3f}"
        lines.append(
            f"| {name} | {v} | {m} | {best * 1e3:.1f} | {measured * 1e3:.1f} | "
            f"{measured / best:.3f} | {(measured - work) / work:.3f} | "
            f"{(best - work) / work:.3f} | {formula_bubble(name, v, m, chunk):.3f} | "
            f"{torch_name} | {theirs} | {ratio} |"
        )
    return lines


def draw(timeline: dict, costs: Costs, path: Path) -> None:
    """Gantt chart: the measured iteration above, the zero-overhead replay of its plan below."""
    name, v, m = TIMELINE
    chunk = Costs(costs.f / v, costs.b / v, costs.w / v)
    plan = planned(name, v, m)
    run = replay(plan.lowered, plan.stages, chunk.pipeline(PP * v))
    measured = [
        Event(rank, a.stage, a.mb, a.kind.value, start, end)
        for rank, spans in enumerate(timeline["ranks"])
        for a, (start, end) in ((Action.parse(k), se) for k, se in spans.items())
    ]
    simulated = [e for e in run.events if e.lane == "compute" and e.seconds > 0]  # not 0B
    plot_timelines(
        path,
        {
            f"ptdp, measured: {timeline['took'] * 1e3:.0f} ms": measured,
            f"same plan replayed with zero overhead: {run.makespan * 1e3:.0f} ms": simulated,
        },
        title=f"{name}, p={PP}, v={v}, m={m}; per chunk T_F {chunk.f * 1e3:g}, "
        f"T_B {chunk.b * 1e3:g}, T_W {chunk.w * 1e3:g} ms (labels: stage.microbatch)",
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    names = [name for name, _, _ in PAIRS]
    parser.add_argument("--schedules", nargs="+", choices=names, default=names)
    parser.add_argument("--ms", type=int, nargs="+", default=[4, 8, 16, 32], help="microbatches")
    parser.add_argument("--f-ms", type=float, default=30.0, help="T_F per microbatch at v=1")
    parser.add_argument("--b-ms", type=float, default=30.0, help="T_B (divided by v per chunk)")
    parser.add_argument("--w-ms", type=float, default=30.0, help="T_W (divided by v per chunk)")
    parser.add_argument("--iters", type=int, default=4, help="measured iterations per schedule")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0, help="gloo timeout, seconds")
    parser.add_argument(
        "--torch-timeout", type=float, default=30.0, help="timeout of a torch schedule's group"
    )
    parser.add_argument("--png", default=str(PNG))
    parser.add_argument("--quick", action="store_true", help="m in {4, 8}, 2 iterations")
    args = parser.parse_args(argv)
    if args.quick:
        args.ms, args.iters = [4, 8], 2
    drawn = TIMELINE[0] in args.schedules
    if drawn and TIMELINE[2] not in args.ms:
        args.ms = sorted({*args.ms, TIMELINE[2]})
    costs = Costs(args.f_ms / 1e3, args.b_ms / 1e3, args.w_ms / 1e3)
    start = time.perf_counter()
    rows = spawn(worker, PP, args, timeout_s=args.timeout)
    took = time.perf_counter() - start
    if drawn:
        draw(next(r["timeline"] for r in rows if "timeline" in r), costs, Path(args.png))
    print()
    script = "benchmarks/pipeline/pipeline_efficiency.py"
    command = " ".join(sys.argv if argv is None else [script, *argv])
    print(f"command: python {command}  ({took:.0f} s, {date.today()})")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"gloo, {PP} ranks with 1 thread each"
    )
    print(
        f"costs per microbatch and rank: T_F {args.f_ms:g}, T_B {args.b_ms:g}, T_W {args.w_ms:g} "
        "ms, split evenly over the v chunks; median of "
        f"{args.iters} iterations after {args.warmup} warm-up, ours and torch alternating"
    )
    print()
    print("\n".join(table(rows, costs)))
    print()
    print(
        "ideal: the plan replayed with these durations and free communication; bubbles are "
        "(time - m*v*(T_F+T_B+T_W)) / m*v*(T_F+T_B+T_W); formula: (p-1)/m for gpipe and 1f1b, "
        "(p-1)/(v*m) for interleaved, (p-1)(T_F+T_B-T_W)/(m(T_F+T_B+T_W)) for zb-h1, "
        "max(p-1,2p-1-m)/(3m) for zb-h2 and (p-1)/(6m) (m >= 2p) for zb-v at equal costs. "
        "zb-h1 (ours, v=1) and ScheduleInterleavedZeroBubble (v=2, same work per rank) are "
        "different schedules; torch has no zb-h2."
    )
    if drawn:
        print(f"timeline of one measured interleaved iteration: {args.png}")
    return rows


if __name__ == "__main__":
    main()
