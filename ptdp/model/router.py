"""The router of a mixture-of-experts layer: scores, the choice of each token's experts, their
combine weights, and the balancing losses (Switch Transformers, Fedus et al. 2021, arXiv
2101.03961; ST-MoE's z-loss, Zoph et al. 2022, arXiv 2202.08906; DeepSeek-V3's
auxiliary-loss-free bias, arXiv 2412.19437).

Shapes: t = tokens (s * b), e = experts, k = experts per token, h = hidden.

Every layout must route every token as one process does, since a choice is discontinuous:
the logits are computed in fp32 from replicated weights on the whole sequence (every
tensor rank routes the same tokens), and the top-k is a stable sort, so equal scores go to
the lower expert index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.config.enums import ScoreFunction
from ptdp.config.sections import ModelConfig
from ptdp.parallel import comm
from ptdp.parallel.comm import Group


@dataclass(frozen=True)
class RouterOptions:
    """How scores become choices and weights (the model.moe_* keys of the router)."""

    num_experts: int
    top_k: int
    score: ScoreFunction = ScoreFunction.SOFTMAX
    softmax_after_topk: bool = False
    renormalize: bool = False
    scaling: float = 1.0
    groups: int = 0
    group_top_k: int = 0

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> RouterOptions:
        return cls(
            cfg.num_experts,
            cfg.moe_top_k,
            cfg.moe_score_function,
            cfg.moe_softmax_after_topk,
            cfg.moe_renormalize,
            cfg.moe_routed_scaling,
            cfg.moe_router_groups,
            cfg.moe_router_group_top_k,
        )


@dataclass(frozen=True)
class Routing:
    """Where each token goes, and the tensors the balancing losses read (fp32)."""

    experts: torch.Tensor
    """[t, k] int64: each token's experts, best first."""
    weights: torch.Tensor
    """[t, k]: the weight of each chosen expert's output in the token's sum."""
    logits: torch.Tensor
    """[t, e]: the router's logits (the z-loss)."""
    probs: torch.Tensor
    """[t, e]: each token's probability of each expert, summing to 1 (the balancing loss):
    the softmax of the logits, or the sigmoid scores normalised."""


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[t, e] -> [t, k] indices of the k highest scores, highest first; equal scores in
    expert order (a stable sort), the same on every rank and every device."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def route(logits: torch.Tensor, bias: torch.Tensor | None, opts: RouterOptions) -> Routing:
    """Choices and weights from fp32 logits [t, e]. `bias` [e] (DeepSeek-V3) is added to the
    scores for the choice only; the weights come from the unbiased scores."""
    if opts.score is ScoreFunction.SIGMOID:
        scores = logits.sigmoid()
        probs = scores / scores.sum(-1, keepdim=True)
    else:
        scores = probs = logits.softmax(-1)
    if opts.softmax_after_topk:  # Mixtral: the top-k logits, then a softmax over them
        scores = logits
    choice = scores if bias is None else scores + bias
    if opts.groups > 1:
        choice = limit_to_groups(choice, opts.groups, opts.group_top_k)
    chosen = top_k(choice, opts.top_k)
    weights = scores.gather(1, chosen)
    if opts.softmax_after_topk:
        weights = weights.softmax(-1)
    if opts.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if opts.scaling != 1.0:
        weights = weights * opts.scaling
    return Routing(chosen, weights, logits, probs)


def limit_to_groups(choice: torch.Tensor, groups: int, group_top_k: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: the choice scores [t, e] with every expert
    outside a token's `group_top_k` best groups set to -inf, so the top-k comes only from
    those. A group's score is the sum of its two best choice scores (its best alone when a
    group holds one expert); equal group scores go to the lower group, as `top_k` does.
    `transformers` fills the left-out experts with 0 instead, the same whenever the kept
    scores are positive (sigmoid scores without a large negative bias)."""
    t, e = choice.shape
    per_group = choice.view(t, groups, e // groups)
    best = torch.sort(per_group, dim=-1, descending=True).values[..., : min(2, e // groups)]
    kept = top_k(best.sum(-1), group_top_k)  # [t, group_top_k]
    mask = torch.zeros(t, groups, dtype=torch.bool, device=choice.device)
    mask.scatter_(1, kept, True)
    return per_group.masked_fill(~mask[..., None], float("-inf")).view(t, e)


class Router(nn.Module):
    """Logits = x W^T with W [e, h], in fp32 whatever the training precision, then `route`.

    W is replicated over the tensor group. Its gradient on a tensor rank is a partial sum
    (the combine weights meet that rank's partial expert outputs; `MoE` scales the balancing
    losses by 1/t), so the owning model names it for a sum over the group (`param_roles`).
    With `bias`, a persistent fp32 buffer [e] (`expert_bias`, saved in checkpoints) holds
    DeepSeek-V3's balancing bias, moved after each step by `update_bias`.
    """

    def __init__(self, hidden_size: int, opts: RouterOptions, *, bias: bool = False) -> None:
        super().__init__()
        self.opts = opts
        self.weight = nn.Parameter(torch.empty(opts.num_experts, hidden_size))
        self.expert_bias: torch.Tensor | None
        if bias:
            self.register_buffer("expert_bias", torch.zeros(opts.num_experts))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> Routing:
        """x [t, h] -> the tokens' routing."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
        bias = None if self.expert_bias is None else self.expert_bias.float()
        return route(logits, bias, self.opts)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """bias_e += rate * sign(mean load - load_e): `load` [e] is the token-choices each
        expert received over the global batch, the same on every rank, so are the biases."""
        load = load.to(self.expert_bias.device, torch.float64)
        self.expert_bias += rate * torch.sign(load.mean() - load).float()


def balancing_loss(
    probs: torch.Tensor, routed: torch.Tensor, top_k: int, groups: tuple[Group, ...]
) -> torch.Tensor:
    """Switch's load-balancing loss without its coefficient: e * sum_i f_i P_i over the
    microbatch's tokens, f_i the share of the t * k token-choices routed to expert i
    (`routed` [e], before any capacity cut) and P_i its mean probability. The tokens are
    the whole sequence's, which tensor and context parallelism split over the ranks of
    `groups`: the sums are taken over them (P's differentiably), so every member holds the
    one-process value."""
    tokens = probs.shape[0] * math.prod(g.size for g in groups)
    share, mean_probs = routed.to(probs.dtype), probs.sum(0)
    for g in groups:
        share, mean_probs = comm.all_reduce_value(share, g), comm.sum_across(mean_probs, g)
    share, mean_probs = share / (tokens * top_k), mean_probs / tokens
    return probs.shape[1] * (share * mean_probs).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss without its coefficient: mean over tokens of logsumexp^2. Under
    context parallelism each member's mean of its own tokens (they average like the loss)."""
    return torch.logsumexp(logits, dim=-1).square().mean()
