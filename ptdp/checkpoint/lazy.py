"""Tensors known by their shape and read by region, so a rank reads only what it keeps.

A model far larger than one host's memory is loaded by every rank reading, tensor by
tensor, just its own slice: its pipeline stages' layers, its tensor-parallel rows or
columns, its experts. The source tensors (a Hugging Face safetensors file, memory-mapped)
are not those of ptdp's model: a fused QKV weight is cut from three tensors group by
group, SwiGLU's fc1 is [gate; up], the experts' fc1 a stack of every expert's pair. So a
ptdp tensor is described as an expression over the stored ones (`Joined`, `Stacked`,
`Narrowed`, `Transposed`), and reading a region of it reads the matching regions of the
stored tensors and nothing more (`read_local` in ptdp/parallel/init.py asks for a rank's
regions). The checkpoint writer reads a `Lazy` value when it writes its bytes
(ptdp/checkpoint/writer.py), so a conversion streams too.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Region = tuple[slice, ...]
"""One `slice(start, stop)` per dimension (step 1, bounds within the shape)."""


def whole(shape: Sequence[int]) -> Region:
    return tuple(slice(0, n) for n in shape)


def _span(s: slice) -> int:
    return s.stop - s.start


class Lazy(ABC):
    """A float32 tensor of `shape`, read by region (`read`), never held whole."""

    shape: tuple[int, ...]

    @abstractmethod
    def read(self, region: Region) -> torch.Tensor: ...

    def full(self) -> torch.Tensor:
        return self.read(whole(self.shape)).contiguous()

    @property
    def nbytes(self) -> int:
        """Its bytes in float32, as read."""
        return 4 * math.prod(self.shape)


@dataclass(frozen=True, eq=False)
class Stored(Lazy):
    """A tensor as a file holds it: `fetch(region)` reads that region (in its dtype)."""

    name: str
    shape: tuple[int, ...]
    fetch: Callable[[Region], torch.Tensor]

    def read(self, region: Region) -> torch.Tensor:
        return self.fetch(region).float()


@dataclass(frozen=True, eq=False)
class Held(Lazy):
    """A tensor already in memory (or memory-mapped, as `torch.load(mmap=True)` gives)."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return tuple(self.tensor.shape)

    def read(self, region: Region) -> torch.Tensor:
        part = self.tensor[region] if region else self.tensor
        return part.float() if part.dtype != torch.float32 else part.clone()


@dataclass(frozen=True, eq=False)
class Transposed(Lazy):
    """A 2-D tensor's transpose (GPT-2's Conv1D stores [in, out])."""

    inner: Lazy

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.inner.shape[::-1]

    def read(self, region: Region) -> torch.Tensor:
        return self.inner.read(region[::-1]).t()


@dataclass(frozen=True, eq=False)
class Narrowed(Lazy):
    """`inner.narrow(dim, start, length)`."""

    inner: Lazy
    dim: int
    start: int
    length: int

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        shape = list(self.inner.shape)
        shape[self.dim] = self.length
        return tuple(shape)

    def read(self, region: Region) -> torch.Tensor:
        s = region[self.dim]
        moved = slice(s.start + self.start, s.stop + self.start)
        return self.inner.read(region[: self.dim] + (moved,) + region[self.dim + 1 :])


@dataclass(frozen=True, eq=False)
class Joined(Lazy):
    """`torch.cat(parts, dim)`: a region reads only the parts it overlaps."""

    parts: tuple[Lazy, ...]
    dim: int = 0

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        shape = list(self.parts[0].shape)
        shape[self.dim] = sum(p.shape[self.dim] for p in self.parts)
        return tuple(shape)

    def read(self, region: Region) -> torch.Tensor:
        want, at, pieces = region[self.dim], 0, []
        for part in self.parts:
            n = part.shape[self.dim]
            lo, hi = max(want.start, at), min(want.stop, at + n)
            if lo < hi:
                inner = slice(lo - at, hi - at)
                pieces.append(part.read(region[: self.dim] + (inner,) + region[self.dim + 1 :]))
            at += n
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:  # an empty region
            return self.parts[0].read(region[: self.dim] + (slice(0, 0),) + region[self.dim + 1 :])
        return torch.cat(pieces, dim=self.dim)


@dataclass(frozen=True, eq=False)
class Stacked(Lazy):
    """`torch.stack(parts)` (one tensor per expert): a region reads only its experts."""

    parts: tuple[Lazy, ...]

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return (len(self.parts), *self.parts[0].shape)

    def read(self, region: Region) -> torch.Tensor:
        chosen = self.parts[region[0].start : region[0].stop]
        if not chosen:
            return torch.empty([0, *(_span(s) for s in region[1:])])
        return torch.stack([p.read(region[1:]) for p in chosen])


@dataclass(frozen=True, eq=False)
class Permuted(Lazy):
    """`inner.index_select(dim, index)` for a permutation `index` that moves rows only within
    blocks (DeepSeek's interleaved rotary rows within a head): a region reads the span of
    source rows its own rows come from."""

    inner: Lazy
    dim: int
    index: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.inner.shape

    def read(self, region: Region) -> torch.Tensor:
        want = self.index[region[self.dim]]
        if not want:
            return self.inner.read(region)
        lo, hi = min(want), max(want) + 1
        span = self.inner.read(region[: self.dim] + (slice(lo, hi),) + region[self.dim + 1 :])
        return span.index_select(self.dim, torch.tensor([i - lo for i in want]))


@dataclass(frozen=True, eq=False)
class BlockScaled(Lazy):
    """A float8 weight times its per-block scales (DeepSeek-V3's published checkpoints: e4m3
    values, one `weight_scale_inv` per 128 x 128 block, the last blocks partial): the
    float32 weight, read by region as any other."""

    weight: Lazy
    scale: Lazy
    block: tuple[int, int] = (128, 128)

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.weight.shape

    def read(self, region: Region) -> torch.Tensor:
        values = self.weight.read(region)
        spans = [slice(s.start // b, -(-s.stop // b)) for s, b in zip(region, self.block)]
        scale = self.scale.read(tuple(spans))
        for dim, (s, b) in enumerate(zip(region, self.block)):
            scale = scale.repeat_interleave(b, dim)
            scale = scale.narrow(dim, s.start - spans[dim].start * b, s.stop - s.start)
        return values * scale
