"""The one module that calls torch.distributed collectives.

Later parts of ptdp add the tensor-parallel region operators here; for now it holds
what data parallelism and logging need.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_mean_(tensor: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> None:
    """In place: the mean of `tensor` over `group` (a no-op for a group of one)."""
    if size == 1:
        return
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    tensor.div_(size)


def all_reduce_max_(tensor: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> None:
    if size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def barrier(group: dist.ProcessGroup | None, size: int) -> None:
    if size > 1:
        dist.barrier(group=group)
