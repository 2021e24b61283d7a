"""The model rules of `validate`: sizes, heads against the width, rotary positions and
their scaling."""

from __future__ import annotations

from ptdp.config.enums import PositionEmbedding, RopeScaling
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.rules.domains import require_positive

_DEFAULTS = ModelConfig()


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
    ):
        require_positive(errors, f"model.{name}", getattr(m, name), zero_ok=True)
    _rope_scaling_rules(m, errors)
    if len(errors) > before:
        return
    if m.hidden_size % m.num_heads and not m.head_size:
        errors.append(
            f"model.hidden_size = {m.hidden_size} is not divisible by model.num_heads = "
            f"{m.num_heads}; choose heads that divide the width (e.g. {_divisor(m.hidden_size)})"
        )
    elif m.position_embedding is PositionEmbedding.ROPE and m.head_dim % 2:
        errors.append(
            f"rotary positions need an even head size, got {m.head_dim}; change "
            "model.head_size, or model.num_heads or model.hidden_size"
        )
    if m.num_heads % m.query_groups:
        errors.append(
            f"model.num_query_groups = {m.num_query_groups} does not divide model.num_heads = "
            f"{m.num_heads}; use a divisor of the head count (1 = multi-query)"
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
        if m.rope_beta_fast <= m.rope_beta_slow:  # each > 0: ptdp/rules/domains.py
            errors.append(
                f"model.rope_beta_fast = {m.rope_beta_fast} must exceed model.rope_beta_slow "
                f"= {m.rope_beta_slow} (rotations over the original context; YaRN: 32 and 1)"
            )
    elif m.rope_high_freq_factor <= m.rope_low_freq_factor:
        errors.append(
            f"model.rope_high_freq_factor = {m.rope_high_freq_factor} must exceed "
            f"model.rope_low_freq_factor = {m.rope_low_freq_factor} (Llama 3.1: 4 and 1)"
        )


def _divisor(n: int) -> int:
    return next(d for d in (8, 4, 2, 1) if n % d == 0)
