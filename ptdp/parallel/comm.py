"""The one module that calls torch.distributed collectives.

Tensor-parallel region operators after Shoeybi et al. 2019 (arXiv 1909.08053, the f and g
of Fig. 3) and their sequence-parallel pairs after Korthikanti et al. 2022 (arXiv
2205.05198). Each is an autograd function whose backward is the conjugate collective.
Shapes: s = sequence, b = batch, h = hidden, t = tensor-parallel size; the body runs
sequence-first, so sequence parallelism splits dim 0.

Every collective goes through the primitives below (`_all_reduce`, `_all_gather`,
`_reduce_scatter`, `_split`, and expert parallelism's `_all_to_all` and
`_all_to_all_async`), which is where tests
count communication. gloo has no
reduce-scatter, so on gloo it is an all-reduce followed by taking this rank's slice: the
same numbers, more bytes on the wire (counted as a reduce-scatter all the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    """A process group with its size and this rank's index in it (group=None: one rank)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    @classmethod
    def single(cls) -> Group:
        return cls(None, 1, 0)


# ----------------------------------------------------------------------------- primitives


def _all_reduce(x: torch.Tensor, g: Group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=g.group)
    return x


def _all_gather(x: torch.Tensor, g: Group, dim: int) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`."""
    parts = [torch.empty_like(x) for _ in range(g.size)]
    dist.all_gather(parts, x.contiguous(), group=g.group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, g: Group, dim: int) -> torch.Tensor:
    """Sum over ranks, keep this rank's 1/t slice along `dim`."""
    if dist.get_backend(g.group) == "nccl" and dim == 0:
        out = torch.empty((x.shape[0] // g.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x.contiguous(), group=g.group)
        return out
    summed = x.clone().contiguous()
    dist.all_reduce(summed, group=g.group)  # gloo: no reduce-scatter; same result
    return _split(summed, g, dim)


def _split(x: torch.Tensor, g: Group, dim: int) -> torch.Tensor:
    """This rank's 1/t slice along `dim` (no communication)."""
    size = x.shape[dim]
    if size % g.size:
        raise ValueError(f"dim {dim} of size {size} does not split over {g.size} ranks")
    return x.narrow(dim, g.rank * (size // g.size), size // g.size).contiguous()


def _all_to_all(x: torch.Tensor, g: Group, send: list[int], recv: list[int]) -> torch.Tensor:
    """Rows [send[0] | send[1] | ...] of `x` go to members 0, 1, ...; the rows received,
    `recv[i]` from member i, are concatenated in member order."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=g.group)
    return out


def _all_to_all_async(
    x: torch.Tensor, g: Group, send: list[int], recv: list[int]
) -> tuple[torch.Tensor, dist.Work]:
    """`_all_to_all` posted (async_op): the receive buffer, filled once the work is waited on."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), recv, send, group=g.group, async_op=True)
    return out, work


# ----------------------------------------------------------------------------- tensor parallel


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.g), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx, x, g):
        return _all_reduce(x.clone(), g)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _all_gather(x, g, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.g, dim=-1), None


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _split(x, g, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.g, dim=-1), None


# ----------------------------------------------------------------------------- sequence parallel


class _GatherFromSP(torch.autograd.Function):
    """All-gather along the sequence (dim 0) forward; reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _all_gather(x, g, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.g, dim=0), None


class _ReduceScatterToSP(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _reduce_scatter(x, g, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.g, dim=0), None


class _GatherSeqFromTP(torch.autograd.Function):
    """All-gather along the sequence (dim 0) forward; keep this rank's slice backward: the
    output feeds a region replicated over the group, whose gradient every member holds."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _all_gather(x, g, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.g, dim=0), None


class _ScatterToSP(torch.autograd.Function):
    """Keep this rank's sequence slice forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _split(x, g, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.g, dim=0), None


# ----------------------------------------------------------------------------- context parallel


class _GatherFromCP(torch.autograd.Function):
    """All-gather along `dim` forward (every rank's keys/values); reduce-scatter backward
    (each rank's keys were read by every rank's queries: their gradients sum)."""

    @staticmethod
    def forward(ctx, x, g, dim):
        ctx.g, ctx.dim = g, dim
        return _all_gather(x, g, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.g, dim=ctx.dim), None, None


class _SumAcross(torch.autograd.Function):
    """All-reduce forward; all-reduce backward. Every member's loss reads the sum (the
    mixture-of-experts balancing loss of a sequence split over cp), and the members' losses
    are averaged like any other: each input's gradient is the sum of theirs."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _all_reduce(x.clone(), g)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.g), None


class _AllToAll(torch.autograd.Function):
    """Rows to their members forward; the gradients of the received rows back to where the
    rows came from, backward (the same exchange with the splits swapped)."""

    @staticmethod
    def forward(ctx, x, g, send, recv):
        ctx.g, ctx.send, ctx.recv = g, send, recv
        return _all_to_all(x, g, send, recv)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.g, ctx.recv, ctx.send), None, None, None


def all_to_all(x: torch.Tensor, g: Group, send: list[int], recv: list[int]) -> torch.Tensor:
    """Expert parallelism's exchange of token rows (`_all_to_all`), differentiable; `send`
    and `recv`: rows to and from each member, which every member must agree on."""
    return x if g.size == 1 else _AllToAll.apply(x, g, send, recv)


class AllToAllHandle:
    """An all-to-all in flight between `all_to_all_start` and `all_to_all_wait`, in forward
    and again (its gradient) in backward: the one `dist.Work` not yet waited on, and in
    backward the buffer it fills."""

    def __init__(self, g: Group, send: list[int], recv: list[int]) -> None:
        self.g, self.send, self.recv = g, send, recv
        self.work: dist.Work | None = None
        self.grad: torch.Tensor | None = None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


class _AllToAllStart(torch.autograd.Function):
    """Forward posts the exchange and returns the receive buffer, to be read only after
    `_AllToAllWait`; backward waits for the gradient's exchange that `_AllToAllWait`'s
    backward posted and returns its buffer, the gradient of the rows sent."""

    @staticmethod
    def forward(ctx, x, handle):
        ctx.handle = handle
        out, handle.work = _all_to_all_async(x, handle.g, handle.send, handle.recv)
        return out

    @staticmethod
    def backward(ctx, grad):
        h = ctx.handle
        h.wait()
        back, h.grad = h.grad, None
        return back, None


class _AllToAllWait(torch.autograd.Function):
    """Forward waits for the exchange (`out` is then filled); backward posts the gradient's
    exchange back (splits swapped) into the handle and passes the gradient on unchanged to
    `_AllToAllStart`'s backward, which waits for it."""

    @staticmethod
    def forward(ctx, out, handle):
        ctx.handle = handle
        handle.wait()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        h = ctx.handle
        h.grad, h.work = _all_to_all_async(grad, h.g, h.recv, h.send)
        return grad, None


def all_to_all_start(
    x: torch.Tensor, g: Group, send: list[int], recv: list[int]
) -> tuple[torch.Tensor, AllToAllHandle]:
    """`all_to_all`, posted without waiting: returns the receive buffer (not to be read yet)
    and the handle that `all_to_all_wait` takes. Whatever runs between the two overlaps the
    exchange: in forward, and in backward whatever autograd runs between the two functions'
    backwards (nodes created between them in forward run between them in backward, the
    engine taking ready nodes latest-created first). Every member must post its exchanges
    in the same order."""
    handle = AllToAllHandle(g, send, recv)
    if g.size == 1:
        return x, handle
    return _AllToAllStart.apply(x, handle), handle


def all_to_all_wait(out: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
    """The rows `all_to_all_start` posted, once they are in (differentiable)."""
    if handle.g.size == 1:
        return out
    return _AllToAllWait.apply(out, handle)


def exchange_counts(counts: torch.Tensor, g: Group) -> torch.Tensor:
    """counts [members, ...] (what this rank sends each member) -> [members, ...] (what each
    member sends this rank); no autograd. The sizes an `all_to_all` needs before it runs."""
    if g.size == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=g.group)
    return out


def sum_across(x: torch.Tensor, g: Group) -> torch.Tensor:
    """The sum of `x` over the group on every member, differentiable (`_SumAcross`)."""
    return x if g.size == 1 else _SumAcross.apply(x, g)


def gather_from_cp(x: torch.Tensor, g: Group, dim: int) -> torch.Tensor:
    """Concatenate the group's `x` along `dim` in rank order, with the conjugate backward."""
    return x if g.size == 1 else _GatherFromCP.apply(x, g, dim)


def ring_shift_async(send: torch.Tensor, recv: torch.Tensor, g: Group) -> list[dist.Work]:
    """Start sending `send` to the next member of the ring and receiving the previous
    member's into `recv` (ring attention's key/value rotation); wait on the works."""
    if g.size == 1:  # a ring of one: the tensor comes back to itself
        recv.copy_(send)
        return []
    nxt = dist.get_global_rank(g.group, (g.rank + 1) % g.size)
    prev = dist.get_global_rank(g.group, (g.rank - 1) % g.size)
    ops = [
        dist.P2POp(dist.isend, send, nxt, group=g.group),
        dist.P2POp(dist.irecv, recv, prev, group=g.group),
    ]
    return dist.batch_isend_irecv(ops)


def copy_to_tp(x: torch.Tensor, g: Group) -> torch.Tensor:
    return x if g.size == 1 else _CopyToTP.apply(x, g)


def reduce_from_tp(x: torch.Tensor, g: Group) -> torch.Tensor:
    return x if g.size == 1 else _ReduceFromTP.apply(x, g)


def gather_from_tp(x: torch.Tensor, g: Group) -> torch.Tensor:
    return x if g.size == 1 else _GatherFromTP.apply(x, g)


def scatter_to_tp(x: torch.Tensor, g: Group) -> torch.Tensor:
    return x if g.size == 1 else _ScatterToTP.apply(x, g)


def gather_from_sp(x: torch.Tensor, g: Group) -> torch.Tensor:
    return x if g.size == 1 else _GatherFromSP.apply(x, g)


def reduce_scatter_to_sp(x: torch.Tensor, g: Group) -> torch.Tensor:
    return x if g.size == 1 else _ReduceScatterToSP.apply(x, g)


def gather_seq_from_tp(x: torch.Tensor, g: Group) -> torch.Tensor:
    return x if g.size == 1 else _GatherSeqFromTP.apply(x, g)


def scatter_to_sp(x: torch.Tensor, g: Group) -> torch.Tensor:
    return x if g.size == 1 else _ScatterToSP.apply(x, g)


# ----------------------------------------------------------------------------- plain helpers


def all_reduce_sum_(tensor: torch.Tensor, g: Group) -> None:
    """In place, no autograd: the sum over the group (gradients, norms)."""
    if g.size > 1:
        dist.all_reduce(tensor, group=g.group)


def all_reduce_mean_(tensor: torch.Tensor, g: Group) -> None:
    """In place, no autograd: the mean of `tensor` over the group."""
    if g.size > 1:
        dist.all_reduce(tensor, group=g.group)
        tensor.div_(g.size)


def all_reduce_tensors_(tensors: list[torch.Tensor], g: Group, *, average: bool) -> None:
    """In place, no autograd: sum (or average) many tensors over the group in one call."""
    if g.size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=g.group)
    if average:
        flat.div_(g.size)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def all_reduce_value(x: torch.Tensor, g: Group) -> torch.Tensor:
    """No autograd: a new tensor holding the sum of `x` over the group."""
    return x if g.size == 1 else _all_reduce(x.clone(), g)


def all_reduce_max_value(x: torch.Tensor, g: Group) -> torch.Tensor:
    """No autograd: a new tensor holding the elementwise max of `x` over the group."""
    if g.size == 1:
        return x
    x = x.clone().contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=g.group)
    return x


def broadcast_(x: torch.Tensor, g: Group, src: int) -> None:
    """In place, no autograd: member `src`'s `x` (src counted within the group) on every
    member (the tokens a generation pipeline's last stage chose)."""
    if g.size > 1:
        dist.broadcast(x, group=g.group, group_src=src)


def gather_full(x: torch.Tensor, g: Group, dim: int) -> torch.Tensor:
    """No autograd: concatenate the shards of `x` along `dim` (for checkpoints and tests)."""
    return x if g.size == 1 else _all_gather(x.detach(), g, dim)


def gather_objects(obj: object, g: Group) -> list[object]:
    """Every group member's `obj` on the group's first member (others get [])."""
    if g.size == 1:
        return [obj]
    out = [None] * g.size if g.rank == 0 else None
    dst = dist.get_global_rank(g.group, 0) if g.group is not None else 0
    dist.gather_object(obj, out, dst=dst, group=g.group)
    return out or []


def all_gather_objects(obj: object, group: dist.ProcessGroup | None, size: int) -> list[object]:
    """Every member's `obj`, on every member, in rank order ([obj] when size is 1)."""
    if size == 1:
        return [obj]
    out: list[object] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: dist.ProcessGroup | None, size: int) -> None:
    if size > 1:
        dist.barrier(group=group)


def has_process_group() -> bool:
    """Whether the default process group is up (a single process may have none)."""
    return dist.is_available() and dist.is_initialized()


def world_group() -> Group:
    """The default group of all processes; one rank when there is no process group."""
    if not has_process_group():
        return Group.single()
    return Group(None, dist.get_world_size(), dist.get_rank())


def new_world_group(backend: str) -> dist.ProcessGroup:
    """A new group of all processes on `backend`, e.g. gloo for CPU-side work that must not
    interleave with the default group's collectives. Collective: every rank calls it."""
    return dist.new_group(backend=backend)


# ------------------------------------------------------- flat buffers (data parallelism)

# Newer torch renamed the flat collectives; older names keep older builds working.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_flat_async(out: torch.Tensor, inp: torch.Tensor, g: Group) -> dist.Work:
    """Start summing flat `inp` over the group into `out`, this rank's slice (a view of `inp`).

    Older gloo builds have no reduce-scatter: an all-reduce of `inp` leaves the same numbers
    in `out`, at twice the traffic.
    """
    try:
        return _reduce_scatter_flat(out, inp, group=g.group, async_op=True)
    except RuntimeError:
        if dist.get_backend(g.group) != "gloo":
            raise
        return dist.all_reduce(inp, group=g.group, async_op=True)


def all_reduce_async(x: torch.Tensor, g: Group) -> dist.Work:
    """Start summing `x` over the group in place; wait on the returned work."""
    return dist.all_reduce(x, group=g.group, async_op=True)


def all_gather_flat(whole: torch.Tensor, shard: torch.Tensor, g: Group) -> None:
    """Concatenate every rank's flat `shard` into `whole` (equal shards, rank order)."""
    _all_gather_flat(whole, shard, group=g.group)


def all_gather_flat_async(whole: torch.Tensor, shard: torch.Tensor, g: Group) -> dist.Work:
    """`all_gather_flat`, started; wait on the returned work."""
    return _all_gather_flat(whole, shard, group=g.group, async_op=True)


# ---------------------------------------------------------------- point to point (pipeline)


def send_recv_async(
    sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]]
) -> list[dist.Work]:
    """Post (tensor, global peer rank, tag) sends and receives as one batch; returns their
    works, sends first, in the order given (NCCL needs a pair's ops posted together)."""
    ops = [dist.P2POp(dist.isend, t, peer, tag=tag) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, tag=tag) for t, peer, tag in recvs]
    return dist.batch_isend_irecv(ops) if ops else []
