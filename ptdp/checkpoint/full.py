"""The full single-process view of a checkpoint: one state dict of full-shape tensors
under global names, as `ptdp generate`, convert and inspect use it.

`load_checkpoint` assembles it from the shards in one process (no process group);
`save_checkpoint` writes one as a checkpoint (convert's import). The helpers below
gather a rank's sharded model and optimizer state to full tensors and slice full
tensors back to this rank's shards (loading a model for generation, and restoring the
earlier single-file format, `state.pt`, which still loads). Training checkpoints
themselves are written shard by shard (ptdp/checkpoint/sharded.py). A pipeline rank
contributes the parameters of its chunks (their names are global); the last stage's
copy of a tied embedding is not saved (it equals `embedding.weight`) and is restored
from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ptdp.checkpoint.keys import (
    MODEL,
    MOMENTS,
    RNG,
    named_buffers,
    named_parameters,
    parts_dim,
    unview_parts,
)
from ptdp.checkpoint.lazy import Lazy
from ptdp.checkpoint.store import (
    STATE_FILE,
    damaged_advice,
    load_entries,
    read_metadata,
    verify_files,
)
from ptdp.checkpoint.writer import start_checkpoint
from ptdp.config.sections import RunConfig
from ptdp.errors import CheckpointError
from ptdp.parallel.comm import Group
from ptdp.parallel.init import (
    expert_split,
    full_tensor,
    global_shape,
    local_part,
    read_local,
    shard_spec,
)
from ptdp.parallel.roles import rank_roles


def full_model_state(
    chunks: list[nn.Module],
    tp: Group,
    weights: dict[nn.Parameter, torch.Tensor] | None = None,
    ep: Group | None = None,
    etp: Group | None = None,
) -> dict[str, torch.Tensor]:
    """Full fp32 tensors by global name: `weights` (the optimizer's fp32 master weights, by
    parameter) where given, else the parameters themselves; `ep`, `etp`: the expert-parallel
    and expert tensor-parallel groups (collective over them when experts are split)."""
    weights, roles = weights or {}, rank_roles(chunks)
    return {
        name: full_tensor(weights.get(p, p), shard_spec(p), tp, ep, expert_split(p), etp)
        .float()
        .clone()
        for name, p in named_parameters(chunks)
        if not roles.is_tied_copy(name)
    }


def _local(value: torch.Tensor | Lazy, p: torch.Tensor, tp: Group, name: str) -> torch.Tensor:
    if tuple(value.shape) != global_shape(p):
        local = value  # not this model's: refused below with both shapes
    elif isinstance(value, Lazy):
        local = read_local(value.read, p, tp.rank)  # reads this rank's regions alone
    else:
        local = local_part(value, p, tp.rank)  # pads, at any tp; this rank's experts
    if local.shape != p.shape:
        raise CheckpointError(
            f"checkpoint tensor {name} has shape {tuple(value.shape)}, which does not fit "
            f"this model's {tuple(p.shape)} (per rank); is it the same model?"
        )
    return local


def local_model_state(
    chunks: list[nn.Module], state: Mapping[str, torch.Tensor | Lazy], tp: Group
) -> dict[nn.Parameter, torch.Tensor]:
    """This rank's slice of each of its parameters, from a full name-keyed state (a `Lazy`
    tensor read only where this rank's slice lies)."""
    params, roles = named_parameters(chunks), rank_roles(chunks)
    missing = sorted({roles.original(n) for n, p in params} - state.keys())
    if missing:
        raise CheckpointError(f"checkpoint lacks tensors this model needs: {missing[:5]}")
    return {p: _local(state[roles.original(name)], p, tp, name) for name, p in params}


@torch.no_grad()
def load_full_model_state(
    chunks: list[nn.Module], state: dict[str, torch.Tensor], tp: Group
) -> None:
    """This rank's parameters (and persistent buffers) from a full name-keyed state."""
    for p, value in local_model_state(chunks, state, tp).items():
        p.copy_(value)
    for name, b in named_buffers(chunks):
        if name not in state:
            raise CheckpointError(f"checkpoint lacks tensors this model needs: {[name]}")
        b.copy_(state[name])


def local_optimizer_state(
    saved: dict[str, Any], chunks: list[nn.Module], tp: Group
) -> tuple[dict[nn.Parameter, dict[str, torch.Tensor]], int]:
    """This rank's slices of the saved AdamW moments by parameter, and the step count."""
    moments, step, roles = {}, 0, rank_roles(chunks)
    for name, p in named_parameters(chunks):
        entry = saved["state"].get(roles.original(name))
        if entry is None:
            continue
        step = int(entry["step"])
        moments[p] = {
            k: _local(v, p, tp, name) for k, v in entry.items() if torch.is_tensor(v) and v.dim()
        }
    return moments, step


# ---------------------------------------------------------------------- whole checkpoints


