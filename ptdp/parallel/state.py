"""Layout-free state: gather a rank's sharded model and optimizer state to the full
single-process tensors, and slice full tensors back to a rank's shards.

Checkpoints hold the full state, so a run saved with one tensor-parallel size loads with
any other (and `ptdp generate` needs no process group). Gathering costs a collective per
tensor; the sharded, parallel writer of a later version replaces this for large models.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ptdp.errors import CheckpointError
from ptdp.parallel.comm import Group
from ptdp.parallel.init import full_tensor, shard_spec


def full_model_state(model: nn.Module, tp: Group) -> dict[str, torch.Tensor]:
    return {
        name: full_tensor(p, shard_spec(p), tp).clone()
        for name, p in model.state_dict(keep_vars=True).items()
    }


@torch.no_grad()
def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor], tp: Group) -> None:
    own = model.state_dict(keep_vars=True)
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint does not match the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    for name, p in own.items():
        spec = shard_spec(p)
        value = state[name] if spec is None or tp.size == 1 else spec.shard(state[name], tp.rank)
        if value.shape != p.shape:
            raise CheckpointError(
                f"checkpoint tensor {name} has shape {tuple(value.shape)}, the model "
                f"expects {tuple(p.shape)}"
            )
        p.copy_(value)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(optimizer: torch.optim.Optimizer, tp: Group) -> dict[str, Any]:
    """The optimizer's state_dict with each per-parameter tensor gathered to full shape."""
    sd = optimizer.state_dict()
    params = _params(optimizer)
    # state_dict() shares the live per-parameter dicts: build new ones, never edit them.
    sd["state"] = {
        index: {
            key: full_tensor(value, shard_spec(params[index]), tp).clone()
            if torch.is_tensor(value) and value.shape == params[index].shape
            else value
            for key, value in entry.items()
        }
        for index, entry in sd["state"].items()
    }
    return sd


def load_full_optimizer_state(
    optimizer: torch.optim.Optimizer, sd: dict[str, Any], tp: Group
) -> None:
    params = _params(optimizer)
    for index, entry in sd["state"].items():
        spec = shard_spec(params[index])
        if spec is None or tp.size == 1:
            continue
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0:
                entry[key] = spec.shard(value, tp.rank).clone()
    optimizer.load_state_dict(sd)
