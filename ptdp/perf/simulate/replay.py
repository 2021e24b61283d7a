"""Replays pipeline action lists in simulated time, as timelines of `Event`s.

A thin adapter over `ptdp.pipeline.dryrun`, the dry-run engine `verify` also runs: the same
lists the runtime executes (DESIGN invariant 1), with the performance model's durations
instead of verify's unit times. A compute action starts when its rank is free and its input
has arrived. By default (ptdp's runtime, `CommModel.ASYNC`) a SEND costs its rank nothing
and its transfer starts once the receiver has posted the matching RECV and the previous
message on that channel has left; the consumer waits for the arrival. With `blocking=True`
the rank carries its transfers itself. Contention between channels that share a network
card is not modelled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ptdp.pipeline.actions import Plan
from ptdp.pipeline.dryrun import CommModel, DryRun, PipelineCosts, Program, Timed
from ptdp.pipeline.dryrun_engine import dry_run
from ptdp.pipeline.placement import StageMap
from ptdp.pipeline.timeline import Event

__all__ = ["PipelineCosts", "PipelineRun", "replay", "replay_steady"]


@dataclass(frozen=True)
class PipelineRun:
    """What one replay of a plan measured."""

    events: tuple[Event, ...]
    """Compute actions (lane "compute") and transfers (lane "p2p", on the sender)."""
    makespan: float
    busy: tuple[float, ...]
    """Per rank: seconds computing."""
    rank_end: tuple[float, ...]
    """Per rank: when it finished its list (its last compute, or a blocking send after it)."""
    complete: bool = True
    """`events` holds every action; False (`replay_steady`): only each stage's last
    gradient action."""

    @property
    def ideal(self) -> float:
        """The busiest rank's compute: the step time without a bubble."""
        return max(self.busy)

    @property
    def bubble_fraction(self) -> float:
        """The paper's bubble time / ideal time (not idle / total)."""
        return (self.makespan - self.ideal) / self.ideal


def _event(t: Timed) -> Event:
    a = t.action
    return Event(t.rank, a.stage, a.mb, a.kind.value, t.start, t.end, _lane(t))


def _lane(t: Timed) -> str:
    return "p2p" if t.is_transfer else "compute"


def replay(
    plan: Plan | Program,
    stages: StageMap,
    costs: PipelineCosts,
    *,
    blocking: bool = False,
    timeline: bool = True,
) -> PipelineRun:
    """Run every rank's actions in simulated time (see the module docstring).

    `blocking`: the rank itself carries each transfer: a SEND occupies it until the
    message has left, a RECV holds it until the message is in (Megatron-LM in 2021, which
    synchronised after each batch of point-to-point operations), instead of ptdp's
    asynchronous sends and receives waited on when their tensor is needed. `timeline=False`:
    the events are only each stage's last gradient action (`complete` False).
    """
    comms = CommModel.BLOCKING if blocking else CommModel.ASYNC
    run = dry_run(plan, stages, costs, comms=comms, events=timeline)
    if run.stuck:
        waits = "; ".join(str(w) for w in run.stuck)
        raise ValueError(f"replay deadlocked: {waits}; run ptdp.pipeline.verify on the plan")
    if not timeline:  # only what the data-parallel reduction needs
        events = tuple(_event(t) for t in run.finals)
        return PipelineRun(events, run.makespan, run.busy, run.end, complete=False)
    events = tuple(_event(t) for t in run.events)
    return PipelineRun(events, run.makespan, run.busy, run.end)


def _gradient_finals(run: DryRun) -> dict[int, Event]:
    """Per stage, its last gradient-producing action (BW or W): when its reduction can end."""
    return {t.action.stage: _event(t) for t in run.finals}


def _numbers(run: DryRun, finals: dict[int, Event]) -> list[float]:
    times = [t for s in sorted(finals) for t in (finals[s].start, finals[s].end)]
    return [run.makespan, *run.end, *run.busy, *times]


def replay_steady(
    plan_for: Callable[[int], Plan | Program],
    stages: StageMap,
    m: int,
    costs: PipelineCosts,
    *,
    period: int = 1,
    blocking: bool = False,
) -> PipelineRun | None:
    """The replay of `plan_for(m)` from three short replays, or None where it cannot be had so.

    A pipeline's timeline settles into a steady state after its warm-up: past some m0, each
    `period` more microbatches (1, or pp for the interleaved schedule, whose microbatches go
    in groups of pp) add the same time to every rank's end, its busy time and each stage's
    last backward. The plans for m0, m0 + period and m0 + 2 period are replayed; where all
    these numbers grow by equal steps (to 1e-9 of the makespan) they are extended linearly
    to m. The warm-up lasts about pp to 4 pp microbatches, so m0 is tried at pp + 2, 2 pp,
    4 pp and 8 pp (with the period) until a steady state shows, while the short replays add up
    to at most 2/3 of m (else None: the caller replays in full). The events returned are
    only each stage's last gradient action (what the data-parallel reduction needs), as
    `complete` says.
    """
    spent, tried = 0, set()  # microbatches replayed so far: they must cost less than m
    for lo in (stages.pp + 2, 2 * stages.pp, 4 * stages.pp, 8 * stages.pp):
        m0 = lo + (m - lo) % period
        if m0 in tried:
            continue
        tried.add(m0)
        spent += 3 * (m0 + period)
        if 3 * spent > 2 * m:
            return None
        run = _extended(plan_for, stages, m, m0, costs, period, blocking)
        if run is not None:
            return run
    return None


def _extended(
    plan_for: Callable[[int], Plan | Program],
    stages: StageMap,
    m: int,
    m0: int,
    costs: PipelineCosts,
    period: int,
    blocking: bool,
) -> PipelineRun | None:
    """`replay_steady` from m0, or None where the three replays do not grow in equal steps."""
    comms = CommModel.BLOCKING if blocking else CommModel.ASYNC
    runs = [
        dry_run(plan_for(m0 + i * period), stages, costs, comms=comms, events=False)
        for i in range(3)
    ]
    if any(r.stuck for r in runs):
        return None
    finals = [_gradient_finals(r) for r in runs]
    if len({tuple(sorted(f)) for f in finals}) != 1:
        return None
    a, b, c = (_numbers(r, f) for r, f in zip(runs, finals, strict=True))
    tolerance = 1e-9 * max(map(abs, c))
    if any(abs((z - y) - (y - x)) > tolerance for x, y, z in zip(a, b, c, strict=True)):
        return None
    steps = (m - m0) / period
    grown = [x + steps * (z - x) / 2 for x, z in zip(a, c, strict=True)]
    pp = stages.pp
    makespan, ends, busy = grown[0], grown[1 : 1 + pp], grown[1 + pp : 1 + 2 * pp]
    times = iter(grown[1 + 2 * pp :])
    shift = m - m0
    events = tuple(
        replace(e, mb=e.mb + shift, start=next(times), end=next(times))
        for _, e in sorted(finals[0].items())
    )
    return PipelineRun(events, makespan, tuple(busy), tuple(ends), complete=False)
