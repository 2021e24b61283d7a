"""The routed experts of a mixture-of-experts layer as grouped weights, split over the
expert tensor-parallel group (`parallel.etp`) as the dense MLP is over the tensor group.

Shapes: n = rows (token-choices sorted by expert), e = experts on this rank (all of them,
or under expert parallelism its num_experts / ep), h = hidden, f = one expert's inner
width, t = etp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.parallel.comm import Group
from ptdp.parallel.init import ExpertSplit, ShardSpec
from ptdp.parallel.wgrad import WeightGradStore, grouped_linear

if TYPE_CHECKING:  # torchao is optional: only an fp8 run imports ptdp.parallel.fp8
    from ptdp.parallel.fp8 import Fp8Gemms


def _param(shape: tuple[int, ...], spec: ShardSpec | None, split: ExpertSplit) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape))
    if spec is not None and spec.size > 1:
        param.tp_shard = spec  # ptdp.parallel.init: how to slice and gather it
    param.ep_split = split  # this rank's experts of all of them, its place in their etp group
    return param


class GroupedLinear(nn.Module):
    """The parameters of e linear layers side by side: weight [e, out, in], bias [e, out].
    `split`: the dim (1 = out, 2 = in) split over `tp`, in `parts` blocks (SwiGLU); `experts`:
    which e of all the experts they are."""

    def __init__(
        self,
        e: int,
        out: int,
        inp: int,
        *,
        tp: Group,
        split: int,
        bias: bool,
        experts: ExpertSplit,
        parts: int = 1,
    ) -> None:
        super().__init__()
        full = out if split == 1 else inp
        if full % (tp.size * parts):
            raise ValueError(f"{full} expert features do not split over {tp.size} ranks")
        spec = ShardSpec(dim=split, full_size=full, padded_size=full, size=tp.size, parts=parts)
        shape = [e, out, inp]
        shape[split] //= tp.size
        self.weight = _param(tuple(shape), spec, experts)
        self.bias = _param((e, shape[1]), spec if split == 1 else None, experts) if bias else None


class GroupedExperts(nn.Module):
    """e MLPs h -> f -> h (GeLU, or SwiGLU with fc1's rows [gate; up] per expert).

    fc1 [e, parts * f/t, h] is split by columns and fc2 [e, h, f/t] by rows, as in the
    dense MLP, so a rank's output rows are partial sums over the tensor group: the caller
    reduces them once, after the combine (`ptdp.model.moe.MoE`). fc2's bias [e, h] is
    replicated and added on tensor rank 0 only (zero times it elsewhere, so every rank's
    parameter still receives a gradient); its gradient is summed over the group. The
    products go through `grouped_linear`, whose weight gradients a zero-bubble W can take,
    in float8 when `fp8` is given (precision = fp8: `ptdp.parallel.fp8_grouped`).
    Rows are picked with `index_select`, whose backward (`index_add_`) sums in a fixed order
    on a CPU, unlike advanced indexing's (`index_put_`, threaded), so runs repeat bitwise.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_size: int,
        *,
        tp: Group,
        swiglu: bool,
        bias: bool,
        wgrad: WeightGradStore | None = None,
        ep: Group | None = None,
        fp8: Fp8Gemms | None = None,
    ) -> None:
        super().__init__()
        self.swiglu, self.wgrad, self.fp8 = swiglu, wgrad, fp8
        parts = 2 if swiglu else 1
        ep = ep or Group.single()
        split = ExpertSplit(num_experts, ep.size, ep.rank, etp_rank=tp.rank)
        e, h, f = split.local, hidden_size, ffn_size
        kw = {"tp": tp, "bias": bias, "experts": split}
        self.fc1 = GroupedLinear(e, parts * f, h, split=1, parts=parts, **kw)
        self.fc2 = GroupedLinear(e, h, f, split=2, **kw)
        self.bias_share = 1.0 if tp.rank == 0 else 0.0

    def forward(self, x: torch.Tensor, counts: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """x [n, h] grouped by expert (`counts` [e] rows each; `expert` [n] of each row) ->
        this rank's partial sums [n, h]."""
        y = grouped_linear(x, self.fc1.weight, counts, self.wgrad, fp8=self.fp8)
        if self.fc1.bias is not None:
            y = y + self.fc1.bias.index_select(0, expert)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate="tanh")
        y = grouped_linear(y, self.fc2.weight, counts, self.wgrad, fp8=self.fp8)
        if self.fc2.bias is not None:
            y = y + self.fc2.bias.index_select(0, expert) * self.bias_share
        return y
