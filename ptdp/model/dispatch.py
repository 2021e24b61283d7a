"""Dispatch and combine of a mixture-of-experts block: token-choices to expert rows and
back, on one rank or over an expert-parallel group.

Shapes: t = tokens, h = hidden, k = experts per token, e = experts, n = expert rows (the
kept token-choices), ep = expert-parallel size, l = experts per member (e / ep), m = rows
a member's experts receive.

Interface (`ptdp.model.moe.MoE` calls it so; any caller that has routed its tokens can):

    plan = plan_dispatch(routing, num_experts, cap)  # routing.experts, .weights [t, k]
    out, _ = dispatch_combine(tokens, plan, routing.weights, experts, ep)  # [t, h]

`experts(rows [m, h], counts [l], expert [m]) -> [m, h]` computes rows grouped by local
expert (`GroupedExperts.forward`); `ep` is the expert-parallel group (`Group.single()`:
none); `during=` runs a function while the dispatch is in flight (moe_overlap: the shared
experts) and its result is the second value. `plan.routed` and `plan.dropped` are the
figures the balancing loss and the log read. `Dispatcher.REFERENCE` selects the earlier
path, kept as the oracle the fused one is tested against (tests/unit/test_moe_dispatch.py,
tests/dist/test_moe.py) and measured against (benchmarks/parallelism/moe_dispatch.py):
`PLANS[dispatcher](...)` plans, and `dispatch_combine(..., dispatcher)` moves the rows,
either way (`MoE(dispatch=...)`).

The fused path (`Dispatcher.FUSED`, the default) makes one pass over the token rows in
and one out: `_Permute` gathers each kept choice's token row in expert order (the send
layout under expert parallelism: members hold consecutive experts), `_Unpermute` adds
each row back into its token, times its weight, in one fp32 scatter-add. Their backwards
are one scatter-add and one gather, from the saved indices. `plan_dispatch` sorts once:
the capacity order (expert, then weight descending, then token) is one stable sort of an
integer key. Under expert parallelism the rows arrive grouped by source member, then
local expert; one all-to-all cannot interleave the sources, so the receiver regroups them
by local expert with one gather whose index comes from the exchanged counts (no sort; the
reference sorts twice), and sends the outputs back through the inverse gather; each
gather's backward is the other gather (a permutation needs no zero-filled buffer).
Rows are moved with index_select and index_add, whose sums run in a fixed order on a CPU
(unlike advanced indexing's threaded `index_put_`), so runs repeat bitwise. On CUDA
index_add adds with atomics: a token's first two choices add alike in either order, a
third may round differently between runs (the reference's combine summed in choice order;
its gather's backward was an index_add too) unless torch.use_deterministic_algorithms is
on, under which PyTorch's index_add is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from ptdp.model.router import Routing
from ptdp.parallel import comm
from ptdp.parallel.comm import Group

Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""rows [m, h] grouped by local expert, counts [l], expert [m] -> outputs [m, h]."""


class Dispatcher(Enum):
    """Which implementation moves the rows (`MoE(dispatch=...)`); both compute the same."""

    FUSED = "fused"
    REFERENCE = "reference"


@dataclass(frozen=True)
class Dispatch:
    """Which token-choice each expert row computes: rows grouped by expert."""

    choice: torch.Tensor
    """[n] the flat index (token * k + j) of each row's token-choice."""
    expert: torch.Tensor
    """[n] each row's expert."""
    counts: torch.Tensor
    """[e] rows of each expert."""
    routed: torch.Tensor
    """[e] token-choices routed to each expert, before the capacity cut."""
    dropped: torch.Tensor
    """Token-choices over capacity (0 when dropless)."""


