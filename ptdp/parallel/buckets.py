"""Where a rank's parameters and gradients live for data parallelism: flat buffers cut into
buckets. A module of its own so that the layout (this file) is apart from when and how the
buckets are reduced (`GradBuffers`, `ptdp.parallel.data`), and so that ZeRO-3's gathers
(`ptdp.parallel.zero3`) can name the records without importing the reducer.

Each model chunk's parameters live in one flat buffer (in the parameters' dtype) and their
gradients in a second, fp32 one: `param.main_grad` is a view into it. The buffers are cut
into buckets of about `bucket_mb` MiB, in reverse registration order (the order backward
produces them); a tied embedding sits alone in its bucket. Under sharding (ZeRO-1 and up)
buckets are padded to a multiple of dp, so that each rank owns an equal 1/dp of each.
ZeRO-2 keeps only that 1/dp of the gradients (a bucket's full gradient is allocated while
it is filled, `GradBuffers`); ZeRO-3 only that 1/dp of the parameters, in the chunk's
buffer, and each bucket's full parameters in a tensor of its own (`Bucket.whole`), which
the module's parameters view and whose storage is empty when no one uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ptdp.parallel.comm import Group


@dataclass
class Bucket:
    """A contiguous range [start, end) of one chunk's buffers and the parameters in it."""

    start: int
    end: int
    params: list[nn.Parameter]
    deferred: bool = False
    """Reduced in `finish` only, after a reduction over another group (tied embedding)."""
    sequence_parallel: list[nn.Parameter] = field(default_factory=list)
    """The parameters (in `params` order) whose gradients are summed over the tensor group
    first: partial sums under sequence parallelism."""
    pending: int = 0
    """Parameters still to receive their final gradient in this step (ZeRO-2: their next
    gradient since the bucket's full buffer was allocated)."""
    work: dist.Work | None = None
    launched: bool = False
    full: torch.Tensor | None = None
    """ZeRO-2: the bucket's full-size fp32 gradient while it is being filled."""
    whole: torch.Tensor | None = None
    """ZeRO-3: the bucket's full parameters (their views' storage), freed when unused."""
    shard: torch.Tensor | None = None
    """ZeRO-3: this rank's 1/dp of the parameters, a view of the chunk's `params`."""
    users: int = 0
    """ZeRO-3: forwards and backwards holding `whole` now (`ParamGather`)."""
    gather: dist.Work | None = None
    """ZeRO-3: the all-gather filling `whole`, while in flight."""
    whole8: torch.Tensor | None = None
    """ZeRO-3's fp8 all-gather (`ptdp.parallel.zero3_fp8`): the bucket's weights in float8,
    gathered instead of `whole` (whose storage then stays empty), freed when unused."""
    shard8: torch.Tensor | None = None
    """This rank's 1/dp of `whole8`: `shard` cast in float8 while its gather is in flight."""

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass
class ChunkBuffer:
    """One chunk's parameter and gradient buffers and their buckets."""

    params: torch.Tensor
    """The parameters of every bucket, or (ZeRO-3) this rank's 1/dp of each."""
    grads: torch.Tensor
    """fp32; every bucket in full, or (ZeRO-2) this rank's 1/dp of each, in bucket order."""
    buckets: list[Bucket] = field(default_factory=list)
    final: bool = False
    """True during the chunk's last backward of the step."""


def split_into_buckets(
    params: list[tuple[str, nn.Parameter]],
    bucket_elems: int,
    separate: Callable[[str], bool],
    unit: Callable[[str], str] = lambda name: "",
) -> list[list[nn.Parameter]]:
    """Consecutive parameters of about bucket_elems elements; `separate` ones (by name) alone;
    a bucket holds parameters of one `unit` only."""
    groups: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size, last = 0, None
    for name, p in params:
        if separate(name):
            groups.append([p])
            continue
        if current and unit(name) != last:
            groups.append(current)
            current, size = [], 0
        last = unit(name)
        current.append(p)
        size += p.numel()
        if size >= bucket_elems:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def allocate_chunk(
    groups: list[list[nn.Parameter]],
    named: list[tuple[str, nn.Parameter]],
    *,
    dp: Group,
    align: int,
    is_tied: Callable[[str], bool],
    is_sequence_parallel: Callable[[str], bool],
    shard_grads: bool,
    shard_params: bool,
) -> ChunkBuffer:
    """One chunk's buffers for its bucket `groups` (of `named`, its trainable parameters):
    each bucket padded to a multiple of `align`; the parameters' data moved into views of
    the buffer (ZeRO-3: of the bucket's `whole`, kept as this rank's shard) and, unless
    `shard_grads`, their `main_grad` made views of the gradient buffer."""
    tied = {p for n, p in named if is_tied(n)}
    sequence_parallel = {p for n, p in named if is_sequence_parallel(n)}
    ranges, offset = [], 0
    for params in groups:
        size = sum(p.numel() for p in params)
        padded = -(-size // align) * align
        ranges.append((offset, offset + padded, params))
        offset += padded
    device, dtype = named[0][1].device, named[0][1].dtype
    kept = offset // align if shard_grads else offset
    buf = ChunkBuffer(
        params=torch.zeros(offset // align if shard_params else offset, dtype=dtype, device=device),
        grads=torch.zeros(kept, dtype=torch.float32, device=device),
    )
    for start, end, params in ranges:
        bucket = Bucket(
            start,
            end,
            params,
            deferred=bool(tied & set(params)),
            sequence_parallel=[p for p in params if p in sequence_parallel],
        )
        buf.buckets.append(bucket)
        whole, base = buf.params, 0
        if shard_params:  # the bucket's own full parameters, freed when unused
            whole, base = torch.zeros(end - start, dtype=dtype, device=device), start
        at = start
        for p in params:
            n = p.numel()
            whole[at - base : at - base + n].copy_(p.data.view(-1))
            p.data = whole[at - base : at - base + n].view_as(p)
            if not shard_grads:  # else a view of the bucket's `full`, when it exists
                p.main_grad = buf.grads[at : at + n].view_as(p)
            at += n
        if shard_params:
            _keep_shard(buf, bucket, whole, dp)
    return buf


def _keep_shard(buf: ChunkBuffer, bucket: Bucket, whole: torch.Tensor, dp: Group) -> None:
    """ZeRO-3: keep this rank's 1/dp of `whole` (views of the bucket's parameters)."""
    part = bucket.size // dp.size
    at = bucket.start // dp.size
    bucket.shard = buf.params[at : at + part]
    bucket.shard.copy_(whole[dp.rank * part : (dp.rank + 1) * part])
    bucket.whole = whole
    whole.untyped_storage().resize_(0)


def cast_chunk(buf: ChunkBuffer, dtype: torch.dtype, *, dp: Group, shard_params: bool) -> None:
    """Store one chunk's parameters in `dtype` (16-bit training); its gradients stay fp32."""
    if buf.params.dtype == dtype:
        return
    buf.params = buf.params.to(dtype)
    for bucket in buf.buckets:
        whole, at = buf.params, bucket.start
        if shard_params:  # views are made while the storage is there
            whole, at = torch.empty(bucket.size, dtype=dtype, device=whole.device), 0
        for p in bucket.params:
            n = p.numel()
            p.data = whole[at : at + n].view(p.shape)
            at += n
        if shard_params:
            part = bucket.size // dp.size
            at = bucket.start // dp.size
            bucket.shard, bucket.whole = buf.params[at : at + part], whole
            whole.untyped_storage().resize_(0)
