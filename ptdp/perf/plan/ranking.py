"""The planner's ranking: the candidate layouts that fit, by step time, and the one to recommend
among those the model cannot tell apart (`recommend`).

Replaying a layout's schedule is most of a search's time, and most layouts are far from the
top. So each candidate that fits gets a proven lower bound on its step time first
(`ptdp.perf.simulate.bound`), and the replays go in order of bound, only as far as what `ptdp plan`
prints needs: until the `top` fastest are known and no layout left could come within
`tolerance` of the fastest (`recommend`'s choice and its place), and for each tensor parallel
size t until its fastest layout is known (`explain` quotes it). A layout not replayed cannot
be faster than those: its bound says so. `--compare` replays the rest of what it needs
(`faster_than`).

Memory fit does not need the replay (`simulator.predicted_memory`, and host memory,
`ptdp.perf.cost.host_memory`), so every candidate is still checked, and the count of
layouts that fit is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ptdp.config.sections import RunConfig
from ptdp.perf.cost.costs import Compute
from ptdp.perf.cost.hardware import GIB, System
from ptdp.perf.cost.host_memory import Start, applies, host_memory, node_fit, refusal_reason
from ptdp.perf.cost.reserve import fit
from ptdp.perf.cost.software import Software
from ptdp.perf.plan.refusal import Constraint, Rejected
from ptdp.perf.plan.search import Plans
from ptdp.perf.simulate.bound import step_lower_bound
from ptdp.perf.simulate.simulator import Prediction, predicted_memory, simulate
from ptdp.rules.layout import Layout

Progress = Callable[[int, int, str], None]
"""progress(done, total, what): called before each layout's memory check, then before each
replay (the total grows by one with each)."""


def describe(config: RunConfig, layout: Layout) -> str:
    """One line naming a layout: sizes, micro-batch, schedule, recomputation."""
    p = config.parallel
    sp = " sp" if p.sequence_parallel else ""
    b = config.train.micro_batch_size
    cp = f" cp={layout.cp} {p.cp_comm.value}" if layout.cp > 1 else ""
    cp += f" ep={layout.ep}" if layout.ep > 1 else ""
    cp += f" etp={layout.etp}" if layout.etp != layout.tp else ""  # as Layout.describe
    cp += " overlap" if getattr(p, "moe_overlap", False) else ""
    zero = f" zero={layout.zero}" if layout.zero else ""
    split = f" layers={','.join(map(str, p.pipeline_layers))}" if p.pipeline_layers else ""
    return (
        f"t={layout.tp}{sp}{cp} p={layout.pp} d={layout.dp}{zero} v={layout.vpp}{split} b={b} "
        f"m={layout.num_microbatches} {p.schedule.value} recompute={p.recompute.value}"
    )


@dataclass(frozen=True)
class Option:
    """One simulated layout."""

    config: RunConfig
    prediction: Prediction

    def describe(self) -> str:
        return describe(self.config, self.prediction.layout)


@dataclass(frozen=True)
class Unranked:
    """A layout that fits, left out of the ranking: it is slower than every ranked one."""

    config: RunConfig
    layout: Layout
    bound: float
    """A lower bound on its step time in seconds (`ptdp.perf.simulate.bound.step_lower_bound`)."""
    option: Option | None = None
    """Its replay, where the search needed one (the fastest layout of its t); else None."""

    def describe(self) -> str:
        return describe(self.config, self.layout)


@dataclass(frozen=True)
class Ranking:
    """The layouts that fit, split where the replays stopped."""

    options: list[Option]
    """The fastest, fastest first: exactly the first len(options) layouts of the full
    ranking (ties in candidate order)."""
    unranked: list[Unranked]
    """The others, by bound: each bound is above every option's step time."""


@dataclass(frozen=True)
class _Weighed:
    bound: float
    index: int
    config: RunConfig
    layout: Layout


def replay(
    cfg: RunConfig, layout: Layout, gpus: int, system: System, software: Software, plans: Plans
) -> Option:
    """`cfg` on `layout` simulated as the planner does (`timeline=False`: in short where the
    schedule reaches a steady state)."""
    prediction = simulate(
        cfg, system, gpus, software=software, layout=layout, timeline=False, plans=plans
    )
    return Option(cfg, prediction)


