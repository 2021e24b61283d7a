"""Layout-free state: a rank's sharded model and optimizer state gathered to the full
single-process tensors under their global names, and full tensors sliced back to shards.

Training checkpoints are written shard by shard (ptdp/parallel/sharded_state.py); these
full-state helpers serve the single-process view (`ptdp generate`, convert, inspect) and
the earlier single-file checkpoint format (`state.pt`), which still restores. A pipeline
rank contributes the parameters of its chunks (their names are global); the last stage's
copy of a tied embedding is not saved (it equals `embedding.weight`) and is restored
from it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ptdp.errors import CheckpointError
from ptdp.parallel.comm import Group
from ptdp.parallel.init import full_tensor, shard_spec
from ptdp.parallel.roles import rank_roles


def named_parameters(chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Parameters of this rank's chunks under their global names."""
    return [(name, p) for chunk in chunks for name, p in chunk.named_parameters()]


def full_model_state(
    chunks: list[nn.Module], tp: Group, weights: dict[nn.Parameter, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Full fp32 tensors by global name: `weights` (the optimizer's fp32 master weights, by
    parameter) where given, else the parameters themselves."""
    weights, roles = weights or {}, rank_roles(chunks)
    return {
        name: full_tensor(weights.get(p, p), shard_spec(p), tp).float().clone()
        for name, p in named_parameters(chunks)
        if not roles.is_tied_copy(name)
    }


def _local(value: torch.Tensor, p: torch.Tensor, tp: Group, name: str) -> torch.Tensor:
    spec = shard_spec(p)
    local = value if spec is None else spec.shard(value, tp.rank)  # pads, at any tp
    if local.shape != p.shape:
        raise CheckpointError(
            f"checkpoint tensor {name} has shape {tuple(value.shape)}, which does not fit "
            f"this model's {tuple(p.shape)} (per rank); is it the same model?"
        )
    return local


def local_model_state(
    chunks: list[nn.Module], state: dict[str, torch.Tensor], tp: Group
) -> dict[nn.Parameter, torch.Tensor]:
    """This rank's slice of each of its parameters, from a full name-keyed state."""
    params, roles = named_parameters(chunks), rank_roles(chunks)
    missing = sorted({roles.original(n) for n, p in params} - state.keys())
    if missing:
        raise CheckpointError(f"checkpoint lacks tensors this model needs: {missing[:5]}")
    return {p: _local(state[roles.original(name)], p, tp, name) for name, p in params}


@torch.no_grad()
def load_full_model_state(
    chunks: list[nn.Module], state: dict[str, torch.Tensor], tp: Group
) -> None:
    for p, value in local_model_state(chunks, state, tp).items():
        p.copy_(value)


def full_optimizer_state(
    moments: dict[nn.Parameter, dict[str, torch.Tensor]],
    step: int,
    param_groups: list[dict],
    chunks: list[nn.Module],
    tp: Group,
) -> dict[str, Any]:
    """AdamW moments by global parameter name, each gathered to full shape."""
    roles = rank_roles(chunks)
    state = {
        name: {"step": step}
        | {k: full_tensor(v, shard_spec(p), tp).clone() for k, v in moments[p].items()}
        for name, p in named_parameters(chunks)
        if p in moments and not roles.is_tied_copy(name)
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
    return {"state": state, "param_groups": groups}


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
