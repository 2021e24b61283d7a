"""The pipeline schedules by name: each one's builder and what the rest of ptdp reads of it.

A new schedule is one builder (in `ptdp.pipeline.classic` where the backward is one fused BW,
in `ptdp.pipeline.zero_bubble` where it is split into B and W, in `ptdp.pipeline.paired`
where forwards and backwards are paired) plus its `ScheduleSpec` in
`SCHEDULES` here: chunks per rank and their placement, bubble formula, in-flight bound. The
runtime never grows a branch for it (DESIGN invariant 1). `build` checks the arguments and
returns the builder's compute-only plan; `ptdp.pipeline.lowering.add_comms` adds the sends
and receives that the runtime executes and `verify` checks, and `ptdp.pipeline.plan` does
both once for every reader.

Letters: pp = pipeline ranks, vpp = model chunks per rank, m = microbatches per pipeline per
step, r = pipeline rank (0 first). Which rank holds a stage is the schedule's placement
(`ptdp.pipeline.placement`): looped (rank r holds r, r + pp, r + 2 pp, ..., Megatron's
interleaving) for all but ZB-V and DualPipeV, whose two chunks per rank sit in a V (stages r
and 2 pp - 1 - r).

In flight: a microbatch holds its activations on a stage from its F until its BW, or until its W
when the backward is split (B leaves the graph, or the weight-gradient inputs, for W), which is
how `verify` and `ptdp.perf.cost.memory` count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ptdp.pipeline.actions import Plan
from ptdp.pipeline.classic import check_interleaved, gpipe, interleaved, one_f_one_b
from ptdp.pipeline.paired import dualpipev, one_f_one_b_paired
from ptdp.pipeline.placement import Placement, StageMap
from ptdp.pipeline.zero_bubble import zb_h1, zb_h2, zb_v

Builder = Callable[[int, int, int], Plan]
"""Registry signature: (pp, m, vpp) -> compute-only plan."""


def _one_chunk(builder: Callable[[int, int], Plan]) -> Builder:
    """Adapt a builder without model chunks to the registry's (pp, m, vpp) signature."""

    def build_one_chunk(pp: int, m: int, vpp: int) -> Plan:
        return builder(pp, m)

    return build_one_chunk


def _all_microbatches(pp: int, m: int) -> list[int]:
    return [m] * pp


def _pp_minus_rank(pp: int, m: int) -> list[int]:
    return [pp - r for r in range(pp)]


def _pp_each(pp: int, m: int) -> list[int]:
    return [pp] * pp


def _twice_pp_minus_one_each(pp: int, m: int) -> list[int]:
    return [2 * pp - 1] * pp


def _twice_pp_each(pp: int, m: int) -> list[int]:
    return [2 * pp] * pp


def _twice_pp_minus_rank(pp: int, m: int) -> list[int]:
    return [2 * (pp - r) for r in range(pp)]


def _twice_pp_plus_one_each(pp: int, m: int) -> list[int]:
    return [2 * pp + 1] * pp


def _dualpipev_bubble(pp: int, m: int, vpp: int) -> float:
    """DualPipeV's unit-cost bubble, transfers free and a pair costing its two passes (no
    credit for what it overlaps): makespan 6m + 2 (pp - 1), twice ZB-V's, as each pair sends
    its forward's output only after its backward (the verifier's dry run, pp <= 8, m <= 6 pp).
    """
    return 2 * (pp - 1) / (6 * m)


