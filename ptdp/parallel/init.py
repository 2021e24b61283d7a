"""How a parameter is split over the tensor-parallel group (and a mixture-of-experts
layer's experts over the expert-parallel group), and per-rank random streams.

A sharded parameter carries a `ShardSpec` (attribute `tp_shard`). Its master value is
the single-process tensor (seeded by name, see model/init.py); each rank keeps its slice.
The same spec gathers shards back to the full tensor for checkpoints, gradient norms and
equivalence tests, so tp = 1 and tp = t hold the same model. An expert weight also carries
an `ExpertSplit` (attribute `ep_split`): its dim 0 (experts) holds this rank's block of
consecutive experts, a split independent of the tensor one (a later dim).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ptdp.parallel.comm import Group, gather_full


@dataclass(frozen=True)
class ShardSpec:
    """Split `dim` of the full tensor over `size` ranks.

    `parts` > 1: the dim is that many equal blocks, each split on its own (SwiGLU's
    [gate; up] rows), so each rank holds matching rows of every block.
    `full_size`: the true length of `dim`. `padded_size` > full_size (the vocabulary,
    see model.make_vocab_size_divisible_by): rank r holds its torch.chunk slice of the
    full tensor (`rows(r)` rows from `start(r)`, as DTensor's Shard splits it, so
    checkpoints reshard) followed by zero rows up to padded_size / size. Padded rows
    never reach the loss.
    """

    dim: int
    full_size: int
    padded_size: int
    size: int
    parts: int = 1

    def __post_init__(self) -> None:
        if self.padded_size != self.full_size and self.parts != 1:
            raise ValueError("a padded split must be a single block")

    @property
    def local_size(self) -> int:
        return self.padded_size // self.size

    def start(self, rank: int) -> int:
        """Index along `dim` of the first row `rank` holds."""
        return min(rank * -(-self.full_size // self.size), self.full_size)

    def rows(self, rank: int) -> int:
        """Rows of the full tensor `rank` holds (the rest of its slice is padding)."""
        return min(-(-self.full_size // self.size), self.full_size - self.start(rank))

    def full_shape(self, local_shape: torch.Size) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full_size
        return tuple(shape)

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's slice of the full tensor."""
        if self.padded_size != self.full_size:
            piece = full.narrow(self.dim, self.start(rank), self.rows(rank))
            pad = self.local_size - piece.shape[self.dim]
            return nn.functional.pad(piece, [0, 0] * (full.dim() - 1 - self.dim) + [0, pad])
        blocks = full.unflatten(self.dim, (self.parts, -1))
        chunk = blocks.shape[self.dim + 1] // self.size
        return blocks.narrow(self.dim + 1, rank * chunk, chunk).flatten(self.dim, self.dim + 1)

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's slice, in rank order."""
        if self.padded_size != self.full_size:
            pieces = [s.narrow(self.dim, 0, self.rows(r)) for r, s in enumerate(shards)]
            return torch.cat(pieces, dim=self.dim)
        blocks = [s.unflatten(self.dim, (self.parts, -1)) for s in shards]
        return torch.cat(blocks, dim=self.dim + 1).flatten(self.dim, self.dim + 1)


@dataclass(frozen=True)
class ExpertSplit:
    """Dim 0 of a tensor of `num_experts` experts split over `size` expert-parallel ranks:
    rank `rank` holds experts [rank * local, (rank + 1) * local). Every routed expert's
    tensor carries one (size 1 too): its tensor split (`ShardSpec`, over the expert
    tensor-parallel group) is taken at `etp_rank`, not at the rank's tensor-parallel one."""

    num_experts: int
    size: int
    rank: int
    etp_rank: int = 0

    @property
    def local(self) -> int:
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        return self.rank * self.local

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (self.num_experts, *local_shape[1:])

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a tensor of all of them."""
        return full.narrow(0, self.first, self.local)


def expert_split(param: torch.Tensor) -> ExpertSplit | None:
    return getattr(param, "ep_split", None)


def global_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The single-process shape of a (possibly tensor- and expert-split) parameter."""
    spec, split = shard_spec(param), expert_split(param)
    shape = tuple(spec.full_shape(param.shape)) if spec else tuple(param.shape)
    return split.full_shape(shape) if split else shape


