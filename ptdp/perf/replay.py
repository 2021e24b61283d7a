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

from dataclasses import dataclass

from ptdp.perf.timeline import Event
from ptdp.pipeline.actions import Plan
from ptdp.pipeline.dryrun import CommModel, PipelineCosts, Timed, dry_run
from ptdp.pipeline.placement import StageMap

__all__ = ["PipelineCosts", "PipelineRun", "replay"]


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
    plan: Plan, stages: StageMap, costs: PipelineCosts, *, blocking: bool = False
) -> PipelineRun:
    """Run every rank's actions in simulated time (see the module docstring).

    `blocking`: the rank itself carries each transfer: a SEND occupies it until the
    message has left, a RECV holds it until the message is in (Megatron-LM in 2021, which
    synchronised after each batch of point-to-point operations), instead of ptdp's
    asynchronous sends and receives waited on when their tensor is needed.
    """
    comms = CommModel.BLOCKING if blocking else CommModel.ASYNC
    run = dry_run(plan, stages, costs, comms=comms)
    if run.stuck:
        waits = "; ".join(str(w) for w in run.stuck)
        raise ValueError(f"replay deadlocked: {waits}; run ptdp.pipeline.verify on the plan")
    events = tuple(_event(t) for t in run.events)
    return PipelineRun(events, run.makespan, run.busy, run.end)
