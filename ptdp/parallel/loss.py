"""Cross-entropy over vocabulary-parallel logits, never gathering the full [s, b, v].

Each rank holds logits for its vocabulary slice [s, b, v/t]. The softmax needs only two
numbers per token from the other ranks: the max (all-reduce MAX) and the sum of
exponentials (all-reduce SUM); the target's logit lives on one rank (all-reduce SUM of a
masked pick). Backward is local: softmax minus the one-hot target, on this slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ptdp.parallel import comm
from ptdp.parallel.comm import Group
from ptdp.parallel.init import ShardSpec


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, tp: Group, start: int, end: int):
        logits = logits.float()
        shifted = logits - comm.all_reduce_max_value(logits.max(dim=-1).values, tp).unsqueeze(-1)
        outside = (target < start) | (target >= end)
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        picked = comm.all_reduce_value(picked, tp)
        exp = shifted.exp()
        sum_exp = comm.all_reduce_value(exp.sum(dim=-1), tp)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        onehot = (~outside).to(softmax.dtype).unsqueeze(-1)
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -onehot)
        return grad_logits * grad.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp: Group,
    vocab_size: int,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean token loss. logits: [s, b, padded/t] on each rank (rank i: vocabulary ids from
    i * ceil(v/t), then padding); target: [s, b] global ids; `mask` [s, b] (bool): the
    mean over its true tokens only (multi-token prediction's last positions have no target).

    Padded columns (model.make_vocab_size_divisible_by) take no probability and get no
    gradient, so the loss equals the unpadded model's: at tp = 1 they are sliced off (a
    view, no copy of the logits), at tp > 1 masked to -inf (ranks hold different widths).
    """
    width = logits.shape[-1]
    split = ShardSpec(dim=0, full_size=vocab_size, padded_size=width * tp.size, size=tp.size)
    start, rows = split.start(tp.rank), split.rows(tp.rank)
    if tp.size == 1:
        flat = logits[..., :rows].float().flatten(0, 1)
        if mask is None:
            return F.cross_entropy(flat, target.flatten())
        losses = F.cross_entropy(flat, target.flatten(), reduction="none")
        return _masked_mean(losses, mask.flatten())
    if rows < width:
        columns = torch.arange(width, device=logits.device)
        logits = logits.masked_fill(columns >= rows, float("-inf"))
    losses = _VocabParallelCrossEntropy.apply(logits, target, tp, start, start + rows)
    return losses.mean() if mask is None else _masked_mean(losses, mask)


def _masked_mean(losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (losses * mask).sum() / mask.sum().clamp(min=1)
