"""ZeRO-3's fp8 all-gather (parallel.zero3_fp8_all_gather): the float8 weights of the linear
layers are gathered as float8 bytes with their scales, half the bytes of their 16-bit
values, and the GEMMs use them as gathered (torchao's FSDP2 float8 all-gather does the same
for FSDP2; this is the same idea on `ParamGather`'s buckets).

Tensorwise scaling only: a weight's scale is max |w| over the whole (tensor-parallel local)
weight, so one cast serves its forward and its input-gradient GEMM. `GradBuffers` gives
these weights buckets of their own. Once per step, at the first gather of such a bucket
(weights change only between steps), `prepare` takes each weight's amax over this rank's
shard, all-reduces the maxima over dp as one vector and turns them into scales with
torchao's `amax_to_scale` (bitwise the unsharded cast's scale: a maximum is exact). Each
gather of a bucket casts this rank's shard, element by element with its weight's scale,
into `Bucket.shard8` (as torchao's FSDP2 path casts at each all-gather: no float8 copy of
the shards is kept between gathers) and fills `Bucket.whole8` from the shards' bytes; each
weight's `fp8_weight` attribute (a float8 tensor viewing `whole8`, set at `prepare`, read
by `ptdp.parallel.wgrad._Fp8Linear`) is what its GEMMs take. The bucket's 16-bit `whole` is
never allocated; its parameters keep their shapes for autograd and receive their gradients
as before.
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
    """The scales of a rank's fp8 buckets' weights (once per step) and their float8 shards
    (cast at each gather, freed once it is done; module doc)."""

    def __init__(self, buckets: list[Bucket], fp8: Fp8Gemms, dp: Group) -> None:
        self.buckets, self.fp8, self.dp = buckets, fp8, dp
        self.scales: torch.Tensor | None = None
        """This step's scale of each weight (`_segments` order); None: not taken yet."""
        self._segments: dict[int, list[tuple[int, nn.Parameter, tuple[int, int] | None]]] = {}
        """By bucket (its id): (index, parameter, the [a, b) of this rank's shard holding
        its elements or None) for each parameter of the bucket."""
        self._views: list[torch.Tensor] = []
        """Each weight's float8 view of its bucket's `whole8`."""
        dtype = fp8.weight_dtype
        for b in buckets:
            part = b.size // dp.size
            b.whole8 = torch.zeros(b.size, dtype=dtype, device=b.params[0].device)
            lo, hi, at = dp.rank * part, (dp.rank + 1) * part, 0
            segments = self._segments.setdefault(id(b), [])
            for p in b.params:
                n = p.numel()
                first, last = max(at, lo), min(at + n, hi)
                segments.append(
                    (len(self._views), p, (first - lo, last - lo) if first < last else None)
                )
                self._views.append(b.whole8[at : at + n].view(p.shape))  # while it has storage
                at += n
            b.whole8.untyped_storage().resize_(0)

    def invalidate(self) -> None:
        """The weights may change (optimizer step, checkpoint load): scale again when next
        gathered."""
        self.scales = None

    @torch.no_grad()
    def prepare(self, count: Callable[..., None]) -> None:
        """Every fp8 weight's scale for this step, from its amax: one all-reduce (max)."""
        if self.scales is not None:
            return
        device = self.buckets[0].shard.device
        amax = torch.zeros(len(self._views), dtype=torch.float32, device=device)
        for b in self.buckets:
            for i, _, own in self._segments[id(b)]:
                if own is not None:
                    amax[i] = b.shard[own[0] : own[1]].abs().max().float()
        amax = all_reduce_max_value(amax, self.dp)
        count("all_reduce", amax, 2)
        self.scales = self.fp8.weight_scales(amax)
        for segments in self._segments.values():
            for i, p, _ in segments:
                p.fp8_weight = self.fp8.gathered_weight(self._views[i], self.scales[i], p.dtype)

    @torch.no_grad()
    def cast(self, b: Bucket) -> torch.Tensor:
        """This rank's shard of bucket `b` in float8, each element with its weight's scale
        (padding: zeros), for one gather (`prepare` first)."""
        out = torch.zeros(b.shard.numel(), dtype=torch.uint8, device=b.shard.device)
        out = out.view(self.fp8.weight_dtype)
        for i, _, own in self._segments[id(b)]:
            if own is not None:
                out[own[0] : own[1]] = self.fp8.cast_weight(
                    b.shard[own[0] : own[1]], self.scales[i]
                )
        return out
