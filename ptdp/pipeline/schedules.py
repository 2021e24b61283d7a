"""Pipeline schedules as pure functions of ints: each builder returns a compute-only `Plan`.

A new schedule is one builder here plus its `ScheduleSpec` in `SCHEDULES` (chunks per rank,
bubble formula, in-flight bound); the runtime never grows a branch for it (DESIGN invariant 1).
`add_comms` lowers a compute-only plan to one with explicit send/recv actions, which is what
the runtime executes and `verify` checks.

Letters: pp = pipeline ranks, vpp = model chunks per rank, m = microbatches per pipeline per
step, r = pipeline rank (0 first). Rank r holds the global virtual stages r, r + pp, r + 2 pp, ...
(Megatron's interleaving), so stage s runs on rank s % pp.

Sources: GPipe (Huang et al., arXiv 1811.06965); 1F1B = PipeDream-Flush and interleaved 1F1B
(Narayanan et al., arXiv 2104.04473, section 2.2); ZB-H1 and ZB-H2 (Qi et al., arXiv 2401.10241,
section 3).

In flight: a microbatch holds its activations on a stage from its F until its BW, or until its W
when the backward is split (B leaves the graph, or the weight-gradient inputs, for W), which is
how `verify` and `ptdp.perf.memory` count.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ptdp.pipeline.actions import Action, Kind, Plan

Builder = Callable[[int, int, int], Plan]
"""Registry signature: (pp, m, vpp) -> compute-only plan."""


def stage_to_rank(stage: int, pp: int) -> int:
    """Pipeline rank that runs global virtual `stage`."""
    return stage % pp


def stages_of_rank(rank: int, pp: int, vpp: int) -> list[int]:
    """Global virtual stages on `rank`, in chunk order: rank, rank + pp, rank + 2 pp, ..."""
    return [chunk * pp + rank for chunk in range(vpp)]


def gpipe(pp: int, m: int) -> Plan:
    """GPipe: every rank runs all forwards, then all fused backwards.

    Backwards run in increasing microbatch order (as PyTorch's ScheduleGPipe does, rather than
    the GPipe paper's last-in-first-out), so every schedule accumulates weight gradients in the
    same microbatch order and gives bitwise-identical sums. The bubble is the same either way.
    """
    return {
        r: [Action(Kind.F, r, mb) for mb in range(m)] + [Action(Kind.BW, r, mb) for mb in range(m)]
        for r in range(pp)
    }


def one_f_one_b_warmup(rank: int, pp: int, m: int) -> int:
    """Forwards a rank runs before its first backward in 1F1B (and ZB-H1)."""
    return min(pp - rank - 1, m)


def one_f_one_b(pp: int, m: int) -> Plan:
    """1F1B (PipeDream-Flush): warm-up forwards, steady one forward + one backward, cool-down.

    At most pp - rank microbatches are in flight on a rank, against m for GPipe, with the same
    bubble (pp - 1) / m.
    """
    plan: Plan = {}
    for r in range(pp):
        warmup = one_f_one_b_warmup(r, pp, m)
        actions = [Action(Kind.F, r, mb) for mb in range(warmup)]
        for i in range(m - warmup):
            actions += [Action(Kind.F, r, warmup + i), Action(Kind.BW, r, i)]
        actions += [Action(Kind.BW, r, mb) for mb in range(m - warmup, m)]
        plan[r] = actions
    return plan


def interleaved_warmup(rank: int, pp: int, m: int, vpp: int) -> int:
    """Forwards before the first backward in interleaved 1F1B (Megatron's formula)."""
    return min(2 * (pp - rank - 1) + (vpp - 1) * pp, m * vpp)


def _virtual_mb(k: int, pp: int, vpp: int, *, forward: bool) -> tuple[int, int]:
    """(chunk, microbatch) of the k-th forward or backward on a rank, in Megatron's order.

    Microbatches go through in groups of pp: a group runs on chunk 0, then chunk 1, ..., before
    the next group starts; backwards visit the chunks in reverse.
    """
    chunk = (k // pp) % vpp
    mb = (k // (pp * vpp)) * pp + k % pp
    return (chunk if forward else vpp - 1 - chunk), mb


def interleaved(pp: int, m: int, vpp: int) -> Plan:
    """Interleaved 1F1B: vpp model chunks per rank shrink the bubble to (pp - 1) / (vpp * m).

    Requires vpp >= 2 and m a multiple of pp, as the microbatches go through in groups of pp.
    """
    _check_interleaved(pp, m, vpp)
    return {r: _interleaved_rank(r, pp, m, vpp) for r in range(pp)}


def _interleaved_rank(rank: int, pp: int, m: int, vpp: int) -> list[Action]:
    def act(kind: Kind, k: int) -> Action:
        chunk, mb = _virtual_mb(k, pp, vpp, forward=kind is Kind.F)
        return Action(kind, chunk * pp + rank, mb)

    total = m * vpp
    warmup = interleaved_warmup(rank, pp, m, vpp)
    actions = [act(Kind.F, k) for k in range(warmup)]
    for i in range(total - warmup):
        actions += [act(Kind.F, warmup + i), act(Kind.BW, i)]
    return actions + [act(Kind.BW, k) for k in range(total - warmup, total)]


def zb_h1(pp: int, m: int) -> Plan:
    """ZB-H1 (Qi et al., arXiv 2401.10241): 1F1B with the backward split into B and W.

    F and B run in 1F1B's order. W needs no neighbour, so it can wait: after each B, rank r
    runs the oldest pending W only if more than r are pending, and runs the r held back at
    the end. Counted until W, rank r holds 1F1B's pp - rank forwards plus those r W's: at most
    pp microbatches on every rank (min(pp, m), checked over pp <= 8, m <= 6 pp), where 1F1B
    holds pp - rank.

    Why r: the last microbatch's B still has r ranks to pass after it leaves rank r, so rank r
    would idle r slots at the end; its r deferred W's fill them (at T_F = T_B = T_W every rank
    then ends together). The bubble falls from 1F1B's (pp - 1)(T_F + T_B + T_W) to the
    paper's (pp - 1)(T_F + T_B - T_W) for m >= pp; with fewer microbatches the dependency chain
    through all stages is longer than that (the makespan is 3m + max(pp - 1, 2 pp - 1 - m),
    as for ZB-H2).
    """
    return {r: _zb_h1_rank(r, pp, m) for r in range(pp)}


def _zb_h1_rank(rank: int, pp: int, m: int) -> list[Action]:
    pending: deque[int] = deque()  # microbatches whose B ran and whose W has not

    def backward(mb: int) -> list[Action]:
        pending.append(mb)
        done = [Action(Kind.B, rank, mb)]
        if len(pending) > rank:
            done.append(Action(Kind.W, rank, pending.popleft()))
        return done

    warmup = one_f_one_b_warmup(rank, pp, m)
    actions = [Action(Kind.F, rank, mb) for mb in range(warmup)]
    for i in range(m - warmup):
        actions += [Action(Kind.F, rank, warmup + i), *backward(i)]
    for mb in range(m - warmup, m):
        actions += backward(mb)
    return actions + [Action(Kind.W, rank, mb) for mb in pending]


def zb_h2(pp: int, m: int) -> Plan:
    """ZB-H2 (Qi et al., arXiv 2401.10241, section 3): ZB-H1 with up to 2 pp - 1 in flight.

    Built by list scheduling at T_F = T_B = T_W = 1: at each time unit every rank runs, first
    that can, its next B whose output gradient has arrived, its next F whose input has arrived
    while fewer than 2 pp - 1 microbatches are in flight (F run, W not), or its oldest pending
    W; otherwise it waits. Rank r's warm-up is then the paper's 2(pp - r) - 1 forwards, which
    fill the time until microbatch 0's B comes back, and the W's deferred past the last B make
    the tail a parallelogram: for m >= 2 pp - 1 every rank computes without a gap from its
    first action to its last (`ScheduleReport.span` = 3m), the paper's zero bubble.

    That gap-free span is zero bubble only for overlapping steps (the paper bypasses the
    optimizer's synchronisation to get them; ptdp's step synchronises). Within one step the
    last rank cannot start before pp - 1 forwards reach it, and rank 0's first B cannot start
    before 2 pp - 1 (microbatch 0 through pp F's and pp - 1 B's), after which it has m B's and
    m W's left. So the makespan is at least 3m + max(pp - 1, 2 pp - 1 - m), which ZB-H1 and
    ZB-H2 both reach: the verifier's bubble is max(pp - 1, 2 pp - 1 - m) / (3m) for both,
    (pp - 1) / (3m) for m >= pp. Other costs separate them: replayed, ZB-H2's makespan exceeds
    m (T_F + T_B + T_W) by (pp - 1) max(T_F, T_F + T_B - 2 T_W), ZB-H1's by (pp - 1)
    max(T_F, T_F + T_B - T_W) (the paper's formulas, floored by the last rank's wait), so
    ZB-H2 wins when T_B > T_W. It pays with min(2 pp - 1, m) microbatches in flight on every
    rank against ZB-H1's min(pp, m) (checked over pp <= 8, m <= 6 pp).
    """
    limit = 2 * pp - 1
    plan: Plan = {r: [] for r in range(pp)}
    f_done = [[-1] * m for _ in range(pp)]  # time each F ends; -1: not run yet
    b_done = [[-1] * m for _ in range(pp)]
    done = {kind: [0] * pp for kind in (Kind.F, Kind.B, Kind.W)}  # passes run per rank
    t = 0
    while any(w < m for w in done[Kind.W]):
        ran = []  # decided on the state at time t, applied after every rank has chosen
        for r in range(pp):
            f, b, w = (done[k][r] for k in (Kind.F, Kind.B, Kind.W))
            if b < f and 0 <= f_done[r][b] <= t and (r == pp - 1 or 0 <= b_done[r + 1][b] <= t):
                ran.append(Action(Kind.B, r, b))
            elif f < m and f - w < limit and (r == 0 or 0 <= f_done[r - 1][f] <= t):
                ran.append(Action(Kind.F, r, f))
            elif w < b:
                ran.append(Action(Kind.W, r, w))
        for a in ran:
            plan[a.stage].append(a)
            done[a.kind][a.stage] += 1
            if a.kind is not Kind.W:
                (f_done if a.kind is Kind.F else b_done)[a.stage][a.mb] = t + 1
        t += 1
        assert t <= 3 * m + 2 * pp, "zb_h2 list scheduling stalled"  # makespan <= 3m + 2pp - 1
    return plan


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


def _zero_bubble(pp: int, m: int, vpp: int) -> float:
    """ZB-H1's and ZB-H2's unit-cost bubble: makespan 3m + max(pp - 1, 2 pp - 1 - m)."""
    return max(pp - 1, 2 * pp - 1 - m) / (3 * m)


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything the rest of ptdp needs to know about one schedule, next to its builder."""

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
    interleaved: bool = False
    """Takes vpp >= 2 model chunks per rank and m a multiple of pp; otherwise vpp = 1."""
    splits_backward: bool = False
    """Runs B (input gradient) and W (weight gradient) apart instead of one fused BW."""
    doc: str = ""
    """One line for `ptdp schedule --help`."""


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
    ),
    "interleaved": ScheduleSpec(
        build=interleaved,
        bubble=lambda pp, m, vpp: (pp - 1) / (vpp * m),
        formula="(p-1)/(v m)",
        in_flight_bound=None,  # no simple closed form (Korthikanti et al. give the first stage's)
        interleaved=True,
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
}
"""Schedules by the config's names (`ptdp.config.Schedule` values)."""


def _check_interleaved(pp: int, m: int, vpp: int) -> None:
    if vpp < 2:
        raise ValueError(
            f"interleaved needs vpp >= 2 model chunks per rank, got vpp = {vpp}; "
            "set vpp >= 2 or use the 1f1b schedule"
        )
    if m % pp:
        lower, upper = (m // pp) * pp, (m // pp + 1) * pp
        near = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"interleaved needs the number of microbatches m = {m} to be a multiple of pp = {pp}; "
            f"use m = {near}"
        )


def check_args(name: str, pp: int, m: int, vpp: int = 1) -> None:
    """Raise ValueError, naming the numbers and the fix, if `build` cannot make this plan."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if pp < 1:
        raise ValueError(f"pp = {pp} pipeline ranks must be >= 1")
    if m < 1:
        raise ValueError(f"m = {m} microbatches must be >= 1")
    if SCHEDULES[name].interleaved:
        _check_interleaved(pp, m, vpp)
    elif vpp != 1:
        raise ValueError(
            f"schedule {name!r} runs one model chunk per rank but vpp = {vpp}; "
            "set vpp = 1 or use the interleaved schedule"
        )


def build(name: str, pp: int, m: int, vpp: int = 1) -> Plan:
    """Compute-only plan of schedule `name` (a `SCHEDULES` key) after checking the arguments."""
    check_args(name, pp, m, vpp)
    return SCHEDULES[name].build(pp, m, vpp)


def in_flight_bound(name: str, pp: int, m: int, vpp: int = 1) -> list[int] | None:
    """Most activations each rank may stash under schedule `name`; None where only reported.

    Counted from F until BW, or until W when split. GPipe stashes all m, 1F1B at most
    pp - rank (the paper's p * M_B on rank 0), ZB-H1 pp and ZB-H2 2 pp - 1 on every rank
    (the W's they defer hold their microbatches). Interleaved has no simple closed form
    (Korthikanti et al. give the first stage's), so `verify` only reports it.
    """
    check_args(name, pp, m, vpp)
    bound = SCHEDULES[name].in_flight_bound
    return None if bound is None else bound(pp, m)


def theory_bubble(name: str, pp: int, m: int, vpp: int = 1) -> float:
    """The paper's bubble fraction of schedule `name` under unit costs (`ScheduleSpec.bubble`)."""
    check_args(name, pp, m, vpp)
    return SCHEDULES[name].bubble(pp, m, vpp)


def add_comms(plan: Plan, pp: int, vpp: int) -> Plan:
    """Lower a compute-only plan: add the sends and receives between neighbouring stages.

    RECV_F goes right before each F of a stage > 0 and SEND_F right after each F of a stage
    below the last; RECV_B/SEND_B do the same around each B or BW. Transfers whose two stages
    share a rank (only when pp == 1) stay in memory and get no action. Receives are placed as
    late as possible and sends as early as possible, so a rank blocks only when it must.
    """
    last = pp * vpp - 1
    lowered: Plan = {}
    for rank, actions in plan.items():
        out: list[Action] = []
        for a in actions:
            if a.kind is Kind.F:
                before = _comm(Kind.RECV_F, a, a.stage - 1, pp, a.stage > 0)
                after = _comm(Kind.SEND_F, a, a.stage + 1, pp, a.stage < last)
            elif a.kind in (Kind.B, Kind.BW):
                before = _comm(Kind.RECV_B, a, a.stage + 1, pp, a.stage < last)
                after = _comm(Kind.SEND_B, a, a.stage - 1, pp, a.stage > 0)
            else:
                before = after = []
            out += [*before, a, *after]
        lowered[rank] = out
    return lowered


def _comm(kind: Kind, a: Action, peer_stage: int, pp: int, exists: bool) -> list[Action]:
    """The transfer of `kind` for compute action `a`, if the peer stage exists on another rank."""
    if not exists or stage_to_rank(peer_stage, pp) == stage_to_rank(a.stage, pp):
        return []
    return [Action(kind, a.stage, a.mb)]


def forward_only(pp: int, m: int, vpp: int = 1) -> Plan:
    """Forwards only (evaluation): each rank runs microbatch by microbatch, its stages in order.

    Every wait points to a lower stage of the same microbatch or to an earlier microbatch,
    so with non-blocking sends it cannot deadlock. Not for `verify` (it has no backward).
    """
    return {
        r: [Action(Kind.F, s, mb) for mb in range(m) for s in stages_of_rank(r, pp, vpp)]
        for r in range(pp)
    }
