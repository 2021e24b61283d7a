"""A rank's model and optimizer state as `torch.distributed.checkpoint` (DCP) entries,
and the plan that loads a checkpoint of any layout back into them (resharding).

A save writes what each rank's optimizer owns where it lives: the flat range of every
parameter's tensor-local elements (all of it, or 1/dp of a bucket under ZeRO) as the boxes
of the global tensor it consists of (`Boxes`, ptdp/checkpoint/boxes.py), nothing gathered
over dp or tp. The global tensor is the unpadded single-process one: a tensor-parallel
shard sits at its `torch.chunk` offset (padding a dimension to a multiple of tp makes the
unpadded shards exactly torch.chunk's, empty last shards included). DCP writes each
distinct box once (replicas' identical boxes deduplicated), and on load it reads, for
the current layout, whatever stored boxes overlap each rank's tensors, described as
DTensors over the ("dp", "tp") sub-mesh of its pipeline stage, so a checkpoint saved in one
layout or ZeRO level restores in any other (tests/dist/test_zero.py compares the moments
tensor by tensor).
An expert-split tensor is read by slice instead: one box of this rank's experts (dim 0),
so no rank reads the experts it does not keep.

Keys are layout-free (ptdp/checkpoint/keys.py). The last pipeline stage's copy of a tied
embedding is not saved; it loads from `embedding.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ptdp.checkpoint.boxes import Box, Boxes, TensorPlace, placed_boxes
from ptdp.checkpoint.keys import (
    MODEL,
    MOMENTS,
    STATE_KEYS,
    named_buffers,
    named_parameters,
    parts_dim,
    parts_key,
)
from ptdp.errors import CheckpointError
from ptdp.parallel.comm import has_process_group
from ptdp.parallel.init import (
    ExpertSplit,
    ShardSpec,
    expert_split,
    global_shape,
    local_part,
    shard_spec,
    split_rank,
)
from ptdp.parallel.mesh import ParallelMesh
from ptdp.parallel.roles import rank_roles


def stage_mesh(mesh: ParallelMesh, device: torch.device) -> DeviceMesh | None:
    """The ("dp", "tp") device mesh of this rank's pipeline stage; None in one process.

    Collective: every rank must call it. The torch mesh has ptdp's rank layout
    (rank = tp + t*(cp + c*(dp + d*pp)) is arange(world).reshape(pp, dp*cp, tp)): its "dp"
    dimension spans the data- and context-parallel replicas, which hold the same tensors.
    """
    s = mesh.shape
    if s.world_size == 1 or not has_process_group():
        return None
    shape = (s.pp, s.dp * s.cp, s.tp)
    full = init_device_mesh(device.type, shape, mesh_dim_names=("pp", "dp", "tp"))
    return full["dp", "tp"]


def _sharded(spec: ShardSpec | None, sub: DeviceMesh | None) -> bool:
    return sub is not None and spec is not None and spec.size > 1


def _global(local: torch.Tensor, spec: ShardSpec, parts: bool) -> tuple[list[int], int]:
    """Global shape and sharded dim of the DCP tensor for a tensor-local `local`."""
    shape = list(spec.full_shape(local.shape))
    if parts:
        shape[spec.dim : spec.dim + 1] = [spec.parts, spec.full_size // spec.parts]
        return shape, spec.dim + 1
    return shape, spec.dim


def _dtensor(local: torch.Tensor, spec: ShardSpec, sub: DeviceMesh, tp_rank: int) -> DTensor:
    """A tensor-local (padded) shard as a DTensor of the unpadded global tensor; a view
    of `local`, so loading into it fills `local`."""
    parts = spec.parts > 1
    shape, dim = _global(local, spec, parts)
    if parts:
        view = local.unflatten(spec.dim, (spec.parts, -1))
    else:
        view = local.narrow(spec.dim, 0, spec.rows(tp_rank))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        view,
        sub,
        [Replicate(), Shard(dim)],
        run_check=False,
        shape=torch.Size(shape),
        stride=stride,
    )


def tensor_place(p: torch.Tensor, sub: DeviceMesh | None, tp_rank: int) -> tuple[str, TensorPlace]:
    """The key suffix ("" or `@parts...`) and the place in the global tensor of this
    rank's tensor-local `p`, for the boxes a save writes: its tensor-parallel place, and
    under expert parallelism its block of experts along dim 0 (`ExpertSplit`)."""
    suffix, place = _tensor_place(p, sub, split_rank(p, tp_rank))
    split = expert_split(p)
    if split is None or split.size == 1:
        return suffix, place
    offsets, size = list(place.offsets), list(place.size)
    offsets[0], size[0] = split.first, split.num_experts
    return suffix, TensorPlace(place.shape, place.valid, tuple(offsets), tuple(size))


def _tensor_place(p: torch.Tensor, sub: DeviceMesh | None, tp_rank: int) -> tuple[str, TensorPlace]:
    spec, shape = shard_spec(p), tuple(p.shape)
    if _sharded(spec, sub) and spec.parts > 1:
        rows = shape[spec.dim] // spec.parts
        view = shape[: spec.dim] + (spec.parts, rows) + shape[spec.dim + 1 :]
        size, dim = _global(p, spec, parts=True)
        offsets = [0] * len(view)
        offsets[dim] = tp_rank * rows
        return parts_key("", spec), TensorPlace(view, view, tuple(offsets), tuple(size))
    if _sharded(spec, sub):
        valid, offsets = list(shape), [0] * len(shape)
        valid[spec.dim], offsets[spec.dim] = spec.rows(tp_rank), spec.start(tp_rank)
        return "", TensorPlace(shape, tuple(valid), tuple(offsets), spec.full_shape(p.shape))
    full = spec.full_shape(p.shape) if spec is not None else shape
    return "", TensorPlace(shape, full, (0,) * len(shape), full)


@dataclass
class Slice:
    """The flat range of a parameter's tensor-local elements this rank's optimizer owns,
    from `lo`: its fp32 master and AdamW moments (none before the first step)."""

    lo: int
    master: torch.Tensor
    moments: dict[str, torch.Tensor]


def sharded_state(
    chunks: list[nn.Module],
    slices: dict[nn.Parameter, Slice],
    sub: DeviceMesh | None,
    tp_rank: int,
) -> dict[str, torch.Tensor]:
    """This rank's tensors under their DCP keys: the boxes of the masters and moments its
    optimizer owns (`slices`; a parameter it owns nothing of gets no boxes), as they are
    stored, with no gather (ptdp/checkpoint/boxes.py)."""
    out, roles = {}, rank_roles(chunks)
    moments = sorted({k for s in slices.values() for k in s.moments})
    for name, p in named_parameters(chunks):
        if roles.is_tied_copy(name):
            continue
        suffix, place = tensor_place(p, sub, tp_rank)
        mine = slices.get(p)
        values = {MODEL + name: mine.master if mine else None}
        for k in moments:
            values[f"{MOMENTS}{name}/{k}"] = mine.moments[k] if mine else None
        for key, v in values.items():
            boxes = placed_boxes(place, v.detach().reshape(-1), mine.lo) if v is not None else []
            out[key + suffix] = Boxes(place.size, boxes)
    return out


@dataclass
class _Target:
    """Where one loaded DCP tensor goes: `buffer` (a DTensor's local or a full tensor)
    becomes the tensor-local value of `p` through `finish`."""

    key: str
    value: torch.Tensor
    p: torch.Tensor
    local: torch.Tensor | None  # the padded tensor-local tensor a DTensor fills
    experts: torch.Tensor | None = None  # this rank's experts only, read by slice

    def result(self, tp_rank: int) -> torch.Tensor:
        if self.local is not None:
            return self.local
        full, dim = self.value if self.experts is None else self.experts, parts_dim(self.key)
        if dim is not None:
            full = full.flatten(dim, dim + 1)
        if self.experts is not None:  # its experts already: only the tensor split is left
            spec = shard_spec(self.p)
            return spec.shard(full, split_rank(self.p, tp_rank)) if spec is not None else full
        return local_part(full, self.p, tp_rank)  # pads; takes this rank's experts


def _stored(metadata, key: str) -> str | None:
    if key in metadata:
        return key
    found = [k for k in metadata if k.startswith(key + "@parts")]
    return found[0] if found else None


def _target(key: str, stored: str, shape, p: torch.Tensor, sub, tp_rank: int, name: str):
    spec, full_shape = shard_spec(p), global_shape(p)
    flat_shape, dim = list(shape), parts_dim(stored)
    if dim is not None:
        flat_shape[dim : dim + 2] = [flat_shape[dim] * flat_shape[dim + 1]]
    if tuple(flat_shape) != full_shape:
        raise CheckpointError(
            f"checkpoint tensor {stored} has shape {tuple(shape)}, which does not fit this "
            f"model's {full_shape} ({name}); is it the same model?"
        )
    parts_stored = dim is not None
    split = expert_split(p)
    if split is not None and split.size > 1:
        return _expert_target(stored, tuple(shape), p, split)
    if _sharded(spec, sub) and parts_stored == (spec.parts > 1) and split is None:
        local = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return _Target(stored, _dtensor(local, spec, sub, tp_rank), p, local)
    value = torch.empty(tuple(shape), dtype=torch.float32, device=p.device)
    return _Target(stored, value, p, None)


def _expert_target(
    stored: str, shape: tuple[int, ...], p: torch.Tensor, split: ExpertSplit
) -> _Target:
    """An expert-split tensor is read by slice: only this rank's experts (rows
    [first, first + local) of dim 0), whole along the other dims, described to DCP as one
    box of the global tensor (`Boxes`), so no rank reads the experts it does not keep
    (DESIGN invariant 5). The ("dp", "tp") mesh of a DTensor read cannot say which
    experts a rank holds; `_Target.result` then takes the expert tensor-parallel slice."""
    rows = (split.local, *shape[1:])
    value = torch.empty(rows, dtype=torch.float32, device=p.device)
    offsets = (split.first,) + (0,) * (len(shape) - 1)
    box = Boxes(shape, [(Box(offsets, rows, 0), value)])
    return _Target(stored, box, p, None, experts=value)


def load_plan(
    chunks: list[nn.Module],
    metadata: dict,
    sub: DeviceMesh | None,
    tp_rank: int,
) -> tuple[dict[str, torch.Tensor], dict]:
    """The DCP state dict to load this rank's tensors into (current layout), and how to
    turn it back into (masters, moments) by parameter: call `unpack` after dcp.load."""
    targets: dict[str, _Target] = {}
    wanted: list[tuple[nn.Parameter, str, str]] = []  # (param, moment or "", stored key)
    missing, roles = [], rank_roles(chunks)
    for name, p in named_parameters(chunks):
        saved = roles.original(name)
        keys = [("", MODEL + saved)] + [(k, f"{MOMENTS}{saved}/{k}") for k in STATE_KEYS]
        for moment, key in keys:
            stored = _stored(metadata, key)
            if stored is None:
                if not moment:
                    missing.append(saved)
                continue
            if stored not in targets:
                md = metadata[stored]
                if not isinstance(md, TensorStorageMetadata):
                    raise CheckpointError(f"checkpoint entry {stored} is not a tensor")
                targets[stored] = _target(key, stored, md.size, p, sub, tp_rank, name)
            wanted.append((p, moment, stored))
    if missing:
        raise CheckpointError(f"checkpoint lacks tensors this model needs: {missing[:5]}")
    state = {k: t.value for k, t in targets.items()}
    return state, {"targets": targets, "wanted": wanted}


def unpack(plan: dict, tp_rank: int) -> tuple[dict, dict]:
    """(masters, moments) by parameter, tensor-local, from a loaded `load_plan`."""
    results = {k: t.result(tp_rank) for k, t in plan["targets"].items()}
    masters, moments = {}, {}
    for p, moment, stored in plan["wanted"]:
        value = results[stored]
        if value.shape != p.shape:
            raise CheckpointError(
                f"checkpoint tensor {stored} gives a shard of shape {tuple(value.shape)}, "
                f"which does not fit this model's {tuple(p.shape)} (per rank)"
            )
        if moment:
            moments.setdefault(p, {})[moment] = value
        else:
            masters[p] = value
    moments = {p: m for p, m in moments.items() if len(m) == len(STATE_KEYS)}
    return masters, moments


def buffer_entries(chunks: list[nn.Module], metadata: dict) -> dict[str, torch.Tensor]:
    """The DCP entries to load this rank's persistent buffers into (`copy_buffers` after
    loading); a checkpoint without one of them is refused."""
    entries, missing = {}, []
    for name, _ in named_buffers(chunks):
        md = metadata.get(MODEL + name)
        if md is None:
            missing.append(name)
        else:
            entries[MODEL + name] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    if missing:
        raise CheckpointError(f"checkpoint lacks tensors this model needs: {missing[:5]}")
    return entries


@torch.no_grad()
def copy_buffers(chunks: list[nn.Module], entries: dict[str, torch.Tensor]) -> None:
    """Fill this rank's persistent buffers from loaded entries (`buffer_entries`)."""
    for name, b in named_buffers(chunks):
        value = entries[MODEL + name]
        if value.shape != b.shape:
            raise CheckpointError(
                f"checkpoint tensor {MODEL + name} has shape {tuple(value.shape)}, which does "
                f"not fit this model's {tuple(b.shape)}; is it the same model?"
            )
        b.copy_(value)