def capacity(factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """Token-choices an expert keeps per microbatch: ceil(factor * t * k / e); 0 = all."""
    return math.ceil(factor * tokens * top_k / num_experts) if factor > 0 else 0


# ----------------------------------------------------------------------------- plans


@torch.compiler.disable  # data-dependent: ptdp.model.compile
def plan_dispatch(routing: Routing, num_experts: int, cap: int = 0) -> Dispatch:
    """Sort the token-choices by expert, in token order within an expert. With a capacity
    `cap` > 0 an expert keeps its `cap` choices of highest weight (equal weights: the
    earlier token), its rows then in that order, and the rest are dropped.

    One stable sort: dropless, of the experts; with a capacity, of the key expert * 2^32 +
    rank of the weight descending (the fp32 bits ordered as the floats are), which orders
    as `plan_dispatch_reference`'s two sorts do."""
    flat = routing.experts.reshape(-1)
    routed = torch.bincount(flat, minlength=num_experts)
    if cap <= 0:
        order = torch.sort(flat, stable=True).indices
        return Dispatch(order, flat[order], routed, routed, routed.new_zeros(()))
    bits = routing.weights.detach().float().reshape(-1).view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, -(2**31) - bits)  # increasing as the floats
    order = torch.sort(flat * 2**32 + (2**31 - ordered), stable=True).indices
    expert = flat[order]
    first = routed.cumsum(0) - routed  # each expert's first row in `order`
    keep = torch.arange(len(order), device=flat.device) - first[expert] < cap
    counts = routed.clamp(max=cap)
    return Dispatch(order[keep], expert[keep], counts, routed, len(flat) - counts.sum())


@torch.compiler.disable  # data-dependent: ptdp.model.compile
def plan_dispatch_reference(routing: Routing, num_experts: int, cap: int = 0) -> Dispatch:
    """`plan_dispatch` as first written: a sort by weight, then a stable sort by expert."""
    flat = routing.experts.reshape(-1)
    routed = torch.bincount(flat, minlength=num_experts)
    if cap <= 0:
        order = torch.sort(flat, stable=True).indices
        return Dispatch(order, flat[order], routed, routed, routed.new_zeros(()))
    by_weight = torch.sort(routing.weights.detach().reshape(-1), descending=True, stable=True)
    order = by_weight.indices[torch.sort(flat[by_weight.indices], stable=True).indices]
    expert = flat[order]
    first = routed.cumsum(0) - routed  # each expert's first row in `order`
    keep = torch.arange(len(order), device=flat.device) - first[expert] < cap
    order, expert = order[keep], expert[keep]
    counts = torch.bincount(expert, minlength=num_experts)
    return Dispatch(order, expert, counts, routed, len(flat) - counts.sum())


PLANS = {Dispatcher.FUSED: plan_dispatch, Dispatcher.REFERENCE: plan_dispatch_reference}
"""Each dispatcher's plan (both give the same `Dispatch`)."""


@dataclass(frozen=True)
class Exchange:
    """What an expert-parallel member sends, receives, and how it regroups what arrives."""

    send: list[int]
    """Rows to each member (its experts' rows, contiguous in the plan's order)."""
    recv: list[int]
    """Rows from each member."""
    to_expert: torch.Tensor
    """[m] arrival position of each row in local-expert order (expert, then source)."""
    to_source: torch.Tensor
    """[m] the inverse: local-expert position of each arrived row."""
    counts: torch.Tensor
    """[l] rows of each local expert."""
    expert: torch.Tensor
    """[m] each row's local expert, in local-expert order."""


