"""A rank's flat slices of parameters as boxes of the global tensors, so that a sharded
optimizer's state is written where it lives, with no gather.

The optimizer owns, per parameter, a contiguous range [lo, hi) of the tensor-local
tensor's flattened elements: all of it without ZeRO, and with it 1/dp of a gradient
bucket, which cuts parameters anywhere. A checkpoint describes a tensor by boxes (offsets
and sizes in the global tensor), so a range is cut into the few boxes a row-major range
is made of (a partial row, whole rows, a partial row, dimension by dimension), each
contiguous in the range, clipped to the unpadded tensor-parallel shard and moved to that
shard's offset. `Boxes` hands them to DCP (torch.distributed.checkpoint) through its
checkpointable protocol: every box is one chunk, written by the rank that owns it, and
identical boxes of replicas (every dp rank at zero 0, replicated weights over tp) are
written once, by DCP's deduplication. Loading is unchanged: DCP reads whatever stored
boxes overlap what a rank asks for, so any layout and ZeRO level restores any other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


@dataclass(frozen=True)
class Box:
    """`sizes` elements at `offsets`; contiguous in row-major order, from flat index `start`."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """The boxes, in order, whose elements are exactly the flat range [lo, hi) of a
    row-major tensor of `shape`: at most 2·len(shape) - 1 of them."""
    if lo >= hi:
        return []
    if not shape:
        return [Box((), (), lo)]
    row = math.prod(shape[1:])
    rest = tuple(shape[1:])
    first, last = -(-lo // row), hi // row  # the whole rows [first, last)
    if first > last:  # inside one row
        r = lo // row
        return [_shift(b, r, r * row) for b in flat_boxes(rest, lo - r * row, hi - r * row)]
    out = []
    if lo < first * row:  # the tail of row first - 1
        r = first - 1
        out += [_shift(b, r, r * row) for b in flat_boxes(rest, lo - r * row, row)]
    if last > first:
        out.append(Box((first,) + (0,) * len(rest), (last - first,) + rest, first * row))
    if hi > last * row:  # the head of row `last`
        out += [_shift(b, last, last * row) for b in flat_boxes(rest, 0, hi - last * row)]
    return out


def _shift(box: Box, row: int, at: int) -> Box:
    return Box((row,) + box.offsets, (1,) + box.sizes, at + box.start)


@dataclass(frozen=True)
class TensorPlace:
    """Where a rank's tensor-local tensor sits in the global (checkpoint) tensor: viewed
    as `shape` (a `@parts` tensor unflattened), its first `valid` elements per dimension
    (the rest is padding) start at `offsets` of a global tensor of `size`."""

    shape: tuple[int, ...]
    valid: tuple[int, ...]
    offsets: tuple[int, ...]
    size: tuple[int, ...]


def placed_boxes(
    place: TensorPlace, values: torch.Tensor, lo: int
) -> list[tuple[Box, torch.Tensor]]:
    """(global box, its values as a view of `values`, fp32) for the flat slice `values` of
    the tensor-local elements starting at `lo`, padding left out. A view: a synchronous
    save writes the live tensors (DCP's writer copies a view of a larger storage, one box
    at a time, rather than write the whole storage) and an asynchronous one copies each
    box once (`Boxes.snapshot`)."""
    out = []
    for box in flat_boxes(place.shape, lo, lo + values.numel()):
        data = values[box.start - lo : box.start - lo + math.prod(box.sizes)].view(box.sizes)
        sizes = []
        for dim, (at, n) in enumerate(zip(box.offsets, box.sizes)):
            n = min(at + n, place.valid[dim]) - at
            sizes.append(n)
            if n < box.sizes[dim]:
                data = data.narrow(dim, 0, max(n, 0))
        if min(sizes, default=1) <= 0:
            continue
        offsets = tuple(a + o for a, o in zip(box.offsets, place.offsets))
        out.append((Box(offsets, tuple(sizes), 0), data.to(torch.float32)))
    return out


class Boxes(torch.Tensor):
    """Boxes of one global fp32 tensor held by this rank, as DCP's checkpointable protocol
    asks (`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`).
    A tensor only in name: it has no data of its own and supports no operation."""

    @staticmethod
    def __new__(cls, size: tuple[int, ...], boxes: list[tuple[Box, torch.Tensor]]):
        device = boxes[0][1].device if boxes else torch.device("cpu")
        self = torch.Tensor._make_wrapper_subclass(cls, size, dtype=torch.float32, device=device)
        self.boxes = boxes
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"Boxes hold checkpoint chunks only; {func} is not defined on them")

    def __repr__(self) -> str:  # the default would run operations on it
        return f"Boxes(size={tuple(self.shape)}, boxes={len(self.boxes)})"

    def __create_write_items__(self, fqn: str, _object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, box.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.sizes)),
                    properties=TensorProperties(dtype=torch.float32),
                    size=self.shape,
                ),
            )
            for box, _ in self.boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.sizes))
            for box, _ in self.boxes
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for box, data in self.boxes:
            if tuple(box.offsets) == tuple(index.offset):
                return data
        raise ValueError(f"no box at {tuple(index.offset)} of {index.fqn}")

    def snapshot(self, *, pinned: bool = False) -> Boxes:
        """The same boxes copied once into host memory of their own (`pinned`: page-locked,
        copied asynchronously from a GPU): the snapshot an asynchronous save writes."""
        return Boxes(tuple(self.shape), [(b, host_copy(d, pinned=pinned)) for b, d in self.boxes])


def host_copy(t: torch.Tensor, *, pinned: bool = False) -> torch.Tensor:
    """A compact host copy of `t` (a view too: only its elements); `pinned` copies from a
    GPU into page-locked memory without waiting (record an event to know when it is done)."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
    return out.copy_(t, non_blocking=pinned)
