"""Gradient bookkeeping across the tensor-parallel group: sequence-parallel sums and
one global gradient norm for clipping.

The trainer keeps gradients in data-parallel buffers (`ptdp.parallel.data`) and its
optimizer computes the norm over them with `counted_in_norm`; the functions on
`param.grad` here serve plain modules (tests, benchmarks, users' own loops).

The norm must be the single-process norm: a sharded parameter contributes each rank's
slice, a replicated one (norms, biases of row-parallel layers, tied or positional
embeddings) only once, however many ranks hold a copy. Which parameters are tied copies
or sequence-parallel, the model's `ParamRoles` record says (`ptdp.parallel.roles`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from ptdp.parallel.comm import Group, all_reduce_sum_, all_reduce_tensors_
from ptdp.parallel.init import shard_spec
from ptdp.parallel.roles import ParamRoles


def reduce_sequence_parallel_grads(model: nn.Module, roles: ParamRoles, tp: Group) -> None:
    """Sum over the tensor group the gradients of replicated weights that each rank
    applied to its own sequence slice (norms, row-parallel biases, positions)."""
    grads = [
        p.grad
        for name, p in model.named_parameters()
        if roles.is_sequence_parallel(name) and p.grad is not None
    ]
    all_reduce_tensors_(grads, tp, average=False)


def reduce_tied_grads(chunks: Iterable[nn.Module], roles: ParamRoles, embedding: Group) -> None:
    """Sum the gradients of the embedding shared by the first and last pipeline stage,
    over a rank's model chunks (`roles`: their merged record, `rank_roles`).

    Both copies then hold the same gradient, so they stay equal after the optimizer step.
    """
    grads = [
        p.grad
        for chunk in chunks
        for name, p in chunk.named_parameters()
        if p.grad is not None and (name.endswith("embedding.weight") or roles.is_tied_copy(name))
    ]
    sum_tied_(grads, embedding)


def sum_tied_(grads: list[torch.Tensor], embedding: Group) -> None:
    """Sum, in place, the gradients of the tied embedding's copies that this rank holds:
    here when it holds both (the first and the last stage on one rank, as in ZB-V's V),
    then over `embedding`, the group of the ranks holding the two ends."""
    if len(grads) == 2:
        grads[0].add_(grads[1])
        grads[1].copy_(grads[0])
    if embedding.size > 1:
        all_reduce_tensors_(grads, embedding, average=False)


def counted_in_norm(name: str, p: torch.Tensor, roles: ParamRoles, tp: Group) -> bool:
    """Whether this rank's copy of `p` (parameter `name`) counts towards the global norm:
    a tied copy never (its original does), a tensor-replicated parameter on tensor rank 0
    only."""
    return not roles.is_tied_copy(name) and (shard_spec(p) is not None or tp.rank == 0)


def squared_sum(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    if tensors:
        total += torch.stack(torch._foreach_norm([t.float() for t in tensors])).pow(2).sum()
    return total


def global_grad_norm(
    model: nn.Module, roles: ParamRoles, tp: Group, pp: Group | None = None
) -> torch.Tensor:
    """L2 norm of the full model's gradient, identical on every rank of the tp x pp groups."""
    grads = [
        p.grad
        for name, p in model.named_parameters()
        if p.grad is not None and counted_in_norm(name, p, roles, tp)
    ]
    total = squared_sum(grads, next(model.parameters()).device)
    all_reduce_sum_(total, tp)
    if pp is not None:  # each pipeline rank holds different layers
        all_reduce_sum_(total, pp)
    return total.sqrt()


def clip_gradients(
    model: nn.Module, roles: ParamRoles, max_norm: float, tp: Group, pp: Group | None = None
) -> torch.Tensor:
    """Scale all gradients so that the global norm is at most `max_norm`; return the norm.
    `roles`: the model's record (`NO_ROLES` for a plain module)."""
    norm = global_grad_norm(model, roles, tp, pp)
    if max_norm > 0 and math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
