"""`transformers` config.json <-> ptdp ModelConfig, for `ptdp convert` (see convert/hf.py).

A model with learned positions maps to GPT-2; a mixture of experts to Qwen3-MoE with
per-head q/k norms (model.qk_norm), else to Mixtral; a dense rotary one to Qwen3 with q/k
norms, to Qwen2 when only its QKV projection has a bias, to Mistral when it has a sliding
window, else to Llama. An option the target family has no equivalent for is refused with
its name.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ptdp.config.enums import (
    Activation,
    Normalization,
    PositionEmbedding,
    RopeScaling,
    ScoreFunction,
)
from ptdp.config.sections import ModelConfig
from ptdp.convert import hf_deepseek as deepseek
from ptdp.errors import ConfigError

TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
"""`transformers` activations that are GeLU's tanh approximation (ptdp's GeLU)."""

NAMES = {
    "gpt2": "GPT-2",
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mixtral": "Mixtral",
    "qwen3_moe": "Qwen3-MoE",
    "deepseek_v3": "DeepSeek-V3",
    "kimi_k2": "Kimi K2",
    "deepseek_v2": "DeepSeek-V2",
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
}
MOE_FAMILIES = ("mixtral", "qwen3_moe")
SHARED_GATE = "a shared expert scaled by a sigmoid gate (shared_expert_gate), which ptdp's lack"
UNCONVERTED_MOE = {
    "qwen2_moe": SHARED_GATE,
    "qwen3_next": SHARED_GATE + ", and linear attention",
    "gpt_oss": "a router with a bias, and biased, clamped experts",
    "olmoe": "per-layer q/k norms over the whole width",
    "phimoe": "sparse-mixer routing",
    "dbrx": "fused, clipped attention",
    "granitemoe": "scaled embeddings, residuals and logits",
    "llama4": "chunked attention and a shared expert",
    "jamba": "Mamba layers",
}
"""Mixture-of-experts model types ptdp does not convert, with what ptdp lacks."""
LLAMA3_KEYS = {
    "factor": "rope_scaling_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_positions",
}
"""`transformers`' llama3 rope_scaling keys -> ptdp's model keys."""
YARN_KEYS = {
    "factor": "rope_scaling_factor",
    "original_max_position_embeddings": "rope_original_max_positions",
    "beta_fast": "rope_beta_fast",
    "beta_slow": "rope_beta_slow",
    "mscale": "rope_mscale",
    "mscale_all_dim": "rope_mscale_all_dim",
}
"""`transformers`' yarn rope_scaling keys -> ptdp's model keys."""


def family(cfg: ModelConfig) -> str:
    """The family (a key of NAMES) that `cfg` exports to; refuses what it lacks."""
    if cfg.is_mla:
        kind, why = deepseek.export_family(cfg)
        _check(cfg, kind, why, deepseek.export_family_checks(cfg, kind))
        return kind
    if cfg.num_experts:
        return _moe_family(cfg)
    if cfg.position_embedding is PositionEmbedding.LEARNED:
        kind, why = "gpt2", "model.position_embedding = learned"
        wanted = {"normalization": Normalization.LAYERNORM, "activation": Activation.GELU}
        wanted |= {"bias": True, "num_query_groups": cfg.num_heads, "sliding_window": 0}
        wanted |= {"qk_norm": False, "head_size": 0}
    else:
        wanted = {"normalization": Normalization.RMSNORM, "activation": Activation.SWIGLU}
        if cfg.qk_norm:
            kind, why = "qwen3", "model.qk_norm = true"
            wanted |= {"bias": False, "qkv_bias": False}
        elif cfg.qkv_bias and not cfg.bias:
            kind, why = "qwen2", "model.qkv_bias = true with model.bias = false"
        elif cfg.sliding_window:
            kind, why = "mistral", f"model.sliding_window = {cfg.sliding_window}"
            wanted["bias"] = False
        else:
            kind, why = "llama", "model.position_embedding = rope"
    _check(cfg, kind, why, wanted)
    return kind


def _moe_family(cfg: ModelConfig) -> str:
    """Mixtral, or Qwen3-MoE with model.qk_norm; their routers and experts are the same but
    for the order of softmax and top-k, and which layers are dense."""
    wanted: dict[str, object] = {
        "position_embedding": PositionEmbedding.ROPE,
        "normalization": Normalization.RMSNORM,
        "activation": Activation.SWIGLU,
        "bias": False,
        "qkv_bias": False,
        "moe_score_function": ScoreFunction.SOFTMAX,
        "moe_routed_scaling": 1.0,
        "moe_shared_experts": 0,
        "moe_bias_update_rate": 0.0,
        "moe_router_groups": 0,
    }
    if cfg.qk_norm:
        kind, why = "qwen3_moe", f"model.num_experts = {cfg.num_experts} with model.qk_norm"
    else:
        kind, why = "mixtral", f"model.num_experts = {cfg.num_experts} without model.qk_norm"
        wanted |= {"moe_first_dense_layers": 0, "moe_layer_freq": 1}
        if not cfg.moe_softmax_after_topk:  # softmax, top-k, renormalise: the same weights
            wanted["moe_renormalize"] = True
    _check(cfg, kind, why, wanted)
    return kind


def _check(cfg: ModelConfig, kind: str, why: str, wanted: dict[str, object]) -> None:
    got = {k: cfg.query_groups if k == "num_query_groups" else getattr(cfg, k) for k in wanted}
    bad = [k for k in wanted if got[k] != wanted[k]]
    if bad:
        have = ", ".join(f"model.{k} = {_show(got[k])}" for k in bad)
        need = ", ".join(f"{_show(wanted[k])}" for k in bad)
        raise ConfigError(
            f"cannot export to Hugging Face: {why} maps to {NAMES[kind]}, which has no "
            f"equivalent of {have} (it needs {need})"
        )


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
    kind = family(cfg)
    if kind == "gpt2":
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
    rotary = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.query_groups,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": _max_positions(cfg),
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "hidden_act": "silu",
        "attention_dropout": cfg.dropout,
    } | _rope_scaling(cfg)
    window = cfg.sliding_window or None
    if kind == "llama":
        rotary |= {"attention_bias": cfg.bias, "mlp_bias": cfg.bias}
    elif kind in ("mistral", "mixtral"):
        rotary |= {"sliding_window": window}
    elif kind == "qwen3_moe":  # every layer slides, or none
        rotary |= {"use_sliding_window": bool(window), "sliding_window": window}
    else:  # Qwen2/3 slide from layer max_window_layers on: from the first, as ptdp does
        layer = "sliding_attention" if window else "full_attention"
        rotary |= {"use_sliding_window": bool(window), "sliding_window": window}
        rotary |= {"max_window_layers": 0, "layer_types": [layer] * cfg.num_layers}
    if kind in ("qwen3", "qwen3_moe"):
        rotary["attention_bias"] = False
    if kind in deepseek.MLA_TYPES:
        rotary |= deepseek.hf_options(cfg, kind)
    if kind == "mixtral":
        rotary |= {"num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_top_k}
        rotary |= {"intermediate_size": cfg.moe_ffn_size, "router_jitter_noise": 0.0}
    elif kind == "qwen3_moe":
        dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
        rotary |= {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_top_k}
        rotary |= {"moe_intermediate_size": cfg.moe_ffn_size, "decoder_sparse_step": 1}
        rotary |= {"mlp_only_layers": dense}
        # Softmax over the top-k logits = softmax over all, top-k, renormalised.
        rotary["norm_topk_prob"] = cfg.moe_renormalize or cfg.moe_softmax_after_topk
    return rotary | common


def _max_positions(cfg: ModelConfig) -> int:
    """The training context, or the context llama3 or yarn scaling stretches the model to
    (Llama 3.1: 8192 x 8 = 131072), whichever is longer."""
    if cfg.rope_scaling is not RopeScaling.NONE:
        stretched = round(cfg.rope_original_max_positions * cfg.rope_scaling_factor)
        return max(cfg.seq_length, stretched)
    return cfg.seq_length


def _rope_scaling(cfg: ModelConfig) -> dict[str, Any]:
    """The `rope_scaling` entry (the spelling both transformers 4 and 5 read), if any."""
    if cfg.rope_scaling is RopeScaling.NONE:
        return {}
    keys = YARN_KEYS if cfg.rope_scaling is RopeScaling.YARN else LLAMA3_KEYS
    scaling = {theirs: getattr(cfg, ours) for theirs, ours in keys.items()}
    return {"rope_scaling": {"rope_type": cfg.rope_scaling.value, **scaling}}


def model_config_from_hf(config: dict[str, Any], seq_length: int = 0) -> ModelConfig:
    """The ptdp model equivalent to a `transformers` `config.json`; refuses what has none.

    `seq_length` (0 = the model's maximum) sets the training context; learned positions
    keep the table's first `seq_length` rows.
    """
    kind = config.get("model_type")
    if kind not in NAMES:
        known = ", ".join(repr(k) for k in NAMES)
        moe = UNCONVERTED_MOE.get(kind)
        why = f" (a mixture of experts with {moe})" if moe else ""
        raise ConfigError(
            f"cannot import model_type {kind!r}{why}: ptdp converts {known}; its mixtures of "
            "experts are 'mixtral', 'qwen3_moe' and the DeepSeek ones"
        )
    cfg = (_gpt2_config if kind == "gpt2" else _rotary_config)(config, seq_length)
    # Leave widths that equal ptdp's defaults at 0 (automatic), as a hand-written config would.
    if cfg.ffn_size == replace(cfg, ffn_hidden_size=0).ffn_size:
        cfg = replace(cfg, ffn_hidden_size=0)
    return replace(cfg, num_query_groups=0) if cfg.query_groups == cfg.num_heads else cfg


def _refuse(kind: str, bad: dict[str, object]) -> None:
    if bad:
        have = ", ".join(f"{k} = {v!r}" for k, v in bad.items())
        raise ConfigError(
            f"cannot import this {kind} model: ptdp has no equivalent of {have}, so it would "
            f"compute another model; only {kind} models without it convert"
        )


def _context(seq_length: int, maximum: int) -> int:
    if seq_length < 0:
        raise ConfigError(
            f"--seq-length {seq_length} must be >= 1, or 0 for the model's {maximum} positions"
        )
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


def _rotary_config(c: dict[str, Any], seq_length: int) -> ModelConfig:
    """Llama, Mistral, Qwen2, Qwen3, Mixtral or Qwen3-MoE (`c["model_type"]`): one model with
    six sets of options."""
    kind = c["model_type"]
    h, n = c["hidden_size"], c["num_attention_heads"]
    bad: dict[str, object] = {}
    if c.get("hidden_act", "silu") != "silu":
        bad["hidden_act"] = c["hidden_act"]
    head = c.get("head_dim") or h // n
    if kind == "llama" and c.get("attention_bias", False) != c.get("mlp_bias", False):
        bad["attention_bias != mlp_bias"] = (c["attention_bias"], c["mlp_bias"])
    qwen3 = kind in ("qwen3", "qwen3_moe")
    mla = deepseek.model_options(c, bad) if kind in deepseek.MLA_TYPES else {}
    if qwen3 and c.get("attention_bias", False):
        bad["attention_bias"] = True  # biases on q, k, v and o but not the MLP
    rope = _rope_options(c, bad)
    window = _sliding_window(c, bad)
    moe = _moe_options(c, bad) if kind in MOE_FAMILIES else {}
    _refuse(NAMES[kind], bad)
    return ModelConfig(
        num_layers=c["num_hidden_layers"],
        hidden_size=h,
        num_heads=n,
        num_query_groups=0 if mla else c.get("num_key_value_heads") or n,
        head_size=0 if mla or head * n == h else head,
        qk_norm=qwen3,
        ffn_hidden_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        seq_length=_context(seq_length, c.get("max_position_embeddings", 2048)),
        position_embedding=PositionEmbedding.ROPE,
        normalization=Normalization.RMSNORM,
        norm_eps=c.get("rms_norm_eps", 1e-6),
        activation=Activation.SWIGLU,
        tie_embeddings=c.get("tie_word_embeddings", False),
        bias=kind == "llama" and c.get("attention_bias", False),
        qkv_bias=kind == "qwen2",
        sliding_window=window,
        dropout=c.get("attention_dropout", 0.0),
        init_std=c.get("initializer_range", 0.02),
        **rope,
        **moe,
        **mla,
    )


def _moe_options(c: dict[str, Any], bad: dict[str, object]) -> dict[str, Any]:
    """The model.moe_* keys of Mixtral (softmax over the top-k logits; every layer) or
    Qwen3-MoE (softmax, top-k, renormalised with norm_topk_prob; its dense layers are
    mlp_only_layers and those off decoder_sparse_step, as first dense layers and a period)."""
    # Mixtral's config.json names the experts num_local_experts, Qwen3-MoE's num_experts;
    # transformers 5 writes num_local_experts for both.
    experts = c["num_local_experts"] if "num_local_experts" in c else c["num_experts"]
    if c["model_type"] == "mixtral":
        if c.get("router_jitter_noise", 0.0):
            bad["router_jitter_noise"] = c["router_jitter_noise"]
        return {
            "num_experts": experts,
            "moe_top_k": c["num_experts_per_tok"],
            "moe_softmax_after_topk": True,
        }
    layers = c["num_hidden_layers"]
    dense_only, step = set(c.get("mlp_only_layers") or ()), c.get("decoder_sparse_step", 1)
    moe = [i not in dense_only and (i + 1) % step == 0 for i in range(layers)]
    first, freq = _layer_pattern(moe)
    if first < 0:
        bad["mlp_only_layers and decoder_sparse_step"] = (sorted(dense_only), step)
    options = {
        "num_experts": experts,
        "moe_top_k": c["num_experts_per_tok"],
        "moe_ffn_hidden_size": c["moe_intermediate_size"],
        "moe_renormalize": bool(c.get("norm_topk_prob", False)),
    }
    if any(moe):  # a model with no MoE layer stays dense
        options |= {"moe_first_dense_layers": max(first, 0), "moe_layer_freq": freq}
    else:
        options = {"num_experts": 0}
    return options


def _layer_pattern(moe: list[bool]) -> tuple[int, int]:
    """(first dense layers, period) whose MoE layers are `moe`'s; (-1, 1) if none is."""
    n = len(moe)
    for first in range(n + 1):
        for freq in range(1, n + 1):
            if all(moe[i] == (i >= first and (i - first) % freq == 0) for i in range(n)):
                return first, freq
    return -1, 1


def _rope_options(c: dict[str, Any], bad: dict[str, object]) -> dict[str, Any]:
    """ptdp's rope_* keys from `rope_parameters` (transformers 5) or `rope_scaling` and
    `rope_theta` (transformers 4, most published config.json files)."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    options: dict[str, Any] = {
        "rope_theta": float(rope.get("rope_theta", c.get("rope_theta", 1e4)))
    }
    if rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        bad["partial_rotary_factor"] = rope.get("partial_rotary_factor")
    if kind == "llama3":
        missing = [k for k in LLAMA3_KEYS if k not in rope]
        if missing:
            bad[f"rope_type = 'llama3' without {', '.join(missing)}"] = rope
        options["rope_scaling"] = RopeScaling.LLAMA3
        options |= {ours: rope[theirs] for theirs, ours in LLAMA3_KEYS.items() if theirs in rope}
    elif kind == "yarn":
        options |= _yarn_options(c, rope, bad)
    elif kind != "default":
        bad["rope_type"] = kind
    return options


def _yarn_options(c: dict[str, Any], rope: dict[str, Any], bad: dict[str, object]) -> dict:
    """ptdp's yarn keys, read as `transformers` reads them: the original context defaults to
    max_position_embeddings, a missing factor is their ratio, a missing or null beta or
    mscale takes its default; an explicit attention_factor or truncate = false has no ptdp
    equivalent."""
    if rope.get("attention_factor") is not None:
        bad["rope_scaling attention_factor (ptdp derives it from factor and mscale)"] = rope
    if rope.get("truncate", True) is not True:
        bad["rope_scaling truncate = false"] = rope
    original = rope.get("original_max_position_embeddings") or c["max_position_embeddings"]
    factor = rope.get("factor") or c["max_position_embeddings"] / original
    return {
        "rope_scaling": RopeScaling.YARN,
        "rope_scaling_factor": float(factor),
        "rope_original_max_positions": int(original),
        "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
        "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
        "rope_mscale": float(rope.get("mscale") or 0.0),
        "rope_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
    }


def _sliding_window(c: dict[str, Any], bad: dict[str, object]) -> int:
    """Mistral's `sliding_window`; Qwen2's when every layer slides (`layer_types`)."""
    window = c.get("sliding_window") or 0
    if c["model_type"] in ("mistral", "mixtral"):
        return window
    if c["model_type"] == "qwen3_moe":  # every layer slides, or none
        return window if c.get("use_sliding_window", False) else 0
    if c["model_type"] == "llama" or not c.get("use_sliding_window", False) or not window:
        return 0
    first = c.get("max_window_layers", 0)
    layers = c.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention"
        for i in range(c["num_hidden_layers"])
    ]
    if set(layers) == {"sliding_attention"}:
        return window
    if "sliding_attention" in layers:
        bad["layer_types mixing sliding and full attention"] = layers
    return 0
