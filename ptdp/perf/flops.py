"""FLOPs of a GPT iteration, after Narayanan et al. 2021 (arXiv 2104.04473), Appendix.

An [m, k] x [k, n] GEMM costs 2mkn FLOPs; only the transformer GEMMs, the attention
score/value products and the logit layer are counted (the paper's lower bound). The
attention products are counted over the full s x s square, as the paper does.

For the paper's own GPT (4h MLP, multi-head attention) with full recomputation,
`flops_per_iteration` equals equation (3),
    F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)),
and with no recomputation it is the "model FLOPs" form 72 B s l h^2 (1 + s/(6h) + V/(12 l h))
of Korthikanti et al. 2022. The generic per-GEMM sum below also covers SwiGLU, other MLP
widths and grouped-query attention.
"""

from __future__ import annotations

from ptdp.config import Activation, ModelConfig, Recompute


def layer_forward_flops_per_token(cfg: ModelConfig) -> tuple[float, float]:
    """(GEMM FLOPs, attention-core FLOPs) of one layer's forward, per token."""
    h, f, s = cfg.hidden_size, cfg.ffn_size, cfg.seq_length
    kv = cfg.query_groups * cfg.head_dim
    qkv = 2 * h * (h + 2 * kv)
    proj = 2 * h * h
    mlp = (6 if cfg.activation is Activation.SWIGLU else 4) * h * f
    core = 4 * s * h  # scores QK^T and the weighted sum over V, 2 s h each
    return qkv + proj + mlp, core


def flops_per_token(cfg: ModelConfig, recompute: Recompute = Recompute.NONE) -> float:
    """Training FLOPs (forward + backward = 3x forward, plus any recomputation) per token."""
    gemm, core = layer_forward_flops_per_token(cfg)
    extra = {Recompute.NONE: 0.0, Recompute.SELECTIVE: core, Recompute.FULL: gemm + core}
    layers = cfg.num_layers * (3 * (gemm + core) + extra[recompute])
    logits = 3 * 2 * cfg.hidden_size * cfg.vocab_size  # never recomputed
    return layers + logits


def flops_per_iteration(
    cfg: ModelConfig, global_batch_size: int, recompute: Recompute = Recompute.NONE
) -> float:
    """FLOPs of one optimizer step over the whole global batch of sequences."""
    return flops_per_token(cfg, recompute) * global_batch_size * cfg.seq_length


def paper_equation_3(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Equation (3) of the paper verbatim (it includes full activation recomputation)."""
    h = hidden
    return 96 * batch * seq * layers * h**2 * (1 + seq / (6 * h) + vocab / (16 * layers * h))


def paper_parameter_count(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Equation (2) of the paper: P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))."""
    h = hidden
    return 12 * layers * h**2 * (1 + 13 / (12 * h) + (vocab + seq) / (12 * layers * h))
