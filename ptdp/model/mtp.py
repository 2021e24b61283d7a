"""Multi-token prediction (model.mtp_depth; DeepSeek-V3, arXiv 2412.19437, section 2.2) on
the model chunk that holds the output layer.

Module k = 1..D keeps the causal chain of predictions: at position i it combines h^{k-1}_i,
the previous module's hidden state (the main model's last layer output for k = 1, before
the final norm), with the embedding of token i + k,

    h'_i = W_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]

(the embedding first, as DeepSeek's code and `transformers`' checkpoints order them), runs
one transformer layer on it for h^k_i, and predicts token i + k + 1 through its own final
norm and the shared output layer. The shifted tokens are the labels' (labels[i] = t_{i+1}),
so the last stage needs no input tokens: depth k embeds labels rolled by k - 1 and scores
against labels rolled by k, its last k positions masked out of the mean. The loss adds
model.mtp_loss_weight times the mean over depths (`mtp_loss`); `MtpState` keeps each depth's
loss for the log.

Under tensor parallelism the layer splits as the others, W_k is replicated (a partial sum
over the group under sequence parallelism, as the norms are) and the embedding lookup is
vocabulary-parallel. Under pipeline parallelism the modules sit on the last stage with a
copy of the embedding (a tied copy of stage 0's, its gradient summed with it as a tied
output layer's is, `ptdp.parallel.roles`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ptdp.config.sections import ModelConfig
from ptdp.model.parts import TPContext, build_norm
from ptdp.model.positions import TokenPositions
from ptdp.model.rope import Rotary
from ptdp.parallel.tensor import ReplicatedLinear


@dataclass
class MtpState:
    """Each depth's loss over a step's training microbatches on this rank (detached)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    microbatches: int = 0

    def begin_step(self) -> None:
        self.losses, self.microbatches = [], 0

    def record(self, losses: list[torch.Tensor]) -> None:
        detached = [loss.detach().float() for loss in losses]
        if self.losses:
            detached = [a + b for a, b in zip(self.losses, detached)]
        self.losses, self.microbatches = detached, self.microbatches + 1


class MtpModule(nn.Module):
    """One depth's norms, projection W_k (`eh_proj`), transformer layer and final norm."""

    def __init__(self, cfg: ModelConfig, ctx: TPContext, layer: nn.Module) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.enorm, self.hnorm = build_norm(cfg), build_norm(cfg)
        self.eh_proj = ReplicatedLinear(
            2 * h, h, bias=False, sequence_parallel=ctx.sequence_parallel, wgrad=ctx.wgrad,
            fp8=ctx.fp8,
        )  # fmt: skip
        self.layer = layer
        self.norm = build_norm(cfg)

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        rotary: Rotary | None,
        positions: TokenPositions | None,
    ) -> torch.Tensor:
        """h^{k-1} and Emb(t_{i+k}), both [s, b, h] ([s/t, b, h] under sequence
        parallelism) -> h^k, the same shape."""
        joined = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        return self.layer(self.eh_proj(joined), rotary, positions=positions)


def shifted(labels: torch.Tensor, by: int) -> torch.Tensor:
    """labels [b, s] moved `by` positions earlier (the end wraps round, and is masked)."""
    return labels.roll(-by, dims=1) if by else labels


def valid_positions(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """[s, b] bool: the positions whose token depth + 1 ahead is in the sequence."""
    s = labels.shape[1]
    keep = torch.arange(s, device=labels.device) < s - depth
    return keep[:, None].expand(s, labels.shape[0])
