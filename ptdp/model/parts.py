"""The pieces the layers of a GPT share: what they know of tensor parallelism
(`TPContext`), the normalisation, and the dense MLP (a layer's feed-forward block, and a
mixture-of-experts block's shared experts).

Shapes: s = sequence, b = micro-batch, h = hidden; activations are [s, b, h].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.config.enums import Activation, CpComm, Normalization
from ptdp.config.sections import ModelConfig
from ptdp.parallel.comm import Group
from ptdp.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from ptdp.parallel.wgrad import WeightGradStore

if TYPE_CHECKING:
    from ptdp.parallel.fp8 import Fp8Gemms


@dataclass(frozen=True)
class TPContext:
    """What the layers need to know about tensor parallelism (not the whole config)."""

    tp: Group = Group(None, 1, 0)
    sequence_parallel: bool = False
    wgrad: WeightGradStore | None = None
    """The chunk's store of deferred weight-gradient GEMMs (zero-bubble B/W split)."""
    cp: Group = Group(None, 1, 0)
    """The context-parallel group: each member holds part of every sequence."""
    cp_comm: CpComm = CpComm.RING
    ep: Group = Group(None, 1, 0)
    """The expert-parallel group: its members hold different experts of each MoE layer."""
    etp: Group = Group(None, 1, 0)
    """The expert tensor-parallel group: its members split each expert's matrices."""
    fp8: Fp8Gemms | None = None
    """precision = fp8: the float8 recipe of the linear layers' GEMMs (`ptdp.parallel.fp8`)."""
    moe_overlap: bool = False
    """`parallel.moe_overlap`: MoE layers post their dispatch all-to-all asynchronously and
    run the shared experts while it is in flight (`ptdp.model.moe.MoE`)."""


def build_norm(cfg: ModelConfig, size: int = 0) -> nn.Module:
    """The model's normalisation over `size` features (default: the hidden size)."""
    size = size or cfg.hidden_size
    if cfg.normalization is Normalization.RMSNORM:
        return nn.RMSNorm(size, eps=cfg.norm_eps)
    return nn.LayerNorm(size, eps=cfg.norm_eps, bias=cfg.bias)


class MLP(nn.Module):
    """h -> ffn -> h (ffn = `ffn_size`, default the model's). For SwiGLU, fc1's output
    rows are [gate; up]."""

    def __init__(self, cfg: ModelConfig, ctx: TPContext, *, ffn_size: int = 0) -> None:
        super().__init__()
        ffn_size = ffn_size or cfg.ffn_size
        self.swiglu = cfg.activation is Activation.SWIGLU
        parts = 2 if self.swiglu else 1
        sp = ctx.sequence_parallel
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size,
            ffn_size * parts,
            tp=ctx.tp,
            bias=cfg.bias,
            sequence_parallel=sp,
            parts=parts,
            wgrad=ctx.wgrad,
            fp8=ctx.fp8,
        )
        self.fc2 = RowParallelLinear(
            ffn_size,
            cfg.hidden_size,
            tp=ctx.tp,
            bias=cfg.bias,
            sequence_parallel=sp,
            wgrad=ctx.wgrad,
            fp8=ctx.fp8,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        if self.swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(x, approximate="tanh")  # GPT-2's GeLU
        return self.fc2(x)