def plan_exchange(counts: torch.Tensor, ep: Group) -> Exchange:
    """The all-to-all's sizes and the receiver's regrouping from the plan's `counts` [e]:
    one exchange of counts, then arithmetic on them (`regroup`); the sizes go to the host."""
    sent = counts.view(ep.size, len(counts) // ep.size)  # [member, its expert]: rows sent
    got = comm.exchange_counts(sent, ep)  # [source member, my expert]: rows received
    send, recv = sent.sum(1).tolist(), got.sum(1).tolist()
    return Exchange(send, recv, *regroup(got, sum(recv)))


def regroup(
    got: torch.Tensor, m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(to_expert, to_source, counts, expert) of `Exchange` for rows arriving in segments
    (source s, local expert j) of got[s, j] rows each, source-major, m in all: row i of
    segment (s, j) in (j, s) order is arrival row start[s, j] + i. No sort."""
    sources, local = got.shape
    device = got.device
    arrival = got.reshape(-1)  # segment lengths, as the rows arrive
    start = arrival.cumsum(0) - arrival  # where each segment starts on arrival
    by_expert = got.t().reshape(-1)  # the same segments in (expert, source) order
    segment = torch.arange(sources * local, device=device).view(sources, local).t().reshape(-1)
    first = by_expert.cumsum(0) - by_expert  # where each starts in (expert, source) order
    rows = torch.arange(m, device=device)
    seg = torch.repeat_interleave(segment, by_expert, output_size=m)
    to_expert = start[seg] + rows - torch.repeat_interleave(first, by_expert, output_size=m)
    to_source = torch.empty_like(to_expert).index_copy_(0, to_expert, rows)
    counts = got.sum(0)
    expert = torch.repeat_interleave(torch.arange(local, device=device), counts, output_size=m)
    return to_expert, to_source, counts, expert


# ----------------------------------------------------------------------------- row movers


class _Permute(torch.autograd.Function):
    """rows [n, h] = tokens [t, h] at `token` [n]: one gather; backward, one scatter-add of
    the rows' gradients into their tokens (a token chose up to k experts)."""

    @staticmethod
    def forward(ctx, tokens, token):
        ctx.save_for_backward(token)
        ctx.tokens = tokens.shape[0]
        return tokens.index_select(0, token)

    @staticmethod
    def backward(ctx, grad):
        (token,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.tokens, grad.shape[-1])
        return out.index_add_(0, token, grad), None


class _Reorder(torch.autograd.Function):
    """rows[index] for a permutation `index` with inverse `inverse`: one gather, and one
    gather (by the inverse) backward."""

    @staticmethod
    def forward(ctx, rows, index, inverse):
        ctx.save_for_backward(inverse)
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _Unpermute(torch.autograd.Function):
    """tokens [t, h] = sum over rows r of token[r]: weight[r] * rows[r], in fp32, one
    scatter-add (a dropped choice adds nothing). Backward, one gather of the tokens'
    gradients: d rows[r] = weight[r] * g[token[r]], d weight[r] = <g[token[r]], rows[r]>."""

    @staticmethod
    def forward(ctx, rows, weights, choice, token):
        t, k = weights.shape
        acc = torch.promote_types(rows.dtype, torch.float32)  # fp32, or fp64 for a gradcheck
        w = weights.reshape(-1).index_select(0, choice).to(acc)  # [n]
        out = rows.new_zeros(t, rows.shape[-1], dtype=acc)
        out.index_add_(0, token, rows.to(acc) * w.unsqueeze(-1))
        ctx.save_for_backward(rows, w, choice, token)
        ctx.weights = (t, k, weights.dtype)
        return out.to(rows.dtype)

    @staticmethod
    def backward(ctx, grad):
        rows, w, choice, token = ctx.saved_tensors
        t, k, dtype = ctx.weights
        g = grad.to(w.dtype).index_select(0, token)  # [n, h]
        d_rows = (g * w.unsqueeze(-1)).to(rows.dtype) if ctx.needs_input_grad[0] else None
        d_weights = None
        if ctx.needs_input_grad[1]:
            d_w = (g * rows.to(w.dtype)).sum(-1).to(dtype)
            d_weights = d_w.new_zeros(t * k).index_copy_(0, choice, d_w).view(t, k)
        return d_rows, d_weights, None, None


def permute(tokens: torch.Tensor, plan: Dispatch, top_k: int) -> torch.Tensor:
    """tokens [t, h] -> the plan's rows [n, h], grouped by expert (`_Permute`)."""
    return _Permute.apply(tokens, plan.choice // top_k)


def unpermute(rows: torch.Tensor, plan: Dispatch, weights: torch.Tensor) -> torch.Tensor:
    """The plan's rows [n, h] -> tokens [t, h], each the sum of its choices' rows times
    their weights [t, k] (`_Unpermute`)."""
    return _Unpermute.apply(rows, weights, plan.choice, plan.choice // weights.shape[1])


# ----------------------------------------------------------------------------- the two paths


@torch.compiler.disable  # data-dependent: ptdp.model.compile
def dispatch_combine(
    tokens: torch.Tensor,
    plan: Dispatch,
    weights: torch.Tensor,
    experts: Experts,
    ep: Group,
    dispatcher: Dispatcher = Dispatcher.FUSED,
    during: Callable[[], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """tokens [t, h] -> ([t, h]: each token's sum of its kept choices' expert outputs times
    their weights [t, k], the experts of all of them split over `ep`; what `during`
    returned). `during` (moe_overlap: the shared experts) runs while the dispatch's
    all-to-all is in flight, posted asynchronously; with nothing in flight (ep = 1) it is
    not run and None comes back."""
    if dispatcher is Dispatcher.REFERENCE:
        return _reference(tokens, plan, weights, experts, ep, during)
    top_k = weights.shape[1]
    rows = permute(tokens, plan, top_k)
    if ep.size == 1:
        return unpermute(experts(rows, plan.counts, plan.expert), plan, weights), None
    x = plan_exchange(plan.counts, ep)
    arrived, extra = _send(rows, ep, x.send, x.recv, during)  # by source, then expert
    grouped = _Reorder.apply(arrived, x.to_expert, x.to_source)  # by expert, then source
    out = _Reorder.apply(experts(grouped, x.counts, x.expert), x.to_source, x.to_expert)
    return unpermute(comm.all_to_all(out, ep, x.recv, x.send), plan, weights), extra


def _send(
    rows: torch.Tensor,
    ep: Group,
    send: list[int],
    recv: list[int],
    during: Callable[[], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The dispatch's all-to-all; `during` runs while it is in flight. In backward the
    exchange of the rows' gradients is posted likewise and `during`'s backward runs while
    it is in flight (`comm.all_to_all_start`: autograd runs the nodes made between start
    and wait between their backwards). The combine's exchange is waited for at once: the
    experts need the rows, and a forward of one microbatch cannot run inside another's
    backward without an own autograd engine."""
    if during is None:
        return comm.all_to_all(rows, ep, send, recv), None
    posted, handle = comm.all_to_all_start(rows, ep, send, recv)
    extra = during()  # while the rows travel
    return comm.all_to_all_wait(posted, handle), extra


def combine(rows: torch.Tensor, plan: Dispatch, weights: torch.Tensor) -> torch.Tensor:
    """Expert rows [n, h] -> tokens [t, h]: each token's sum of its choices' rows times their
    weights [t, k], in fp32 and in choice order (deterministic); a dropped choice adds 0.
    The reference path's combine."""
    t, k = weights.shape
    per_choice = rows.new_zeros(t * k, rows.shape[-1]).index_copy(0, plan.choice, rows)
    out = (per_choice.view(t, k, -1).float() * weights.unsqueeze(-1)).sum(1)
    return out.to(rows.dtype)


def _reference(
    tokens: torch.Tensor,
    plan: Dispatch,
    weights: torch.Tensor,
    experts: Experts,
    ep: Group,
    during: Callable[[], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The path first written: gather, (all-to-all, sort, compute, unsort, all-to-all),
    index_copy into a [t * k, h] buffer and a weighted sum over k."""
    rows, extra = tokens.index_select(0, plan.choice // weights.shape[1]), None
    if ep.size > 1:
        rows, extra = _reference_expert_parallel(rows, plan, experts, ep, during)
    else:
        rows = experts(rows, plan.counts, plan.expert)
    return combine(rows, plan, weights), extra


def _reference_expert_parallel(
    rows: torch.Tensor,
    plan: Dispatch,
    experts: Experts,
    ep: Group,
    during: Callable[[], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows [n, h] grouped by expert -> their experts' outputs [n, h], in the same order,
    the experts living on the members of the expert-parallel group (and what `during`
    returned, run while the dispatch is in flight).

    Each member sends every expert's rows to the member holding it (members hold
    consecutive experts, so the rows for one member are contiguous), computes what it
    receives grouped by its own experts (source members in rank order within an
    expert: every source's rows keep their order) and sends the outputs back.
    """
    local = len(plan.counts) // ep.size
    sent = plan.counts.view(ep.size, local)  # [member, its expert]: rows sent
    got = comm.exchange_counts(sent, ep)  # [source member, my expert]: rows received
    send, recv = sent.sum(1).tolist(), got.sum(1).tolist()
    arrived, extra = _send(rows, ep, send, recv, during)  # by source, then expert
    expert = torch.arange(local, device=rows.device).repeat(ep.size)
    expert = expert.repeat_interleave(got.reshape(-1))
    order = torch.sort(expert, stable=True).indices  # by expert, then source
    out = experts(arrived.index_select(0, order), got.sum(0), expert[order])
    back = out.index_select(0, torch.argsort(order))  # by source again
    return comm.all_to_all(back, ep, recv, send), extra
