"""DeepSeek-V3, Kimi K2 and DeepSeek-V2 <-> ptdp (`ptdp convert`, `checkpoint.init_from`).

`transformers` reads DeepSeek-V3, R1, V3.1 and Kimi K2 as model type `deepseek_v3` (Kimi
K2's own config.json says `kimi_k2`, read the same) and DeepSeek-V2 / V2-Lite as
`deepseek_v2`: multi-head latent attention (model.attention = mla), the first
`first_k_dense_replace` layers dense and the rest mixtures of experts with shared experts.
V3 scores experts by a sigmoid with a balancing bias (`e_score_correction_bias`, ptdp's
router `expert_bias`) and group-limited routing (n_group, topk_group); V2 by a softmax
(its "greedy" routing; its group-limited kind scores a group by its best expert, ptdp's
by its two best, and is refused). Export writes `deepseek_v3`.

What the mapping has to know (shapes: n heads, p = qk_nope_head_dim, r = qk_rope_head_dim):
- DeepSeek's published weights lay each head's r rotary rows out as interleaved pairs
  (x0, x1), (x2, x3), ... (`rope_interleave`, and V2's complex rotation); ptdp rotates
  halves, [x0, x2, ...; x1, x3, ...]. The rows of q_b_proj (q_proj) per head and of
  kv_a_proj_with_mqa after the latent are permuted so, which leaves every score
  unchanged: queries and keys move alike.
- The published V3 weights are float8 (e4m3) with one `weight_scale_inv` per 128 x 128
  block (config.json `quantization_config`); they are read back to float32 by region
  (`BlockScaled`), so a rank reads only its own blocks.
- The multi-token-prediction layer the published checkpoints append (layer
  num_hidden_layers, `num_nextn_predict_layers`) is not imported: `transformers` ignores
  it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ptdp.checkpoint.lazy import BlockScaled, Joined, Lazy, Permuted
from ptdp.config.enums import AttentionKind, ScoreFunction
from ptdp.config.sections import ModelConfig

MLA_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v2")
SCALE_SUFFIX = "_scale_inv"
V3_BIAS_RATE = 0.001
"""model.moe_bias_update_rate an imported V3 gets (DeepSeek-V3's own): ptdp's router
holds its balancing bias only with a rate, and the published bias must be kept."""


def rope_rows(rope: int) -> tuple[int, ...]:
    """ptdp's row j of a head's rotary part is DeepSeek's row `rope_rows(r)[j]`."""
    half = rope // 2
    return tuple(2 * j if j < half else 2 * (j - half) + 1 for j in range(rope))


def _query_rows(cfg: ModelConfig) -> tuple[int, ...]:
    width, nope = cfg.qk_head_dim, cfg.qk_nope_head_dim
    rope = rope_rows(cfg.qk_rope_head_dim)
    return tuple(
        h * width + (j if j < nope else nope + rope[j - nope])
        for h in range(cfg.num_heads)
        for j in range(width)
    )


def _latent_rows(cfg: ModelConfig) -> tuple[int, ...]:
    c = cfg.kv_lora_rank
    return tuple(range(c)) + tuple(c + j for j in rope_rows(cfg.qk_rope_head_dim))


def _inverse(index: tuple[int, ...]) -> torch.Tensor:
    out = torch.empty(len(index), dtype=torch.long)
    out[torch.tensor(index)] = torch.arange(len(index))
    return out


def dequantized(tensors: Mapping[str, Lazy], config: dict[str, Any]) -> dict[str, Lazy]:
    """The weights of a float8 block-scaled checkpoint as float32 (each `X.weight` with its
    `X.weight_scale_inv`); the others unchanged."""
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return dict(tensors)
    block = tuple(quant.get("weight_block_size") or (128, 128))
    out = {k: v for k, v in tensors.items() if not k.endswith(SCALE_SUFFIX)}
    for name in list(out):
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is not None:
            out[name] = BlockScaled(out[name], scale, block)
    return out


def model_options(c: dict[str, Any], bad: dict[str, object]) -> dict[str, Any]:
    """The ModelConfig keys of a DeepSeek config.json beyond the rotary families' (its
    attention, dense width and experts); what ptdp has no equivalent of goes into `bad`."""
    v3 = c["model_type"] != "deepseek_v2"
    if c.get("attention_bias", False):
        bad["attention_bias"] = True  # biases on q_a, kv_a and o only: not model.bias's
    if c.get("rope_interleave", True) is not True:
        bad["rope_interleave = false"] = False
    layers, first = c["num_hidden_layers"], c.get("first_k_dense_replace") or 0
    options: dict[str, Any] = {
        "attention": AttentionKind.MLA,
        "q_lora_rank": c.get("q_lora_rank") or 0,
        "kv_lora_rank": c["kv_lora_rank"],
        "qk_nope_head_dim": c["qk_nope_head_dim"],
        "qk_rope_head_dim": c["qk_rope_head_dim"],
        "v_head_dim": c["v_head_dim"],
    }
    experts = c.get("n_routed_experts") or 0
    if not experts or first >= layers:
        return options
    if c.get("moe_layer_freq", 1) != 1:
        bad["moe_layer_freq"] = c["moe_layer_freq"]  # transformers: every layer after first
    options |= {
        "num_experts": experts,
        "moe_top_k": c["num_experts_per_tok"],
        "moe_ffn_hidden_size": c["moe_intermediate_size"],
        "moe_shared_experts": c.get("n_shared_experts") or 0,
        "mtp_depth": _mtp_layers(c),
        "moe_first_dense_layers": first,
        "moe_renormalize": bool(c.get("norm_topk_prob", v3)),
        "moe_routed_scaling": float(c.get("routed_scaling_factor", 1.0)),
    }
    groups, top = c.get("n_group") or 1, c.get("topk_group") or 1
    if v3:
        if c.get("scoring_func", "sigmoid") != "sigmoid":
            bad["scoring_func"] = c["scoring_func"]
        if c.get("topk_method", "noaux_tc") != "noaux_tc":
            bad["topk_method"] = c["topk_method"]
        options |= {"moe_score_function": ScoreFunction.SIGMOID}
        options["moe_bias_update_rate"] = V3_BIAS_RATE
        if groups > 1:
            options |= {"moe_router_groups": groups, "moe_router_group_top_k": top}
    elif c.get("topk_method", "greedy") != "greedy" and groups > 1:
        bad["topk_method"] = c["topk_method"]  # scores a group by its best expert
    return options


def export_family(cfg: ModelConfig) -> tuple[str, str]:
    """(model type, why) an MLA model exports as: V2 routes by a softmax, V3 by a sigmoid."""
    if cfg.num_experts and cfg.moe_score_function is ScoreFunction.SOFTMAX:
        return "deepseek_v2", "model.attention = mla with softmax routing"
    return "deepseek_v3", "model.attention = mla"


def hf_options(cfg: ModelConfig, kind: str) -> dict[str, Any]:
    """The `deepseek_v3` or `deepseek_v2` config.json keys of an MLA model beyond the
    rotary families'."""
    moe = cfg.num_experts > 0
    first = cfg.moe_first_dense_layers if moe else cfg.num_layers
    v2 = {"topk_method": "greedy"} if kind == "deepseek_v2" else {}
    return v2 | {
        "architectures": ["DeepseekV2ForCausalLM" if v2 else "DeepseekV3ForCausalLM"],
        "model_type": kind,
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "head_dim": cfg.qk_rope_head_dim,
        "rope_interleave": True,
        "attention_bias": False,
        "first_k_dense_replace": first,
        "n_routed_experts": cfg.num_experts if moe else 1,
        "num_experts_per_tok": cfg.moe_top_k if moe else 1,
        "moe_intermediate_size": cfg.moe_ffn_size,
        "n_shared_experts": cfg.moe_shared_experts if moe else 1,
        "routed_scaling_factor": cfg.moe_routed_scaling,
        "norm_topk_prob": cfg.moe_renormalize,
        "n_group": cfg.moe_router_groups or 1,
        "topk_group": cfg.moe_router_group_top_k or 1,
        "num_nextn_predict_layers": cfg.mtp_depth,
    }


def export_family_checks(cfg: ModelConfig, kind: str) -> dict[str, object]:
    """The ModelConfig values `kind` needs (key -> wanted value)."""
    wanted: dict[str, object] = {
        "bias": False,
        "tie_embeddings": False,
        "sliding_window": 0,
    }
    if cfg.num_experts:
        wanted |= {"moe_layer_freq": 1, "moe_shared_ffn_hidden_size": 0}
        if kind == "deepseek_v3":
            wanted["moe_score_function"] = ScoreFunction.SIGMOID
        if not cfg.moe_shared_experts:
            wanted["moe_shared_experts"] = 1  # transformers builds one of any width
        if kind == "deepseek_v2":  # softmax over all experts, top-k: no bias, no groups
            wanted |= {"moe_softmax_after_topk": False, "moe_bias_update_rate": 0.0}
            wanted["moe_router_groups"] = 0
    return wanted


def attention_from_hf(cfg: ModelConfig, take, src: str, dst: str) -> dict[str, Lazy]:
    """One layer's latent attention from `transformers`' tensors (`take` marks them used)."""
    attn, ours = src + "self_attn.", dst + "attn."
    out: dict[str, Lazy] = {}
    if cfg.q_lora_rank:
        out[ours + "q_down.weight"] = take(attn + "q_a_proj.weight")
        out[ours + "q_norm.weight"] = take(attn + "q_a_layernorm.weight")
        q = take(attn + "q_b_proj.weight")
    else:
        q = take(attn + "q_proj.weight")
    out[ours + "q_up.weight"] = Permuted(q, 0, _query_rows(cfg))
    kv = take(attn + "kv_a_proj_with_mqa.weight")
    out[ours + "kv_down.weight"] = Permuted(kv, 0, _latent_rows(cfg))
    out[ours + "kv_norm.weight"] = take(attn + "kv_a_layernorm.weight")
    out[ours + "kv_up.weight"] = take(attn + "kv_b_proj.weight")
    out[ours + "proj.weight"] = take(attn + "o_proj.weight")
    return out


def attention_to_hf(cfg: ModelConfig, model, src: str, dst: str) -> dict[str, torch.Tensor]:
    """Inverse of `attention_from_hf` on whole tensors."""
    ours, attn = src + "attn.", dst + "self_attn."
    out = {}
    q = model[ours + "q_up.weight"].index_select(0, _inverse(_query_rows(cfg)).to(_device(model)))
    if cfg.q_lora_rank:
        out[attn + "q_a_proj.weight"] = model[ours + "q_down.weight"]
        out[attn + "q_a_layernorm.weight"] = model[ours + "q_norm.weight"]
        out[attn + "q_b_proj.weight"] = q
    else:
        out[attn + "q_proj.weight"] = q
    latent = _inverse(_latent_rows(cfg)).to(_device(model))
    out[attn + "kv_a_proj_with_mqa.weight"] = model[ours + "kv_down.weight"].index_select(0, latent)
    out[attn + "kv_a_layernorm.weight"] = model[ours + "kv_norm.weight"]
    out[attn + "kv_b_proj.weight"] = model[ours + "kv_up.weight"]
    out[attn + "o_proj.weight"] = model[ours + "proj.weight"]
    return out


def _device(model) -> torch.device:
    return next(iter(model.values())).device


def moe_extras_from_hf(cfg: ModelConfig, take, src: str, dst: str) -> dict[str, Lazy]:
    """An MoE layer's shared experts and balancing bias."""
    out: dict[str, Lazy] = {}
    if cfg.moe_shared_experts:
        shared = src + "mlp.shared_experts."
        names = ("gate_proj", "up_proj", "down_proj")
        gate, up, down = (take(shared + m + ".weight") for m in names)
        out[dst + "mlp.shared.fc1.weight"] = Joined((gate, up))
        out[dst + "mlp.shared.fc2.weight"] = down
    if cfg.moe_bias_update_rate:
        out[dst + "mlp.router.expert_bias"] = take(src + "mlp.gate.e_score_correction_bias")
    return out


def moe_extras_to_hf(
    cfg: ModelConfig, kind: str, model, src: str, dst: str
) -> dict[str, torch.Tensor]:
    """Inverse of `moe_extras_from_hf`; a model without the bias exports zeros."""
    gate, up = model[src + "mlp.shared.fc1.weight"].chunk(2)
    shared = dst + "mlp.shared_experts."
    out = {shared + "gate_proj.weight": gate, shared + "up_proj.weight": up}
    out[shared + "down_proj.weight"] = model[src + "mlp.shared.fc2.weight"]
    if kind == "deepseek_v2":
        return out
    bias = model.get(src + "mlp.router.expert_bias")
    if bias is None:
        bias = torch.zeros(cfg.num_experts, device=_device(model))
    out[dst + "mlp.gate.e_score_correction_bias"] = bias
    return out


def loadable(
    tensors: Mapping[str, Lazy], config: dict[str, Any], depth: int = 0
) -> dict[str, Lazy]:
    """A DeepSeek checkpoint's tensors as the mapping reads them: float8 weights scaled to
    float32, and without the multi-token-prediction layers after the first `depth` (the
    run's model.mtp_depth) of those the published checkpoints append after the last."""
    tensors = dequantized(tensors, config)
    if config.get("model_type") not in MLA_TYPES:
        return tensors
    layers = config["num_hidden_layers"]
    extra = tuple(f"model.layers.{layers + k}." for k in range(depth, _mtp_layers(config)))
    return {k: v for k, v in tensors.items() if not (extra and k.startswith(extra))}


def import_notes(config: dict[str, Any], depth: int) -> list[str]:
    """What an import of this config.json changes or leaves out, to be said to the user;
    `depth`: the multi-token-prediction layers read (the run's model.mtp_depth)."""
    notes = []
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8":
        block = "x".join(str(n) for n in quant.get("weight_block_size") or (128, 128))
        notes.append(
            f"the float8 weights were dequantized to float32 with their {block} block "
            "scales (weight_scale_inv)"
        )
    named = _mtp_layers(config) if config.get("model_type") in MLA_TYPES else 0
    if depth:
        first = config["num_hidden_layers"]
        notes.append(
            f"the {depth} multi-token-prediction layer(s) from model.layers.{first} became "
            f"model.mtp_depth = {depth}; --model.mtp_depth 0 trains without them"
        )
    if named > depth:
        notes.append(
            f"config.json names {named} multi-token-prediction layer(s), of which "
            f"{named - depth} were not read (not in the weights, or past model.mtp_depth)"
        )
    if config.get("model_type") in ("deepseek_v3", "kimi_k2"):
        notes.append(
            f"model.moe_bias_update_rate = {V3_BIAS_RATE} (DeepSeek-V3's) keeps the imported "
            "balancing bias and trains it; set the rate your run wants"
        )
    return notes


def _mtp_layers(config: dict[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers") or config.get("num_mtp_layers") or 0)