def split_rank(param: torch.Tensor, tp_rank: int) -> int:
    """The rank along `param`'s tensor split: an expert's in its expert tensor group."""
    split = expert_split(param)
    return split.etp_rank if split is not None else tp_rank


def local_part(full: torch.Tensor, param: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """This rank's part of the single-process tensor `full` of `param` (tensor, expert)."""
    spec, split = shard_spec(param), expert_split(param)
    if spec is not None:
        full = spec.shard(full, split_rank(param, tp_rank))  # pads, at any tp
    return split.take(full) if split is not None else full


def read_local(
    read: Callable[[tuple[slice, ...]], torch.Tensor], param: torch.Tensor, tp_rank: int
) -> torch.Tensor:
    """`local_part` of a tensor never held whole: `read(region)` gives that region of the
    single-process tensor (ptdp/checkpoint/lazy.py), and only this rank's regions are
    asked for: its experts, and its rows of each block of the tensor split (one region per
    SwiGLU block), padded as `ShardSpec.shard` pads."""
    spec, split = shard_spec(param), expert_split(param)
    region = [slice(0, n) for n in global_shape(param)]
    if split is not None:
        region[0] = slice(split.first, split.first + split.local)
    if spec is None:
        return read(tuple(region))
    rank = split_rank(param, tp_rank)
    if spec.padded_size != spec.full_size:
        region[spec.dim] = slice(spec.start(rank), spec.start(rank) + spec.rows(rank))
        piece = read(tuple(region))
        pad = spec.local_size - piece.shape[spec.dim]
        return nn.functional.pad(piece, [0, 0] * (piece.dim() - 1 - spec.dim) + [0, pad])
    block = spec.full_size // spec.parts
    chunk = block // spec.size
    pieces = []
    for b in range(spec.parts):
        lo = b * block + rank * chunk
        region[spec.dim] = slice(lo, lo + chunk)
        pieces.append(read(tuple(region)))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=spec.dim)


def padded(n: int, size: int) -> int:
    """n rounded up to a multiple of size."""
    return -(-n // size) * size


def full_tensor(
    param: torch.Tensor,
    spec: ShardSpec | None,
    tp: Group,
    ep: Group | None = None,
    split: ExpertSplit | None = None,
    etp: Group | None = None,
) -> torch.Tensor:
    """Gather a (possibly sharded) tensor back to its full single-process shape; `ep`: the
    expert-parallel group, to gather the experts of an expert-split one (`split`, by default
    the tensor's own `ep_split`: pass the parameter's for its gradient), whose tensor split
    is gathered over `etp` (the expert tensor-parallel group) instead of `tp`."""
    out = param.detach()
    split = split or expert_split(param)
    if split is not None and spec is not None:
        if etp is None and spec.size > 1 and spec.size != tp.size:
            raise ValueError("an expert's tensor split needs its expert tensor group to gather")
        tp = etp if etp is not None else tp
    if spec is not None and tp.size == 1:
        out = spec.unshard([out])  # drops padded rows, if any
    elif spec is not None:
        gathered = gather_full(out, tp, spec.dim)
        out = spec.unshard(list(gathered.chunk(tp.size, dim=spec.dim)))
    if split is not None and split.size > 1:
        if ep is None or ep.size != split.size:
            raise ValueError("an expert-split tensor needs its expert-parallel group to gather")
        out = gather_full(out.contiguous(), ep, 0)
    return out


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    return getattr(param, "tp_shard", None)


@contextlib.contextmanager
def rank_rng(tp: Group, device: torch.device) -> Iterator[None]:
    """Run a block on a random stream of this tensor-parallel rank's own.

    The replicated regions use torch's global stream, which all ranks of a tensor group
    keep in step. A split region (attention heads, a sequence slice) needs different
    random numbers on each rank: draw one seed from the shared stream (advancing it alike
    everywhere), then run the block on seed + rank and restore the shared stream. Because
    the seed comes from the shared stream, activation recomputation replays the same masks.
    """
    if tp.size == 1:
        yield
        return
    seed = int(torch.randint(0, 2**62, (1,)).item())
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + tp.rank)
        yield
