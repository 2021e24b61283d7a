"""Data-parallel gradient averaging.

This first version flattens all gradients into one buffer and all-reduces it once after
the last microbatch's backward; bucketing and overlap with the backward pass come later.
"""

from __future__ import annotations

from torch import nn

from ptdp.parallel.comm import all_reduce_tensors_
from ptdp.parallel.mesh import ParallelMesh


def average_gradients(model: nn.Module, mesh: ParallelMesh) -> None:
    """Replace each gradient by its mean over the data-parallel group."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    all_reduce_tensors_(grads, mesh.axis("dp"), average=True)
