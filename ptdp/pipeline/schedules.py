"""Pipeline schedules as pure functions of ints: each builder returns a compute-only `Plan`.

A new schedule is one builder here plus its `ScheduleSpec` in `SCHEDULES` (chunks per rank,
bubble formula, in-flight bound); the runtime never grows a branch for it (DESIGN invariant 1).
`add_comms` lowers a compute-only plan to one with explicit send/recv actions, which is what
the runtime executes and `verify` checks.

Letters: pp = pipeline ranks, vpp = model chunks per rank, m = microbatches per pipeline per
step, r = pipeline rank (0 first). Which rank holds a stage is the schedule's placement
(`ptdp.pipeline.placement`): looped (rank r holds r, r + pp, r + 2 pp, ..., Megatron's
interleaving) for all but ZB-V, whose two chunks per rank sit in a V (stages r and 2 pp - 1 - r).

Sources: GPipe (Huang et al., arXiv 1811.06965); 1F1B = PipeDream-Flush and interleaved 1F1B
(Narayanan et al., arXiv 2104.04473, section 2.2); ZB-H1 and ZB-H2 (Qi et al., arXiv 2401.10241,
sections 3 and 6).

In flight: a microbatch holds its activations on a stage from its F until its BW, or until its W
when the backward is split (B leaves the graph, or the weight-gradient inputs, for W), which is
how `verify` and `ptdp.perf.cost.memory` count.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ptdp.pipeline.actions import Action, Kind, Plan
from ptdp.pipeline.placement import Placement, StageMap

Builder = Callable[[int, int, int], Plan]
"""Registry signature: (pp, m, vpp) -> compute-only plan."""


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
    done_f, done_b, done_w = done[Kind.F], done[Kind.B], done[Kind.W]
    while any(w < m for w in done_w):
        ran = []  # decided on the state at time t, applied after every rank has chosen
        for r in range(pp):
            f, b, w = done_f[r], done_b[r], done_w[r]
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


_ZB_V_POLICIES = (("B0", "F1", "F0", "B1", "W", 1), ("F1", "F0", "B0", "B1", "W", 0))
"""(preference order, admission slack) of the list schedules `zb_v` tries; between them they
reach the (pp - 1) / (6m) bubble for every m >= 2 pp, pp <= 8 (searched over all 240 orders
and slacks; no single order does)."""


def zb_v(pp: int, m: int) -> Plan:
    """ZB-V (Qi et al., arXiv 2401.10241, section 6): two chunks per rank placed in a V.

    Rank r holds stages r (chunk 0) and 2 pp - 1 - r (chunk 1), so a microbatch goes down the
    ranks and back up, its loss on rank 0, and the first and last stage share a rank. Built
    by list scheduling at unit costs (F = B = W = 1 per chunk): at each time unit every rank
    runs the first pass it can, in one of `_ZB_V_POLICIES`' orders, where a chunk-0 F (a new
    microbatch on this rank) is admitted only while fewer than 2 pp - slack chunk activations
    are held and a chunk-1 F while fewer than 2 pp; the builder keeps the policy with the
    shortest makespan. 2 pp chunk activations are pp whole stages: 1F1B's peak on rank 0,
    now on every rank.

    Each rank has 6m passes; the last rank cannot start before pp - 1 forwards reach it, so
    the makespan is at least 6m + pp - 1 and the bubble at least (pp - 1) / (6m), half ZB-H1's
    (pp - 1) / (3m) at the same memory as 1F1B; the verifier's dry run meets that bound for
    m >= 2 pp (checked for pp <= 8, m <= 6 pp). With fewer microbatches the chain of one
    microbatch through all 2 pp stages and back dominates.
    """
    plans = [_zb_v_list_schedule(pp, m, order, slack) for *order, slack in _ZB_V_POLICIES]
    return min(plans, key=lambda timed: timed[1])[0]


def _zb_v_list_schedule(pp: int, m: int, order: list[str], slack: int) -> tuple[Plan, int]:
    """One list schedule of `zb_v` at unit costs; returns it and its makespan."""
    stages, limit = StageMap(pp, 2, Placement.V), 2 * pp
    f_done: dict[tuple[int, int], int] = {}  # (stage, mb) -> end of its F
    b_done: dict[tuple[int, int], int] = {}
    runs = {kind: [0] * (2 * pp) for kind in (Kind.F, Kind.B)}  # passes run per stage
    pending: list[deque[Action]] = [deque() for _ in range(pp)]  # B run, W not
    held = [0] * pp
    plan: Plan = {r: [] for r in range(pp)}
    never = 1 << 30
    held_by = [stages.stages_of(r) for r in range(pp)]  # rank -> its stages, chunk order
    last, runs_f, runs_b = stages.last, runs[Kind.F], runs[Kind.B]
    passes = [(name[0], 0 if name == "W" else int(name[1])) for name in order]

    def next_pass(r: int, t: int) -> Action | None:
        for kind, chunk in passes:
            if kind == "W":
                if pending[r]:
                    return pending[r][0]
                continue
            s = held_by[r][chunk]
            if kind == "B":
                b = runs_b[s]
                after_next = s == last or b_done.get((s + 1, b), never) <= t
                if b < runs_f[s] and f_done[(s, b)] <= t and after_next:
                    return Action(Kind.B, s, b)
            else:
                f = runs_f[s]
                room = held[r] + (slack if chunk == 0 else 0) < limit
                if f < m and room and (s == 0 or f_done.get((s - 1, f), never) <= t):
                    return Action(Kind.F, s, f)
        return None

    t = 0
    while any(pending) or any(n < m for n in runs[Kind.B]):
        chosen = [(r, next_pass(r, t)) for r in range(pp)]  # all decide on the state at t
        for r, a in chosen:
            if a is None:
                continue
            plan[r].append(a)
            if a.kind is Kind.W:
                pending[r].popleft()
                held[r] -= 1
                continue
            runs[a.kind][a.stage] += 1
            (f_done if a.kind is Kind.F else b_done)[(a.stage, a.mb)] = t + 1
            if a.kind is Kind.F:
                held[r] += 1
            else:
                pending[r].append(Action(Kind.W, a.stage, a.mb))
        t += 1
        assert t <= 6 * m + 4 * pp * pp, "zb_v list scheduling stalled"
    return plan, t


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
    chunks: int | None = 1
    """Model chunks per rank (vpp) it runs: 1, 2 for ZB-V, or None for any vpp >= 2 with m a
    multiple of pp (interleaved)."""
    placement: Placement = Placement.LOOPED
    """How its chunks sit on the ranks (`ptdp.pipeline.placement`)."""
    splits_backward: bool = False
    """Runs B (input gradient) and W (weight gradient) apart instead of one fused BW."""
    doc: str = ""
    """One line for `ptdp schedule --help`."""

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


def implied_vpp(name: str) -> int | None:
    """The one vpp schedule `name` runs (1, or 2 for zb-v), which a config or `ptdp schedule`
    that leaves vpp unset takes; None for interleaved, which runs any vpp >= 2, so the choice
    is the user's."""
    return SCHEDULES[name].chunks