def rank(
    candidates: list[RunConfig],
    gpus: int,
    system: System,
    software: Software,
    rejected: list[Rejected],
    progress: Progress | None,
    plans: Plans,
    *,
    top: int,
    tolerance: float,
    prune: bool = True,
    start: Start = Start.ANY,
) -> Ranking:
    """The candidates that fit in memory, ranked (module doc); those that do not go to
    `rejected`, in candidate order. `prune=False` replays every one (then nothing is
    unranked). A GPU cluster's candidates must also fit in host memory as they start
    (`start`) and save (`host_memory.node_fit`)."""
    weighed = []
    for i, cfg in enumerate(candidates):
        layout = plans.layout(cfg, gpus)
        split = ",".join(map(str, cfg.parallel.pipeline_layers))
        what = f"t={layout.tp} p={layout.pp} v={layout.vpp}" + (f" layers={split}" * bool(split))
        what += f" b={cfg.train.micro_batch_size}"
        if progress is not None:
            progress(i, len(candidates), what)
        need, room = fit(predicted_memory(cfg, layout, system, software, gpus), system.device)
        if need > room:
            why = f"needs {need / GIB:.1f} GiB, {room / GIB:.1f} usable"
            rejected.append(Rejected(what, why, Constraint.MEMORY, need=need, usable=room))
            continue
        if applies(system):
            host = host_memory(cfg, layout)
            node = node_fit(host, layout, system, start, cfg.train.async_save)
            if not node.fits:
                why, usable = refusal_reason(node), node.usable or 0.0
                rejected.append(
                    Rejected(what, why, Constraint.HOST_MEMORY, need=node.need, usable=usable)
                )
                continue
        c = Compute(system, cfg.train.precision, software)
        bound = step_lower_bound(cfg, layout, c) if prune else 0.0
        weighed.append(_Weighed(bound, i, cfg, layout))
    weighed.sort(key=lambda w: (w.bound, w.index))
    done: dict[int, Option] = {}  # by candidate index

    def run(w: _Weighed) -> float:
        if progress is not None:
            n = len(candidates) + len(done)
            progress(n, n + 1, f"{describe(w.config, w.layout)} (replay)")
        done[w.index] = replay(w.config, w.layout, gpus, system, software, plans)
        return done[w.index].prediction.iteration_seconds

    for w in weighed:  # in order of bound: the top rows, and all within tolerance of the best
        if prune and _settled(done, w.bound, top, tolerance):
            break  # the bounds only grow from here
        run(w)
    for t in sorted({w.layout.tp for w in weighed}):  # the fastest of each t
        best = None
        for w in (w for w in weighed if w.layout.tp == t):
            if w.index in done:
                time = done[w.index].prediction.iteration_seconds
            elif best is None or w.bound <= best:
                time = run(w)
            else:
                break
            best = time if best is None else min(best, time)
    if progress is not None:
        n = len(candidates) + len(done)
        progress(n, n, "done")
    return _split(weighed, done)


def _settled(done: dict[int, Option], bound: float, top: int, tolerance: float) -> bool:
    """Whether no layout whose step takes at least `bound` can be among the `top` fastest or
    within `tolerance` of the fastest, given the replays `done` (bound order)."""
    times = [o.prediction.iteration_seconds for o in done.values()]
    if not times:
        return False
    faster = sum(time < bound for time in times)
    return faster >= top and min(times) * (1 + tolerance) < bound


def _split(weighed: list[_Weighed], done: dict[int, Option]) -> Ranking:
    """Ranked: the replayed layouts faster than every bound left; unranked: the rest."""
    left = min((w.bound for w in weighed if w.index not in done), default=float("inf"))
    time = {i: o.prediction.iteration_seconds for i, o in done.items()}
    ranked = sorted((i for i in done if time[i] < left), key=lambda i: (time[i], i))
    kept = set(ranked)
    unranked = [
        Unranked(w.config, w.layout, w.bound, done.get(w.index))
        for w in weighed
        if w.index not in kept
    ]
    return Ranking([done[i] for i in ranked], unranked)


def recommend(options: list[Option], tolerance: float) -> int:
    """Index of the layout to recommend among `options` (sorted fastest first).

    Layouts within `tolerance` of the fastest are equal as far as the model can tell;
    among them ZeRO-3 only if nothing else is close (its step rests on per-microbatch
    gathers reaching the ring model's bandwidth, which the paper's ZeRO-3 fell far short
    of: Table 2, `software.DEEPSPEED_2021`), then the paper's takeaways: the smallest t * p
    (#2), then the largest t (#1), then the fastest.
    """

    def key(i: int) -> tuple[bool, int, int, float]:
        lay = options[i].prediction.layout
        return (lay.zero == 3, lay.tp * lay.pp, -lay.tp, options[i].prediction.iteration_seconds)

    return min(close_to_fastest(options, tolerance), key=key)


def close_to_fastest(options: list[Option], tolerance: float) -> list[int]:
    """Indices of the `options` (fastest first) within `tolerance` of the fastest: equal as
    far as the model can tell."""
    fastest = options[0].prediction.iteration_seconds
    return [
        i
        for i, o in enumerate(options)
        if o.prediction.iteration_seconds <= fastest * (1 + tolerance)
    ]


def faster_than(
    seconds: float,
    options: tuple[Option, ...],
    unranked: tuple[Unranked, ...],
    gpus: int,
    system: System,
    software: Software,
) -> int:
    """How many layouts that fit take less than `seconds` (to 1e-9) per step: the options,
    and the unranked ones whose bound is below it, replayed where they were not."""
    limit = seconds * (1 - 1e-9)
    count = sum(o.prediction.iteration_seconds < limit for o in options)
    plans = Plans()
    for u in unranked:
        if u.bound >= limit:
            continue
        option = u.option or replay(u.config, u.layout, gpus, system, software, plans)
        count += option.prediction.iteration_seconds < limit
    return count
