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
and the DeepSeek-V3 family below. The Qwen3
presets take the published head_dim = 128 (model.head_size, apart from hidden / heads)
and the per-head q/k RMSNorm (model.qk_norm): 30.53B total and 3.35B active parameters
for qwen3-30b-a3b, 235.09B and 22.19B for qwen3-235b-a22b, as published (30.5B and 3.3B,
235B and 22B).

Multi-head latent attention (model.attention = mla), each with its YaRN rotary scaling as
published and 4096 tokens, the context each was pretrained at before its extension:

- deepseek-v3 (arXiv 2412.19437; DeepSeek-R1 and V3.1 share the shape): 61 layers, h 7168,
  128 heads, q_lora 1536, kv_lora 512, keys of 128 + 64, values of 128; 256 routed experts
  of width 2048, 8 per token from 4 of 8 groups, one shared, 3 dense layers of width
  18432; sigmoid scores renormalised and scaled by 2.5, the auxiliary-loss-free balancing's
  bias update at the paper's 0.001. 671.0B total and 37.6B active (published: 671B, 37B),
  without the 14B of its multi-token-prediction module (below).
- kimi-k2 (Kimi K2 technical report, arXiv 2507.20534): DeepSeek-V3's shape with 64 heads,
  384 experts, one dense layer, no groups, scaling 2.827, rope_theta 50000, yarn 32x;
  1026.4B total and 32.9B active (the model card: 1T and 32B; some accounts give 1.04T,
  which this count does not reach); the bias update rate is DeepSeek-V3's (its config does
  not give one).
- deepseek-v2-lite (arXiv 2405.04434): 27 layers, h 2048, 16 heads, queries not compressed
  (q_lora 0), kv_lora 512; 64 experts of width 1408, 6 per token, two shared, one dense
  layer of width 10944, softmax scores, the auxiliary loss at 0.001. 15.7B total and 2.7B
  active (published: 15.7B, and 2.4B, which leaves out the embedding's 0.2B).

Their multi-token-prediction modules are left out (model.mtp_depth = 0, as the published
counts are); --model.mtp_depth 1 adds DeepSeek-V3's (682.6B). DeepSeek-V3's sequence-wise
balancing loss and the device-limited routing of DeepSeek-V2 are not built.
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


def _mla(q_lora: int, kv_lora: int) -> dict[str, Any]:
    """DeepSeek's latent attention: keys of 128 position-free and 64 rotary features."""
    return {"attention": "mla", "q_lora_rank": q_lora, "kv_lora_rank": kv_lora} | {
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    }


def _yarn(factor: float, beta_fast: float, mscale: float, mscale_all_dim: float) -> dict[str, Any]:
    return {
        "rope_scaling": "yarn",
        "rope_scaling_factor": factor,
        "rope_original_max_positions": 4096,
        "rope_beta_fast": beta_fast,
        "rope_beta_slow": 1.0,
        "rope_mscale": mscale,
        "rope_mscale_all_dim": mscale_all_dim,
    }


_DEEPSEEK_V3 = (
    _LLAMA
    | _shape(61, 7168, 128, 0, 18432)
    | _mla(1536, 512)
    | {"vocab_size": 129280, "rope_theta": 10000.0, "norm_eps": 1e-6, "seq_length": 4096}
    | _yarn(40.0, 32.0, 1.0, 1.0)
    | _moe(256, 8, 2048, moe_score_function="sigmoid", moe_renormalize=True)
    | {"moe_routed_scaling": 2.5, "moe_bias_update_rate": 0.001}
    | {"moe_shared_experts": 1, "moe_first_dense_layers": 3}
    | {"moe_router_groups": 8, "moe_router_group_top_k": 4}
)

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
    "deepseek-v3": _DEEPSEEK_V3,
    "kimi-k2": _DEEPSEEK_V3
    | {"num_heads": 64, "vocab_size": 163840, "rope_theta": 50000.0}
    | _yarn(32.0, 1.0, 1.0, 1.0)
    | {"num_experts": 384, "moe_first_dense_layers": 1, "moe_routed_scaling": 2.827}
    | {"moe_router_groups": 0, "moe_router_group_top_k": 0},
    "deepseek-v2-lite": _LLAMA
    | _shape(27, 2048, 16, 0, 10944)
    | _mla(0, 512)
    | {"vocab_size": 102400, "rope_theta": 10000.0, "norm_eps": 1e-6, "seq_length": 4096}
    | _yarn(40.0, 32.0, 0.707, 0.707)
    | _moe(64, 6, 1408, moe_aux_loss_coeff=0.001)
    | {"moe_shared_experts": 2, "moe_first_dense_layers": 1},
}
"""name -> model section, as a TOML file would spell it."""


def model_preset(name: str) -> ModelConfig:
    """A published model's shape as a ModelConfig (`MODEL_PRESETS`)."""
    if name not in MODEL_PRESETS:
        raise KeyError(f"unknown model {name!r}; presets: {', '.join(MODEL_PRESETS)}")
    return apply_updates(RunConfig(), {"model": MODEL_PRESETS[name]}, f"preset {name}").model
