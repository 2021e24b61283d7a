"""`transformers` config.json <-> ptdp ModelConfig, for `ptdp convert` (see convert/hf.py).

A model with learned positions maps to GPT-2 and one with rotary positions to Llama; an
option the target family has no equivalent for is refused with its name.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ptdp.config import Activation, ModelConfig, Normalization, PositionEmbedding
from ptdp.errors import ConfigError

TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
"""`transformers` activations that are GeLU's tanh approximation (ptdp's GeLU)."""


def family(cfg: ModelConfig) -> str:
    """The family, "gpt2" or "llama", by position embedding; refuses what it lacks."""
    if cfg.position_embedding is PositionEmbedding.LEARNED:
        kind, name = "gpt2", "GPT-2"
        wanted = {"normalization": Normalization.LAYERNORM, "activation": Activation.GELU}
        wanted |= {"bias": True, "num_query_groups": cfg.num_heads}
    else:
        kind, name = "llama", "Llama"
        wanted = {"normalization": Normalization.RMSNORM, "activation": Activation.SWIGLU}
    got = {k: cfg.query_groups if k == "num_query_groups" else getattr(cfg, k) for k in wanted}
    bad = [k for k in wanted if got[k] != wanted[k]]
    if bad:
        have = ", ".join(f"model.{k} = {_show(got[k])}" for k in bad)
        need = ", ".join(f"{_show(wanted[k])}" for k in bad)
        raise ConfigError(
            f"cannot export to Hugging Face: model.position_embedding = "
            f"{cfg.position_embedding.value} maps to {name}, which has no equivalent of "
            f"{have} (it needs {need})"
        )
    return kind


def _show(value: object) -> str:
    return str(getattr(value, "value", value)).lower()


def hf_config(cfg: ModelConfig, eod_id: int | None = None) -> dict[str, Any]:
    """The `config.json` of the `transformers` model equivalent to `cfg`."""
    common = {
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": eod_id,
        "eos_token_id": eod_id,
        "torch_dtype": "float32",
    }
    if family(cfg) == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_positions": cfg.seq_length,
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads,
            "n_inner": cfg.ffn_size,
            "activation_function": "gelu_pytorch_tanh",
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        } | common
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.query_groups,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "hidden_act": "silu",
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": cfg.dropout,
    } | common


def model_config_from_hf(config: dict[str, Any], seq_length: int = 0) -> ModelConfig:
    """The ptdp model equivalent to a `transformers` `config.json`; refuses what has none.

    `seq_length` (0 = the model's maximum) sets the training context; learned positions
    keep the table's first `seq_length` rows.
    """
    kind = config.get("model_type")
    if kind not in ("gpt2", "llama"):
        raise ConfigError(f"cannot import model_type {kind!r}: ptdp converts 'gpt2' and 'llama'")
    cfg = (_gpt2_config if kind == "gpt2" else _llama_config)(config, seq_length)
    # Leave widths that equal ptdp's defaults at 0 (automatic), as a hand-written config would.
    if cfg.ffn_size == replace(cfg, ffn_hidden_size=0).ffn_size:
        cfg = replace(cfg, ffn_hidden_size=0)
    return replace(cfg, num_query_groups=0) if cfg.query_groups == cfg.num_heads else cfg


def _refuse(kind: str, bad: dict[str, object]) -> None:
    if bad:
        have = ", ".join(f"{k} = {v!r}" for k, v in bad.items())
        raise ConfigError(f"cannot import this {kind} model: ptdp has no equivalent of {have}")


def _context(seq_length: int, maximum: int) -> int:
    if seq_length > maximum:
        raise ConfigError(f"--seq-length {seq_length} exceeds the model's {maximum} positions")
    return seq_length or maximum


def _gpt2_config(c: dict[str, Any], seq_length: int) -> ModelConfig:
    act = c.get("activation_function", "gelu_new")
    bad = {"activation_function": act} if act not in TANH_GELUS else {}
    for key, ok in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if c.get(key, ok) != ok:
            bad[key] = c[key]
    _refuse("GPT-2", bad)
    return ModelConfig(
        num_layers=c["n_layer"],
        hidden_size=c["n_embd"],
        num_heads=c["n_head"],
        ffn_hidden_size=c.get("n_inner") or 4 * c["n_embd"],
        vocab_size=c["vocab_size"],
        seq_length=_context(seq_length, c["n_positions"]),
        position_embedding=PositionEmbedding.LEARNED,
        normalization=Normalization.LAYERNORM,
        norm_eps=c.get("layer_norm_epsilon", 1e-5),
        activation=Activation.GELU,
        tie_embeddings=c.get("tie_word_embeddings", True),
        bias=True,
        dropout=c.get("resid_pdrop", 0.1),
        init_std=c.get("initializer_range", 0.02),
    )


def _llama_config(c: dict[str, Any], seq_length: int) -> ModelConfig:
    h, n = c["hidden_size"], c["num_attention_heads"]
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    bad = {}
    if c.get("hidden_act", "silu") != "silu":
        bad["hidden_act"] = c["hidden_act"]
    if (c.get("head_dim") or h // n) * n != h:
        bad["head_dim"] = c["head_dim"]  # ptdp's head size is hidden_size / num_heads
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        bad["rope_type"] = rope.get("rope_type", rope.get("type"))
    if c.get("attention_bias", False) != c.get("mlp_bias", False):
        bad["attention_bias != mlp_bias"] = (c["attention_bias"], c["mlp_bias"])
    _refuse("Llama", bad)
    return ModelConfig(
        num_layers=c["num_hidden_layers"],
        hidden_size=h,
        num_heads=n,
        num_query_groups=c.get("num_key_value_heads") or n,
        ffn_hidden_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        seq_length=_context(seq_length, c.get("max_position_embeddings", 2048)),
        position_embedding=PositionEmbedding.ROPE,
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        normalization=Normalization.RMSNORM,
        norm_eps=c.get("rms_norm_eps", 1e-6),
        activation=Activation.SWIGLU,
        tie_embeddings=c.get("tie_word_embeddings", False),
        bias=c.get("attention_bias", False),
        dropout=c.get("attention_dropout", 0.0),
        init_std=c.get("initializer_range", 0.02),
    )
