"""A pipeline schedule built and lowered once, for every reader of it.

The runtime executes `PipelinePlan.lowered[rank]`, the verifier checks it, the simulator and the
memory model replay it, and the run's log summarises it: all from this one object, built from the
validated layout (`Layout.pipeline`) instead of each caller repeating `build` then `add_comms`.
Pure: no torch import.

Letters as in `ptdp.pipeline.schedules`: pp pipeline ranks, vpp chunks per rank, m microbatches
per pipeline per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, partial

from ptdp.pipeline.actions import Action, Plan
from ptdp.pipeline.classic import forward_only
from ptdp.pipeline.dryrun import Program, program
from ptdp.pipeline.lowering import add_comms
from ptdp.pipeline.placement import Placement, StageMap
from ptdp.pipeline.schedules import SCHEDULES, build, in_flight_bound, theory_bubble
from ptdp.pipeline.verify import ScheduleReport, peak_in_flight, verify


@dataclass(frozen=True)
class PipelinePlan:
    """One schedule for (pp, vpp, m): its compute-only plan and its lowering with transfers."""

    schedule: str
    """A `ptdp.pipeline.schedules.SCHEDULES` name (the config's `parallel.schedule` value)."""
    pp: int
    vpp: int
    num_microbatches: int
    placement: Placement
    """Which rank holds each stage (`SCHEDULES[schedule].placement`)."""
    compute: Plan = field(repr=False, compare=False)
    """Compute actions only (F, B, W, BW) per rank."""
    paired: bool = False
    """Built as its variant whose steady state pairs forwards with backwards
    (`parallel.moe_overlap`; DualPipeV pairs anyway)."""

    @cached_property
    def lowered(self) -> Plan:
        """`compute` with the sends and receives between stages: what the runtime executes.
        Lowered on first use: the memory model reads only `compute`."""
        return add_comms(self.compute, self.stages)

    @property
    def stages(self) -> StageMap:
        """Stage <-> rank: the one mapping every reader of this plan uses."""
        return StageMap(self.pp, self.vpp, self.placement)

    def actions(self, rank: int) -> list[Action]:
        """Pipeline rank `rank`'s action list, transfers included."""
        return self.lowered[rank]

    @property
    def in_flight_bound(self) -> list[int] | None:
        """Most activations each rank may stash; None where the schedule has no closed form."""
        m, paired = self.num_microbatches, self.paired
        return in_flight_bound(self.schedule, self.pp, m, self.vpp, paired=paired)

    @cached_property
    def program(self) -> Program:
        """`lowered` compiled for the dry-run engine, once for every replay of this plan (from
        `compute`, as `add_comms` lowers it: `lowered` itself is built only for a deadlock)."""
        return program(self.compute, self.stages, partial(add_comms, self.compute, self.stages))

    @cached_property
    def peak_in_flight(self) -> tuple[int, ...]:
        """`report.peak_in_flight` without the verifier's dry run (the memory model's count)."""
        return peak_in_flight(self.compute)

    @cached_property
    def report(self) -> ScheduleReport:
        """The verifier's unit-cost dry run (raises `ScheduleError` if the plan cannot run)."""
        m, bound = self.num_microbatches, self.in_flight_bound
        return verify(self.lowered, self.stages, m, max_in_flight=bound)

    def summary(self) -> str:
        """One log line: the schedule and its bubble under unit costs."""
        report = self.report
        paired = " (paired)" if self.paired and not SCHEDULES[self.schedule].pairs else ""
        return (
            f"pipeline | schedule {self.schedule}{paired} | {self.pp} stages x {self.vpp} chunks | "
            f"{self.num_microbatches} microbatches per pipeline per step | predicted bubble "
            f"{report.bubble_fraction:.3f} of the ideal time (unit costs) | peak stored "
            f"activations (microbatch x chunk) per rank {list(report.peak_in_flight)}"
        )

    def check_line(self) -> str:
        """`ptdp schedule`'s verdict: the unit-cost dry run beside the schedule's formula."""
        r, name = self.report, self.schedule
        theory = theory_bubble(name, self.pp, self.num_microbatches, self.vpp)
        if self.paired and not SCHEDULES[name].pairs:
            name += " (paired)"
        return (
            f"{name}: pp={self.pp} vpp={self.vpp} microbatches={self.num_microbatches} | "
            f"unit-cost makespan {r.makespan} (ideal {r.ideal}) | bubble "
            f"{r.bubble_fraction:.4f} (theory {theory:.4f}) | peak in-flight activations per "
            f"rank {list(r.peak_in_flight)}"
        )


def build_plan(
    schedule: str, pp: int, num_microbatches: int, vpp: int = 1, *, paired: bool = False
) -> PipelinePlan:
    """Build schedule `schedule` (lowered on first use); raises ValueError naming the fix on
    bad sizes. `paired`: its variant with paired forwards and backwards (`build`)."""
    compute = build(schedule, pp, num_microbatches, vpp, paired=paired)
    stages = SCHEDULES[schedule].stage_map(pp, vpp)
    m = num_microbatches
    return PipelinePlan(schedule, pp, vpp, m, stages.placement, compute, paired)


def build_forward_only(stages: StageMap, num_microbatches: int) -> PipelinePlan:
    """Forwards only, lowered (evaluation); not for `verify`, which needs backwards."""
    compute = forward_only(stages, num_microbatches)
    pp, vpp, m = stages.pp, stages.vpp, num_microbatches
    return PipelinePlan("forward-only", pp, vpp, m, stages.placement, compute)
