"""Published open models as `--model NAME` presets of `ptdp train`, `simulate` and `plan`.

Shapes from each model's published `config.json` (Hugging Face model cards): Llama 3
and 3.1 (Grattafiori et al. 2024, arXiv 2407.21783), Qwen2.5 (arXiv 2412.15115) and
Mistral 7B v0.1 (Jiang et al. 2023, arXiv 2310.06825). `seq_length` is the context each
was pretrained at (Llama 3: 8192; Qwen2.5: 4096 before its long-context stage; Mistral:
8192 with a 4096-token sliding window), not the longest it serves; override it with
--model.seq_length. The paper's GPTs are in `ptdp.perf.validate.paper`.
"""

from __future__ import annotations

from typing import Any

from ptdp.config import ModelConfig, RunConfig, apply_updates

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
}
"""name -> model section, as a TOML file would spell it."""


def model_preset(name: str) -> ModelConfig:
    """A published model's shape as a ModelConfig (`MODEL_PRESETS`)."""
    if name not in MODEL_PRESETS:
        raise KeyError(f"unknown model {name!r}; presets: {', '.join(MODEL_PRESETS)}")
    return apply_updates(RunConfig(), {"model": MODEL_PRESETS[name]}, f"preset {name}").model
