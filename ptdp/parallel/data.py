"""Data-parallel gradient averaging.

This first version flattens all gradients into one buffer and all-reduces it once after
the last microbatch's backward; bucketing and overlap with the backward pass come later.
"""

from __future__ import annotations

import torch
from torch import nn

from ptdp.parallel.comm import all_reduce_mean_
from ptdp.parallel.mesh import ParallelMesh


def average_gradients(model: nn.Module, mesh: ParallelMesh) -> None:
    """Replace each gradient by its mean over the data-parallel group."""
    size = mesh.size("dp")
    if size == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce_mean_(flat, mesh.group("dp"), size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