def check_args(name: str, pp: int, m: int, vpp: int = 1) -> None:
    """Raise ValueError, naming the numbers and the fix, if `build` cannot make this plan."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if pp < 1:
        raise ValueError(f"pp = {pp} pipeline ranks must be >= 1")
    if m < 1:
        raise ValueError(f"m = {m} microbatches must be >= 1")
    spec = SCHEDULES[name]
    if spec.interleaved:
        _check_interleaved(pp, m, vpp)
    elif vpp != spec.chunks:
        what = "one model chunk" if spec.chunks == 1 else f"{spec.chunks} model chunks"
        raise ValueError(
            f"schedule {name!r} runs {what} per rank but vpp = {vpp}; set vpp = {spec.chunks}"
            + (" or use the interleaved schedule" if spec.chunks == 1 else "")
        )


def build(name: str, pp: int, m: int, vpp: int = 1) -> Plan:
    """Compute-only plan of schedule `name` (a `SCHEDULES` key) after checking the arguments."""
    check_args(name, pp, m, vpp)
    return SCHEDULES[name].build(pp, m, vpp)


def in_flight_bound(name: str, pp: int, m: int, vpp: int = 1) -> list[int] | None:
    """Most activations each rank may stash under schedule `name`; None where only reported.

    Counted in (microbatch, chunk) pairs from F until BW, or until W when split. GPipe stashes
    all m, 1F1B at most pp - rank (the paper's p * M_B on rank 0), ZB-H1 pp and ZB-H2 2 pp - 1
    on every rank (the W's they defer hold their microbatches), ZB-V 2 pp half-size chunks.
    Interleaved has no simple closed form (Korthikanti et al. give the first stage's), so
    `verify` only reports it.
    """
    check_args(name, pp, m, vpp)
    bound = SCHEDULES[name].in_flight_bound
    return None if bound is None else bound(pp, m)


def theory_bubble(name: str, pp: int, m: int, vpp: int = 1) -> float:
    """The paper's bubble fraction of schedule `name` under unit costs (`ScheduleSpec.bubble`)."""
    check_args(name, pp, m, vpp)
    return SCHEDULES[name].bubble(pp, m, vpp)


def add_comms(plan: Plan, stages: StageMap) -> Plan:
    """Lower a compute-only plan: add the sends and receives between neighbouring stages.

    RECV_F goes right before each F of a stage > 0 and SEND_F right after each F of a stage
    below the last; RECV_B/SEND_B do the same around each B or BW. Transfers whose two stages
    share a rank (pp == 1, or ZB-V's turn from stage pp - 1 to pp) stay in memory and get no
    action. Receives are placed as late as possible and sends as early as possible, so a rank
    blocks only when it must.
    """
    apart_below, apart_above = apart(stages)
    lowered: Plan = {}
    for r, actions in plan.items():
        out: list[Action] = []
        append = out.append
        for a in actions:
            kind, s = a.kind, a.stage
            if kind is Kind.F:
                if apart_below[s]:
                    append(Action(Kind.RECV_F, s, a.mb))
                append(a)
                if apart_above[s]:
                    append(Action(Kind.SEND_F, s, a.mb))
            elif kind is Kind.B or kind is Kind.BW:
                if apart_above[s]:
                    append(Action(Kind.RECV_B, s, a.mb))
                append(a)
                if apart_below[s]:
                    append(Action(Kind.SEND_B, s, a.mb))
            else:
                append(a)
        lowered[r] = out
    return lowered


def apart(stages: StageMap) -> tuple[list[bool], list[bool]]:
    """Per stage: whether its input comes from another rank (`add_comms` puts a RECV_F before
    its F and a SEND_B after its B), and whether its output goes to another rank (SEND_F after
    F, RECV_B before B). Neighbours on one rank (pp == 1, ZB-V's turn) pass in memory."""
    last, rank = stages.last, [stages.rank(s) for s in range(stages.stages)]
    below = [s > 0 and rank[s - 1] != rank[s] for s in range(stages.stages)]
    above = [s < last and rank[s + 1] != rank[s] for s in range(stages.stages)]
    return below, above


def forward_only(stages: StageMap, m: int) -> Plan:
    """Forwards only (evaluation): each rank runs microbatch by microbatch, its stages in order.

    Every wait points to a lower stage of the same microbatch or to an earlier microbatch,
    so with non-blocking sends it cannot deadlock. Not for `verify` (it has no backward).
    """
    return {
        r: [Action(Kind.F, s, mb) for mb in range(m) for s in sorted(stages.stages_of(r))]
        for r in range(stages.pp)
    }
