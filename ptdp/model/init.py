"""Layout-independent, seeded weight initialisation.

Each parameter is drawn from its own generator, seeded by the run seed and the
parameter's *global* name (layer indices are global, see gpt.py). A parameter's
values therefore do not depend on which other parameters a process holds, so a
pipeline stage or a tensor-parallel shard can build exactly its slice of the
single-process model: the property every equivalence test relies on.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from ptdp.parallel.comm import Group
from ptdp.parallel.init import global_shape, local_part
from ptdp.parallel.roles import NO_ROLES, ParamRoles


def _generator(seed: int, name: str) -> torch.Generator:
    # crc32 is stable across processes and Python versions (unlike hash()).
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def init_tensor(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """The full (unsharded) float32 master value of parameter `name`."""
    return torch.empty(shape).normal_(0.0, std, generator=_generator(seed, name))


def init_std(name: str, base_std: float, num_layers: int) -> float:
    """GPT-2 / Megatron rule: residual output projections are scaled by 1/sqrt(2L) (an MoE
    block's routed and shared experts' second layers too)."""
    if name.endswith(
        ("attn.proj.weight", "mlp.fc2.weight", "experts.fc2.weight", "shared.fc2.weight")
    ):
        return base_std / math.sqrt(2 * num_layers)
    return base_std


@torch.no_grad()
def apply_init(
    model: nn.Module,
    *,
    seed: int,
    base_std: float,
    num_layers: int,
    tp: Group | None = None,
    roles: ParamRoles = NO_ROLES,
) -> None:
    """Initialise every parameter of `model` in place from its global name.

    A tensor-parallel shard takes its slice of the full master value, so every layout
    starts from the same model; a tied copy (named in `roles`) starts as its original.
    """
    norms = (nn.LayerNorm, nn.RMSNorm)
    for mod_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            if isinstance(module, norms):
                param.fill_(1.0 if leaf == "weight" else 0.0)
            elif leaf == "bias":
                param.zero_()
            else:
                name = roles.original(name)  # a tied copy starts as its original
                shape = global_shape(param)
                full = init_tensor(name, shape, init_std(name, base_std, num_layers), seed)
                full = local_part(full, param, tp.rank if tp is not None else 0)
                param.copy_(full.to(param.dtype))
