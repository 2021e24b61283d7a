"""The interleaved schedule as Megatron-LM's 2021 code ran it, for `--software megatron-2021`.

ptdp's runtime posts each receive right before the pass that needs it and each send right
after the pass that made it (`ptdp.pipeline.lowering.add_comms`). The paper's code
(`forward_backward_pipelining_with_interleaving` in megatron/schedules.py, 2021) did not: in
its steady state a rank runs one forward and one backward, then one batched exchange
(`send_forward_backward_recv_forward_backward`) that sends the forward's output and the
backward's gradient and receives the inputs of later passes, and waits for all four
(`batch_isend_irecv`, each request waited on, then `torch.cuda.synchronize()`). So a forward's
output leaves only after the backward that follows it, and the next forward cannot start
before the gradient for the next backward has arrived. Warm-up (all forwards, each followed
by `send_forward_recv_forward`) and cool-down (`send_backward_recv_backward`) are exchanges
too. Its warm-up is 2 (p - r - 1) + (v - 1) p passes on rank r, all m v passes when m = p
(then every rank runs all forwards before any backward), and the virtual microbatch k runs
chunk (k mod p v) // p (backward: v - 1 minus that) of microbatch (k // p v) p + k mod p.

`megatron_2021_interleaved(stages, m)` writes those action lists: the compute order of the
2021 code and its exchanges as SEND and RECV actions (the RECVs of one exchange after its
SENDs, each receive the next message that rank gets from that neighbour, in order, as
NCCL matches them). Replayed with blocking transfers, each exchange holds its rank for its
sends and until its receives are in. The 1F1B schedule of that code already has ptdp's
order (send after the pass, receive before it), so it needs nothing here.
"""

from __future__ import annotations

import functools

from ptdp.pipeline.actions import Action, Kind, Plan
from ptdp.pipeline.placement import Placement, StageMap


def _chunk(k: int, pp: int, vpp: int, forward: bool) -> int:
    """Model chunk of virtual microbatch k (Python's % on negative k, as the 2021 code)."""
    chunk = (k % (pp * vpp)) // pp
    return chunk if forward else vpp - 1 - chunk


def _microbatch(k: int, pp: int, vpp: int) -> int:
    return (k // (pp * vpp)) * pp + k % pp


@functools.lru_cache(maxsize=64)  # the planner replays each (pp, vpp, m) for many layouts
def megatron_2021_interleaved(stages: StageMap, m: int) -> Plan:
    """Per rank: the 2021 code's interleaved passes and exchanges (module doc); shared
    between callers, so read-only.

    Needs the looped placement, vpp > 1 and m a multiple of pp (the 2021 code asserted it).
    """
    pp, vpp = stages.pp, stages.vpp
    if stages.placement is not Placement.LOOPED or vpp < 2 or m % pp:
        raise ValueError(
            f"Megatron-LM 2021's interleaved schedule needs looped chunks, vpp >= 2 and m a "
            f"multiple of pp; got {stages.placement.value}, vpp = {vpp}, m = {m}, pp = {pp}"
        )
    return {r: _rank_actions(stages, m, r) for r in range(pp)}


def _rank_actions(stages: StageMap, m: int, rank: int) -> list[Action]:
    pp, vpp, last = stages.pp, stages.vpp, stages.last
    total = m * vpp

    forwards = [
        Action(Kind.F, _chunk(k, pp, vpp, True) * pp + rank, _microbatch(k, pp, vpp))
        for k in range(total)
    ]
    backwards = [
        Action(Kind.BW, _chunk(k, pp, vpp, False) * pp + rank, _microbatch(k, pp, vpp))
        for k in range(total)
    ]
    fwd, bwd = forwards.__getitem__, backwards.__getitem__
    # What this rank receives from each neighbour, in the order NCCL matches it.
    inputs = [Action(Kind.RECV_F, a.stage, a.mb) for a in forwards if a.stage > 0]
    grads = [Action(Kind.RECV_B, a.stage, a.mb) for a in backwards if a.stage < last]
    inputs.reverse()
    grads.reverse()

    def exchange(f: Action | None, b: Action | None, recv_prev: bool, recv_next: bool):
        out = []
        if f is not None and f.stage < last:
            out.append(Action(Kind.SEND_F, f.stage, f.mb))
        if b is not None and b.stage > 0:
            out.append(Action(Kind.SEND_B, b.stage, b.mb))
        if recv_prev and inputs:
            out.append(inputs.pop())
        if recv_next and grads:
            out.append(grads.pop())
        return out

    all_warmup = m == pp
    warmup = total if all_warmup else min(2 * (pp - rank - 1) + (vpp - 1) * pp, total)
    remaining = total - warmup
    first, last_rank = rank == 0, rank == pp - 1
    actions: list[Action] = []
    if not first:
        actions.append(inputs.pop())  # recv_forward before the first forward
    for k in range(warmup):
        actions.append(fwd(k))
        recv_prev = not (first and _chunk(k + 1, pp, vpp, True) == 0) and k != total - 1
        recv_next = k == warmup - 1 and not all_warmup and not last_rank
        actions += exchange(fwd(k), None, recv_prev, recv_next)
    for k in range(remaining):
        forward_k = k + warmup
        actions += [fwd(forward_k), bwd(k)]
        if first:  # "first stage is ahead of last stage by (pipeline_parallel_size - 1)"
            recv_prev = _chunk(forward_k - (pp - 1), pp, vpp, True) != vpp - 1
        else:
            recv_prev = True
        if last_rank:
            recv_next = _chunk(k - (pp - 1), pp, vpp, False) != 0
        else:
            recv_next = True
        recv_prev = recv_prev and k != remaining - 1
        actions += exchange(fwd(forward_k), bwd(k), recv_prev, recv_next)
    if all_warmup and not last_rank:
        actions.append(grads.pop())  # recv_backward before the first backward
    for k in range(remaining, total):
        actions.append(bwd(k))
        recv_next = not (last_rank and _chunk(k + 1, pp, vpp, False) == vpp - 1)
        actions += exchange(None, bwd(k), False, recv_next and k != total - 1)
    if inputs or grads:
        raise ValueError(
            f"rank {rank}: the 2021 exchanges left {len(inputs)} inputs and {len(grads)} "
            f"gradients unreceived (pp = {pp}, vpp = {vpp}, m = {m})"
        )
    return actions