def _zero_bubble(pp: int, m: int, vpp: int) -> float:
    """ZB-H1's and ZB-H2's unit-cost bubble: makespan 3m + max(pp - 1, 2 pp - 1 - m)."""
    return max(pp - 1, 2 * pp - 1 - m) / (3 * m)


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything the rest of ptdp needs to know about one schedule, its builder included."""

    build: Builder
    """(pp, m, vpp) -> compute-only plan."""
    bubble: Callable[[int, int, int], float]
    """(pp, m, vpp) -> the bubble fraction, bubble time / ideal time, at unit costs
    T_F = T_B = T_W: the paper's (for ZB-H1 when m >= pp), or the verifier's dry run exactly
    (ZB-H2)."""
    formula: str
    """`bubble` as written in the papers, in p (pp), v (vpp) and m."""
    in_flight_bound: Callable[[int, int], list[int]] | None
    """(pp, m) -> most activations each rank may stash (F until BW, or W when split); None
    where `verify` only reports it."""
    chunks: int | None = 1
    """Model chunks per rank (vpp) it runs: 1, 2 for ZB-V, or None for any vpp >= 2 with m a
    multiple of pp (interleaved)."""
    placement: Placement = Placement.LOOPED
    """How its chunks sit on the ranks (`ptdp.pipeline.placement`)."""
    splits_backward: bool = False
    """Runs B (input gradient) and W (weight gradient) apart instead of one fused BW (all
    its backwards; DualPipeV some, its paired ones fused)."""
    doc: str = ""
    """One line for `ptdp schedule --help`."""
    pairs: bool = False
    """Its steady state pairs a forward with a backward (`Action.paired`), as DualPipeV's."""
    paired: Builder | None = None
    """The variant whose steady state pairs them (`parallel.moe_overlap`), for a schedule that
    does not already: 1F1B's; None where there is none."""
    paired_bound: Callable[[int, int], list[int]] | None = None
    """`in_flight_bound` of the `paired` variant."""
    min_microbatches: Callable[[int], int] = lambda pp: 1
    """pp -> the fewest microbatches it runs (DualPipeV: 2 pp)."""

    @property
    def can_pair(self) -> bool:
        """Runs with its forwards and backwards paired (`parallel.moe_overlap`)."""
        return self.pairs or self.paired is not None

    @property
    def interleaved(self) -> bool:
        """Takes any vpp >= 2 chunks per rank, Megatron's interleaving."""
        return self.chunks is None

    def takes_chunks(self, vpp: int) -> bool:
        """Whether it runs with `vpp` model chunks per rank."""
        return vpp >= 2 if self.chunks is None else vpp == self.chunks

    def stage_map(self, pp: int, vpp: int) -> StageMap:
        return StageMap(pp, vpp, self.placement)


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(
        build=_one_chunk(gpipe),
        bubble=lambda pp, m, vpp: (pp - 1) / m,
        formula="(p-1)/m",
        in_flight_bound=_all_microbatches,
        doc="all forwards, then all backwards; every microbatch in flight",
    ),
    "1f1b": ScheduleSpec(
        build=_one_chunk(one_f_one_b),
        bubble=lambda pp, m, vpp: (pp - 1) / m,
        formula="(p-1)/m",
        in_flight_bound=_pp_minus_rank,
        doc="PipeDream-Flush: GPipe's bubble, at most pp - rank microbatches in flight",
        paired=lambda pp, m, vpp: one_f_one_b_paired(pp, m),
        paired_bound=_twice_pp_minus_rank,
    ),
    "interleaved": ScheduleSpec(
        build=interleaved,
        bubble=lambda pp, m, vpp: (pp - 1) / (vpp * m),
        formula="(p-1)/(v m)",
        in_flight_bound=None,  # no simple closed form (Korthikanti et al. give the first stage's)
        chunks=None,
        doc="1F1B over vpp model chunks per rank: the bubble shrinks vpp times",
    ),
    "zb-h1": ScheduleSpec(
        build=_one_chunk(zb_h1),
        bubble=lambda pp, m, vpp: (pp - 1) / (3 * m),
        formula="(p-1)/(3m)",
        in_flight_bound=_pp_each,
        splits_backward=True,
        doc="1F1B with the backward split into B and W, W deferred into the bubble",
    ),
    "zb-h2": ScheduleSpec(
        build=_one_chunk(zb_h2),
        bubble=_zero_bubble,
        formula="max(p-1,2p-1-m)/(3m)",
        in_flight_bound=_twice_pp_minus_one_each,
        splits_backward=True,
        doc="ZB-H1 with 2p-1 in flight: no gap on any rank from first to last pass",
    ),
    "zb-v": ScheduleSpec(
        build=lambda pp, m, vpp: zb_v(pp, m),
        bubble=lambda pp, m, vpp: (pp - 1) / (6 * m),
        formula="(p-1)/(6m) for m >= 2p",
        in_flight_bound=_twice_pp_each,
        chunks=2,
        placement=Placement.V,
        splits_backward=True,
        doc="two chunks per rank in a V (stages r, 2p-1-r): half ZB-H1's bubble at 1F1B's memory",
    ),
    "dualpipev": ScheduleSpec(
        build=lambda pp, m, vpp: dualpipev(pp, m),
        bubble=_dualpipev_bubble,
        formula="(p-1)/(3m) for m >= 2p",
        in_flight_bound=_twice_pp_plus_one_each,
        chunks=2,
        placement=Placement.V,
        splits_backward=True,
        doc="DeepSeek's DualPipeV on ZB-V's V: steady-state forwards paired with backwards",
        pairs=True,
        min_microbatches=lambda pp: 2 * pp,
    ),
}
"""Schedules by the config's names (`ptdp.config.Schedule` values)."""