def flatten_state(state: dict[str, Any]) -> dict[str, Any]:
    """A full single-process state dict (load_checkpoint's form) as flat DCP entries."""
    flat: dict[str, Any] = {}
    for key, value in state.items():
        if key == "model":  # a Lazy value is read when written (checkpoint/writer.py)
            for k, v in value.items():
                flat[MODEL + k] = v if isinstance(v, Lazy) else v.detach()
        elif key == "optimizer":
            steps = [int(e["step"]) for e in value.get("state", {}).values() if "step" in e]
            flat["optimizer/step"] = steps[0] if steps else 0
            flat["optimizer/param_groups"] = value.get("param_groups", [])
            for name, entry in value.get("state", {}).items():
                for k, v in entry.items():
                    if torch.is_tensor(v) and v.dim():
                        flat[f"{MOMENTS}{name}/{k}"] = v
        elif key == "rng":
            flat.update({f"{RNG}rank0/{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    state: dict[str, Any],
    cfg: RunConfig,
    tokenizer_file: Path | None,
    keep: int = 0,
) -> Path:
    """Write a full single-process `state` as the checkpoint of `step` (one process)."""
    return start_checkpoint(run_dir, step, flatten_state(state), cfg, tokenizer_file, keep).finish()


def load_checkpoint(step_dir: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The checkpoint's full single-process state, in one process; a damaged file is
    named in the error."""
    if (step_dir / STATE_FILE).is_file():
        file = step_dir / STATE_FILE
        try:
            return torch.load(file, map_location=map_location, weights_only=True)
        except Exception as exc:  # torch raises several types for damaged zip archives
            raise CheckpointError(f"cannot read checkpoint file {file}: {exc}") from exc
    metadata = read_metadata(step_dir)
    problems = verify_files(step_dir, metadata)
    if problems:
        raise CheckpointError(f"{'; '.join(problems)}; {damaged_advice(step_dir)}")
    flat: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            flat[key] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            flat[key] = None
    load_entries(step_dir, flat)
    return _unflatten(flat, map_location)


def model_entries(step_dir: Path) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]]:
    """The checkpoint's model tensors, read from its metadata alone, by global name: the
    DCP key, full shape and dtype of each; its files checked first (sizes and checksums),
    a damaged one named. For reading the model a few tensors at a time (the export)."""
    metadata = read_metadata(step_dir)
    problems = verify_files(step_dir, metadata)
    if problems:
        raise CheckpointError(f"{'; '.join(problems)}; {damaged_advice(step_dir)}")
    entries = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(MODEL) and isinstance(md, TensorStorageMetadata):
            view = torch.empty(md.size, dtype=md.properties.dtype, device="meta")
            name, full = unview_parts(key[len(MODEL) :], view)
            entries[name] = (key, tuple(full.shape), md.properties.dtype)
    return entries


def read_model_tensors(
    step_dir: Path, entries: dict[str, tuple[str, tuple[int, ...], torch.dtype]], names: list[str]
) -> dict[str, torch.Tensor]:
    """The full float32 tensors of `names` (keys of `model_entries`), nothing else read."""
    flat = {}
    for name in names:
        key, shape, dtype = entries[name]
        flat[key] = torch.empty(read_shape(key, shape), dtype=dtype)
    load_entries(step_dir, flat)
    keys = {name: entries[name][0] for name in names}
    return {name: unview_parts(key, flat[key])[1].float() for name, key in keys.items()}


def read_shape(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stored shape of a tensor of full `shape` under `key` (a `@parts` view)."""
    dim = parts_dim(key)
    if dim is None:
        return shape
    parts = int(key.partition("@parts")[2].split("dim")[0])
    return (*shape[:dim], parts, shape[dim] // parts, *shape[dim + 1 :])


def read_entry(step_dir: Path, key: str) -> Any:
    """One non-tensor entry of the checkpoint (e.g. "tokenizer"), or None without it."""
    if key not in read_metadata(step_dir).state_dict_metadata:
        return None
    return load_entries(step_dir, {key: None})[key]


def _unflatten(flat: dict[str, Any], map_location) -> dict[str, Any]:
    state: dict[str, Any] = {"model": {}, "optimizer": {"state": {}, "param_groups": []}}
    opt_step = flat.get("optimizer/step", 0)
    rng: dict[str, torch.Tensor] = {}
    for key, value in flat.items():
        if torch.is_tensor(value):
            value = value.to(map_location)
        if key.startswith(MODEL):
            name, value = unview_parts(key[len(MODEL) :], value)
            state["model"][name] = value
        elif key.startswith(MOMENTS):
            rest, value = unview_parts(key[len(MOMENTS) :], value)
            name, moment = rest.rsplit("/", 1)
            entry = state["optimizer"]["state"].setdefault(name, {"step": opt_step})
            entry[moment] = value
        elif key == "optimizer/param_groups":
            state["optimizer"]["param_groups"] = value
        elif key.startswith(f"{RNG}rank0/"):
            rng[key.rsplit("/", 1)[1]] = value
        elif not key.startswith(RNG) and key not in ("optimizer/step", "layout"):
            state[key] = value
    state["rng"] = rng
    return state
