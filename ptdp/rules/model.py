"""The model rules of `validate`: sizes, heads against the width, rotary positions and
their scaling."""

from __future__ import annotations

from ptdp.config.enums import PositionEmbedding, RopeScaling
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.rules.domains import require_positive

_DEFAULTS = ModelConfig()


def mtp_rules(cfg: RunConfig, errors: list[str]) -> None:
    """Multi-token prediction's depth against the sequence, and the layouts it runs in."""
    m, p = cfg.model, cfg.parallel
    require_positive(errors, "model.mtp_depth", m.mtp_depth, zero_ok=True)
    if m.mtp_depth <= 0:
        return
    if m.seq_length > 0 and m.mtp_depth >= m.seq_length:
        errors.append(
            f"model.mtp_depth = {m.mtp_depth} leaves no token to predict in a sequence of "
            f"model.seq_length = {m.seq_length} (depth k predicts the token k + 1 ahead); "
            f"use --model.mtp_depth {max(1, m.seq_length - 1)} or less"
        )
    if p.cp > 1:
        errors.append(
            f"model.mtp_depth = {m.mtp_depth} with parallel.cp = {p.cp}: multi-token "
            "prediction under context parallelism is not built (its shifted tokens cross the "
            "ranks' chunks); use --parallel.cp 1 or --model.mtp_depth 0"
        )
    if m.tie_embeddings and p.pp > 1:
        errors.append(
            f"model.mtp_depth = {m.mtp_depth} with model.tie_embeddings and parallel.pp = "
            f"{p.pp}: the last stage would hold two copies of the embedding, which is not "
            "built; use --model.tie_embeddings false (as DeepSeek-V3) or --parallel.pp 1"
        )


def model_rules(cfg: RunConfig, errors: list[str]) -> None:
    m, before = cfg.model, len(errors)
    positive = ("num_layers", "hidden_size", "num_heads", "seq_length")
    for name in (*positive, "make_vocab_size_divisible_by"):
        require_positive(errors, f"model.{name}", getattr(m, name))
    for name in (
        "num_query_groups",
        "head_size",
        "ffn_hidden_size",
        "vocab_size",
        "sliding_window",
        *_MLA_KEYS,
    ):
        require_positive(errors, f"model.{name}", getattr(m, name), zero_ok=True)
    _rope_scaling_rules(m, errors)
    _latent_attention_rules(m, errors)
    if len(errors) > before:
        return
    if m.hidden_size % m.num_heads and not m.head_size:
        errors.append(
            f"model.hidden_size = {m.hidden_size} is not divisible by model.num_heads = "
            f"{m.num_heads}; choose heads that divide the width (e.g. {_divisor(m.hidden_size)})"
        )
    elif m.position_embedding is PositionEmbedding.ROPE and m.rotary_dim % 2:
        errors.append(
            f"rotary positions need an even head size, got {m.rotary_dim}; change "
            + (
                "model.qk_rope_head_dim"
                if m.is_mla
                else "model.head_size, or model.num_heads or model.hidden_size"
            )
        )
    if m.num_heads % m.query_groups:
        errors.append(
            f"model.num_query_groups = {m.num_query_groups} does not divide model.num_heads = "
            f"{m.num_heads}; use a divisor of the head count (1 = multi-query)"
        )


_MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _latent_attention_rules(m: ModelConfig, errors: list[str]) -> None:
    """MLA's widths, and the MHA keys it has no use for."""
    if not m.is_mla:
        changed = [k for k in _MLA_KEYS if getattr(m, k)]
        if changed:
            keys = ", ".join(f"model.{k} = {getattr(m, k)}" for k in changed)
            errors.append(
                f"{keys} set but model.attention = mha, which reads no latent-attention key; "
                "set --model.attention mla or drop them"
            )
        return
    for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        if not getattr(m, name):
            errors.append(
                f"model.attention = mla needs model.{name} > 0 (DeepSeek-V3: kv_lora_rank 512, "
                "qk_rope_head_dim 64, v_head_dim 128)"
            )
    if m.position_embedding is not PositionEmbedding.ROPE:
        errors.append(
            "model.attention = mla carries its positions in the rotary key; set "
            "model.position_embedding = rope"
        )
    unread = {
        "num_query_groups": m.num_query_groups not in (0, m.num_heads),
        "head_size": m.head_size != 0,
        "qk_norm": m.qk_norm,
        "qkv_bias": m.qkv_bias,
    }
    for name in (n for n, bad in unread.items() if bad):
        errors.append(
            f"model.{name} = {getattr(m, name)} has no meaning under model.attention = mla "
            "(its heads' widths are qk_nope_head_dim, qk_rope_head_dim and v_head_dim, and "
            "every head has its own key and value); drop it"
        )


_YARN_KEYS = ("rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim")


def _rope_scaling_rules(m: ModelConfig, errors: list[str]) -> None:
    if m.rope_scaling is not RopeScaling.YARN:
        changed = [k for k in _YARN_KEYS if getattr(m, k) != getattr(_DEFAULTS, k)]
        if changed:
            keys = ", ".join(f"model.{k} = {getattr(m, k)}" for k in changed)
            errors.append(
                f"{keys} set but model.rope_scaling = {m.rope_scaling.value}, which reads no "
                "yarn key; set --model.rope_scaling yarn or drop them"
            )
    if m.rope_scaling is RopeScaling.NONE:
        return
    if m.position_embedding is not PositionEmbedding.ROPE:
        errors.append(
            f"model.rope_scaling = {m.rope_scaling.value} scales rotary positions, but "
            "model.position_embedding = learned; set model.position_embedding = rope or "
            "model.rope_scaling = none"
        )
    require_positive(errors, "model.rope_original_max_positions", m.rope_original_max_positions)
    if m.rope_scaling is RopeScaling.YARN:
        if m.rope_beta_fast < m.rope_beta_slow:  # each > 0: ptdp/rules/domains.py
            errors.append(
                f"model.rope_beta_fast = {m.rope_beta_fast} must be at least "
                f"model.rope_beta_slow = {m.rope_beta_slow} (rotations over the original "
                "context; YaRN: 32 and 1, Kimi K2: 1 and 1)"
            )
    elif m.rope_high_freq_factor <= m.rope_low_freq_factor:
        errors.append(
            f"model.rope_high_freq_factor = {m.rope_high_freq_factor} must exceed "
            f"model.rope_low_freq_factor = {m.rope_low_freq_factor} (Llama 3.1: 4 and 1)"
        )


def _divisor(n: int) -> int:
    return next(d for d in (8, 4, 2, 1) if n % d == 0)
