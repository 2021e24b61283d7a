"""Layout-free state: a rank's sharded model and optimizer state gathered to the full
single-process tensors under their global names, and full tensors sliced back to shards.

Checkpoints hold this full state, so a run saved in one layout (tensor-parallel size,
pipeline split) loads in any other, and `ptdp generate` needs no process group. A
pipeline rank contributes the parameters of its chunks (their names are global); the
last stage's copy of a tied embedding is not saved (it equals `embedding.weight`) and is
restored from it. Gathering costs a collective per tensor and a gather to rank 0; the
sharded, parallel writer of a later version replaces this for large models.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ptdp.errors import CheckpointError
from ptdp.parallel.comm import Group
from ptdp.parallel.init import full_tensor, shard_spec


def named_parameters(chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Parameters of this rank's chunks under their global names."""
    return [(name, p) for chunk in chunks for name, p in chunk.named_parameters()]


def _saved_name(name: str, p: torch.Tensor) -> str:
    return getattr(p, "tied_to", name)


def full_model_state(chunks: list[nn.Module], tp: Group) -> dict[str, torch.Tensor]:
    return {
        name: full_tensor(p, shard_spec(p), tp).clone()
        for name, p in named_parameters(chunks)
        if not hasattr(p, "tied_to")
    }


def _local(value: torch.Tensor, p: torch.Tensor, tp: Group, name: str) -> torch.Tensor:
    spec = shard_spec(p)
    local = value if spec is None or tp.size == 1 else spec.shard(value, tp.rank)
    if local.shape != p.shape:
        raise CheckpointError(
            f"checkpoint tensor {name} has shape {tuple(value.shape)}, which does not fit "
            f"this model's {tuple(p.shape)} (per rank); is it the same model?"
        )
    return local


@torch.no_grad()
def load_full_model_state(
    chunks: list[nn.Module], state: dict[str, torch.Tensor], tp: Group
) -> None:
    params = named_parameters(chunks)
    missing = sorted({_saved_name(n, p) for n, p in params} - state.keys())
    if missing:
        raise CheckpointError(f"checkpoint lacks tensors this model needs: {missing[:5]}")
    for name, p in params:
        p.copy_(_local(state[_saved_name(name, p)], p, tp, name))


def full_optimizer_state(
    optimizer: torch.optim.Optimizer, chunks: list[nn.Module], tp: Group
) -> dict[str, Any]:
    """AdamW state keyed by parameter name, each tensor gathered to full shape."""
    sd = optimizer.state_dict()
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    state = {}
    for name, p in named_parameters(chunks):
        entry = sd["state"].get(index[id(p)])
        if entry is None or hasattr(p, "tied_to"):
            continue
        state[name] = {
            key: full_tensor(value, shard_spec(p), tp).clone()
            if torch.is_tensor(value) and value.shape == p.shape
            else value
            for key, value in entry.items()
        }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state(
    optimizer: torch.optim.Optimizer, saved: dict[str, Any], chunks: list[nn.Module], tp: Group
) -> None:
    """Fill the optimizer from a name-keyed full state (any layout saved it)."""
    sd = optimizer.state_dict()
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    state = {}
    for name, p in named_parameters(chunks):
        entry = saved["state"].get(_saved_name(name, p))
        if entry is None:
            continue
        state[index[id(p)]] = {
            key: _local(value, p, tp, name).clone()
            if torch.is_tensor(value) and value.dim() > 0
            else value
            for key, value in entry.items()
        }
    for group, saved_group in zip(sd["param_groups"], saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    sd["state"] = state
    optimizer.load_state_dict(sd)