def implied_vpp(name: str) -> int | None:
    """The one vpp schedule `name` runs (1, or 2 for zb-v), which a config or `ptdp schedule`
    that leaves vpp unset takes; None for interleaved, which runs any vpp >= 2, so the choice
    is the user's."""
    return SCHEDULES[name].chunks


def check_args(name: str, pp: int, m: int, vpp: int = 1, *, paired: bool = False) -> None:
    """Raise ValueError, naming the numbers and the fix, if `build` cannot make this plan
    (`paired`: its variant with forwards and backwards paired, `parallel.moe_overlap`)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if pp < 1:
        raise ValueError(f"pp = {pp} pipeline ranks must be >= 1")
    if m < 1:
        raise ValueError(f"m = {m} microbatches must be >= 1")
    spec = SCHEDULES[name]
    if spec.interleaved:
        check_interleaved(pp, m, vpp)
    elif vpp != spec.chunks:
        what = "one model chunk" if spec.chunks == 1 else f"{spec.chunks} model chunks"
        raise ValueError(
            f"schedule {name!r} runs {what} per rank but vpp = {vpp}; set vpp = {spec.chunks}"
            + (" or use the interleaved schedule" if spec.chunks == 1 else "")
        )
    least = spec.min_microbatches(pp)
    if m < least:
        raise ValueError(
            f"schedule {name!r} needs at least 2 * pp = {least} microbatches with pp = {pp}, "
            f"got m = {m}; use m = {least} or more"
        )
    if paired and not spec.can_pair:
        can = ", ".join(n for n, s in SCHEDULES.items() if s.can_pair)
        raise ValueError(
            f"schedule {name!r} has no variant with paired forwards and backwards; use one of {can}"
        )


def build(name: str, pp: int, m: int, vpp: int = 1, *, paired: bool = False) -> Plan:
    """Compute-only plan of schedule `name` (a `SCHEDULES` key) after checking the arguments;
    `paired`: its variant whose steady state pairs forwards with backwards."""
    check_args(name, pp, m, vpp, paired=paired)
    spec = SCHEDULES[name]
    if paired and spec.paired is not None:
        return spec.paired(pp, m, vpp)
    return spec.build(pp, m, vpp)


def in_flight_bound(
    name: str, pp: int, m: int, vpp: int = 1, *, paired: bool = False
) -> list[int] | None:
    """Most activations each rank may stash under schedule `name`; None where only reported.

    Counted in (microbatch, chunk) pairs from F until BW, or until W when split. GPipe stashes
    all m, 1F1B at most pp - rank (the paper's p * M_B on rank 0), ZB-H1 pp and ZB-H2 2 pp - 1
    on every rank (the W's they defer hold their microbatches), ZB-V 2 pp half-size chunks.
    Interleaved has no simple closed form (Korthikanti et al. give the first stage's), so
    `verify` only reports it. DualPipeV holds 2 pp + 1 on every rank, and paired 1F1B twice
    1F1B's (2 (pp - rank)), the warm-up its pairs need (`one_f_one_b_paired`).
    """
    check_args(name, pp, m, vpp, paired=paired)
    spec = SCHEDULES[name]
    bound = spec.paired_bound if paired and spec.paired is not None else spec.in_flight_bound
    return None if bound is None else bound(pp, m)


def theory_bubble(name: str, pp: int, m: int, vpp: int = 1) -> float:
    """The paper's bubble fraction of schedule `name` under unit costs (`ScheduleSpec.bubble`)."""
    check_args(name, pp, m, vpp)
    return SCHEDULES[name].bubble(pp, m, vpp)
