"""Published open models as `--model NAME` presets of `ptdp train`, `simulate` and `plan`.

Shapes from each model's published `config.json` (Hugging Face model cards): Llama 3
and 3.1 (Grattafiori et al. 2024, arXiv 2407.21783), Qwen2.5 (arXiv 2412.15115) and
Mistral 7B v0.1 (Jiang et al. 2023, arXiv 2310.06825). `seq_length` is the context each
was pretrained at (Llama 3: 8192; Qwen2.5: 4096 before its long-context stage; Mistral:
8192 with a 4096-token sliding window), not the longest it serves; override it with
--model.seq_length. The paper's GPTs are in `ptdp.perf.validate.paper`.

Mixtures of experts, from their `config.json` likewise: Mixtral 8x7B (Jiang et al. 2024,
arXiv 2401.04088; 32768-token context), Qwen3-30B-A3B and Qwen3-235B-A22B (Qwen3
technical report, arXiv 2505.09388; 4096 tokens in its first two pretraining stages)
and DeepSeek-V3 (arXiv 2412.19437; 4096 tokens before its context extension). The Qwen3
presets take the published head_dim = 128 (model.head_size, apart from hidden / heads)
and the per-head q/k RMSNorm (model.qk_norm): 30.53B total and 3.35B active parameters
for qwen3-30b-a3b, 235.09B and 22.19B for qwen3-235b-a22b, as published (30.5B and 3.3B,
235B and 22B). Where ptdp's model cannot express a published shape, the preset says what
differs:

- deepseek-v3-moe is DeepSeek-V3's mixture of experts (61 layers, h 7168, 256 routed
  experts of width 2048, top-8, one shared expert, 3 dense layers of width 18432, sigmoid
  scores renormalised and scaled by 2.5, the bias update of its auxiliary-loss-free
  balancing, its node-limited group routing: 8 groups, 4 per token) with ordinary
  multi-head attention (128 heads of 56, its config.json's 128 key/value heads) standing
  in for Multi-head Latent Attention, and without its sequence-wise balancing loss and its
  multi-token-prediction module. Its attention holds 205,520,896 parameters a
  layer against MLA's 187,107,328, so it counts 672.1B total and 38.7B active against the
  published 671B and 37B (MLA's count gives 671.0B and 37.6B).
"""

from __future__ import annotations

from typing import Any

from ptdp.config.files import apply_updates
from ptdp.config.sections import ModelConfig, RunConfig

_LLAMA = {
    "position_embedding": "rope",
    "normalization": "rmsnorm",
    "activation": "swiglu",
    "tie_embeddings": False,
    "bias": False,
    "dropout": 0.0,
}
_LLAMA3 = _LLAMA | {"vocab_size": 128256, "rope_theta": 500000.0, "seq_length": 8192}
_LLAMA31 = _LLAMA3 | {
    "rope_scaling": "llama3",
    "rope_scaling_factor": 8.0,
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
    "rope_original_max_positions": 8192,
}


def _shape(layers: int, hidden: int, heads: int, groups: int, ffn: int) -> dict[str, int]:
    return {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_heads": heads,
        "num_query_groups": groups,
        "ffn_hidden_size": ffn,
    }


def _moe(experts: int, top_k: int, width: int, **keys: Any) -> dict[str, Any]:
    return {"num_experts": experts, "moe_top_k": top_k, "moe_ffn_hidden_size": width} | keys


_QWEN3 = _LLAMA | {"vocab_size": 151936, "rope_theta": 1e6, "norm_eps": 1e-6, "seq_length": 4096}
_QWEN3_MOE = _moe(128, 8, 0, moe_renormalize=True, moe_aux_loss_coeff=0.001)

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": _LLAMA3 | _shape(32, 4096, 32, 8, 14336),
    "llama3-70b": _LLAMA3 | _shape(80, 8192, 64, 8, 28672),
    "llama3.1-8b": _LLAMA31 | _shape(32, 4096, 32, 8, 14336),
    "llama3.1-70b": _LLAMA31 | _shape(80, 8192, 64, 8, 28672),
    "llama3.1-405b": _LLAMA31 | _shape(126, 16384, 128, 8, 53248),
    "qwen2.5-7b": _LLAMA
    | _shape(28, 3584, 28, 4, 18944)
    | {"vocab_size": 152064, "rope_theta": 1e6, "norm_eps": 1e-6, "qkv_bias": True}
    | {"seq_length": 4096},
    "mistral-7b": _LLAMA
    | _shape(32, 4096, 32, 8, 14336)
    | {"vocab_size": 32000, "rope_theta": 10000.0, "sliding_window": 4096, "seq_length": 8192},
    "mixtral-8x7b": _LLAMA
    | _shape(32, 4096, 32, 8, 14336)
    | {"vocab_size": 32000, "rope_theta": 1e6, "seq_length": 32768}
    | _moe(8, 2, 14336, moe_softmax_after_topk=True, moe_aux_loss_coeff=0.02),
    "qwen3-30b-a3b": _QWEN3
    | _shape(48, 2048, 32, 4, 6144)
    | {"head_size": 128, "qk_norm": True}
    | _QWEN3_MOE
    | {"moe_ffn_hidden_size": 768},
    "qwen3-235b-a22b": _QWEN3
    | _shape(94, 4096, 64, 4, 12288)
    | {"head_size": 128, "qk_norm": True}
    | _QWEN3_MOE
    | {"moe_ffn_hidden_size": 1536},
    "deepseek-v3-moe": _LLAMA
    | _shape(61, 7168, 128, 128, 18432)
    | {"vocab_size": 129280, "rope_theta": 10000.0, "norm_eps": 1e-6, "seq_length": 4096}
    | _moe(256, 8, 2048, moe_score_function="sigmoid", moe_renormalize=True)
    | {"moe_routed_scaling": 2.5, "moe_bias_update_rate": 0.001}
    | {"moe_shared_experts": 1, "moe_first_dense_layers": 3}
    | {"moe_router_groups": 8, "moe_router_group_top_k": 4},
}
"""name -> model section, as a TOML file would spell it."""


def model_preset(name: str) -> ModelConfig:
    """A published model's shape as a ModelConfig (`MODEL_PRESETS`)."""
    if name not in MODEL_PRESETS:
        raise KeyError(f"unknown model {name!r}; presets: {', '.join(MODEL_PRESETS)}")
    return apply_updates(RunConfig(), {"model": MODEL_PRESETS[name]}, f"preset {name}").model
