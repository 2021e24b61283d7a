"""The classic pipeline schedules, each backward one fused BW: GPipe, 1F1B and interleaved 1F1B.

Pure functions of ints, each returning a compute-only `Plan` (registered, with their bubble
formulas and in-flight bounds, in `ptdp.pipeline.schedules.SCHEDULES`), and the forward-only
plan of evaluation. Their orders are closed forms: warm-up forwards, then one forward and one
backward in turn, then the cool-down backwards. The zero-bubble schedules, whose backward is
split into B and W, are apart in `ptdp.pipeline.zero_bubble`.

Letters: pp = pipeline ranks, vpp = model chunks per rank, m = microbatches per pipeline per
step, r = pipeline rank (0 first). Interleaved stages are looped (rank r holds r, r + pp,
r + 2 pp, ..., Megatron's interleaving; `ptdp.pipeline.placement`).

Sources: GPipe (Huang et al., arXiv 1811.06965); 1F1B = PipeDream-Flush and interleaved 1F1B
(Narayanan et al., arXiv 2104.04473, section 2.2).
"""

from __future__ import annotations

from ptdp.pipeline.actions import Action, Kind, Plan
from ptdp.pipeline.placement import StageMap


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
    check_interleaved(pp, m, vpp)
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


def check_interleaved(pp: int, m: int, vpp: int) -> None:
    """Raise ValueError, naming the numbers and the fix, unless interleaved can run (pp, m, vpp)."""
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


def forward_only(stages: StageMap, m: int) -> Plan:
    """Forwards only (evaluation): each rank runs microbatch by microbatch, its stages in order.

    Every wait points to a lower stage of the same microbatch or to an earlier microbatch,
    so with non-blocking sends it cannot deadlock. Not for `verify` (it has no backward).
    """
    return {
        r: [Action(Kind.F, s, mb) for mb in range(m) for s in sorted(stages.stages_of(r))]
        for r in range(stages.pp)
    }
