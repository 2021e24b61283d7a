"""ZeRO-3's fp8 all-gather (parallel.zero3_fp8_all_gather): the float8 weights of the linear
layers are gathered as float8 bytes with their scales, half the bytes of their 16-bit
values, and the GEMMs use them as gathered (torchao's FSDP2 float8 all-gather does the same
for FSDP2; this is the same idea on `ParamGather`'s buckets).

Tensorwise scaling only: a weight's scale is max |w| over the whole (tensor-parallel local)
weight, so one cast serves its forward and its input-gradient GEMM. `GradBuffers` gives
these weights buckets of their own. Once per step, at the first gather of such a bucket
(weights change only between steps), `prepare` takes each weight's amax over this rank's
shard, all-reduces the maxima over dp as one vector, turns them into scales with torchao's
`amax_to_scale` (bitwise the unsharded cast's scale: a maximum is exact) and casts each
rank's shard, element by element with its weight's scale, into `Bucket.shard8` (held until
the end of the step, 1 byte an element of the shard). The bucket's
gather then fills `Bucket.whole8` from the shards' bytes, and each weight's `fp8_weight`
attribute (a float8 tensor viewing `whole8`, read by `ptdp.parallel.wgrad._Fp8Linear`)
is what its GEMMs take. The bucket's 16-bit `whole` is never allocated; its parameters keep
their shapes for autograd and receive their gradients as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ptdp.parallel.buckets import Bucket
from ptdp.parallel.comm import Group, all_reduce_max_value
from ptdp.parallel.tensor import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:  # torchao is optional: only an fp8 run imports ptdp.parallel.fp8
    from ptdp.parallel.fp8 import Fp8Gemms


def fp8_weights(chunks: list[nn.Module]) -> set[nn.Parameter]:
    """The weights whose GEMMs run in float8 in the transformer layers: those of the
    tensor-parallel linear layers given an `Fp8Gemms` (the output layer's is left 16-bit)."""
    found = set()
    for chunk in chunks:
        layers = getattr(chunk, "layers", None)
        for m in layers.modules() if isinstance(layers, nn.Module) else ():
            if isinstance(m, ColumnParallelLinear | RowParallelLinear) and m.fp8 is not None:
                found.add(m.weight)
    return found


class Fp8Gather:
    """The float8 shards of a rank's fp8 buckets, cast once per step (module doc)."""

    def __init__(self, buckets: list[Bucket], fp8: Fp8Gemms, dp: Group) -> None:
        self.buckets, self.fp8, self.dp = buckets, fp8, dp
        self.ready = False
        """This step's shards are cast; cleared by `invalidate` (end of step)."""
        self._segments = []
        """(bucket, parameter, its float8 view of `whole8`, the [a, b) of this rank's shard
        that holds its elements, or None) for every parameter of the buckets."""
        dtype = fp8.weight_dtype
        for b in buckets:
            device = b.params[0].device
            part = b.size // dp.size
            b.whole8 = torch.zeros(b.size, dtype=dtype, device=device)
            b.shard8 = torch.zeros(part, dtype=dtype, device=device)
            lo, hi, at = dp.rank * part, (dp.rank + 1) * part, 0
            for p in b.params:
                n = p.numel()
                view = b.whole8[at : at + n].view(p.shape)  # made while the storage is there
                first, last = max(at, lo), min(at + n, hi)
                own = (first - lo, last - lo) if first < last else None
                self._segments.append((b, p, view, own))
                at += n
            b.whole8.untyped_storage().resize_(0)
            b.shard8.untyped_storage().resize_(0)

    def invalidate(self) -> None:
        """The weights may change (optimizer step, checkpoint load): cast again when next
        gathered. The float8 shards are freed until then."""
        self.ready = False
        for b in self.buckets:
            b.shard8.untyped_storage().resize_(0)

    @torch.no_grad()
    def prepare(self, count: Callable[..., None]) -> None:
        """Scales and float8 shards of every fp8 weight for this step: one all-reduce."""
        if self.ready:
            return
        parts = []
        for b, _, _, own in self._segments:
            part = b.shard[own[0] : own[1]] if own is not None else None
            parts.append(part)
        device = self.buckets[0].shard.device
        zero = torch.zeros((), dtype=torch.float32, device=device)
        amax = torch.stack([zero if t is None else t.abs().max().float() for t in parts])
        amax = all_reduce_max_value(amax, self.dp)
        count("all_reduce", amax, 2)
        scales = self.fp8.weight_scales(amax)
        for b in self.buckets:  # padding stays float8 zeros
            b.shard8.untyped_storage().resize_(b.shard8.numel())
            b.shard8.view(torch.uint8).zero_()
        for i, ((b, p, view, own), part) in enumerate(zip(self._segments, parts)):
            if part is not None:
                b.shard8[own[0] : own[1]] = self.fp8.cast_weight(part, scales[i])
            p.fp8_weight = self.fp8.gathered_weight(view, scales[i], p.dtype)
        self.ready = True
