"""What a rank holds per parameter: parameter and tensor counts per stage and pipeline
rank, and the model state's bytes per parameter as the runtime keeps them
(`ptdp/parallel/buckets.py`, `ptdp/train/step/optim.py`; ZeRO levels in `ptdp.perf.cost.memory`'s
module doc). Pure arithmetic on the model config: the planner calls it for every layout.

A layer's attention holds QKV [h, a d + 2 g d] and the projection [a d, h]: the queries
are a d wide (`attention_width`), h unless model.head_size sets the heads apart (Qwen3),
and model.qk_norm adds a norm over d for the queries and one for the keys.

A mixture-of-experts layer (`ModelConfig.is_moe_layer`) holds, for its MLP, a router
[e, h] (replicated), e routed experts of width moe_ffn and the shared experts' MLP, each
the shared experts' MLP split over t like the dense MLP. The routed experts follow their own
layout (parallel folding, `ptdp.perf.cost.folding`): e / ep of them on a rank
(`routed_parameters`), each split over etp (not t); their gradients are reduced, and ZeRO
shards their state, over the edp = t cp d / (ep etp) ranks holding the same experts
(`expert_parameters_per_stage` gives that part apart). `etp` None means etp = t: the
experts split like the dense layers, as before folding. `model_size` gives the total and
active (per token) parameters as publishers count them.

Letters: h = hidden, a = heads, d = head size, g = key/value groups, f = MLP width,
v = vocabulary, t = tensor-parallel size, e = routed experts, k = experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.config.enums import Activation, Normalization, PositionEmbedding, Precision
from ptdp.config.sections import ModelConfig
from ptdp.config.shapes import (
    attention_linears,
    attention_replicated_weights,
    attention_split_weights,
    latent_widths,
)
from ptdp.perf.cost.moe import moe_layers_per_stage
from ptdp.pipeline.placement import Placement, StageMap


@dataclass(frozen=True)
class StateBytes:
    """Bytes per local parameter of the model state."""

    params: float
    grads: float
    optimizer: float


def bytes_per_parameter(precision: Precision, *, zero: int = 0, dp: int = 1) -> StateBytes:
    """Weights, gradient buffer and optimizer state per parameter, as the runtime keeps them
    at ZeRO level `zero` (persistent state; ZeRO-2's buckets in flight are apart)."""
    state = dp if zero >= 1 else 1
    grads = 4.0 / (dp if zero >= 2 else 1)
    weights = 1 / (dp if zero >= 3 else 1)
    if precision is Precision.FP32:
        return StateBytes(4.0 * weights, grads, 8.0 / state)
    return StateBytes(2.0 * weights, grads, 12.0 / state)  # fp32 master (4) + AdamW moments (8)


def element_bytes(precision: Precision) -> int:
    """Bytes of one activation element."""
    return 4 if precision is Precision.FP32 else 2


def attention_width(model: ModelConfig) -> int:
    """Width of the queries (and keys), a d: the hidden size unless model.head_size sets the
    heads apart (Qwen3: 32 heads of 128 in a 2048-wide model), so the attention's weights
    and FLOPs scale with it, not with h; a (p + r) under mla."""
    return model.num_heads * model.qk_head_dim


def value_width(model: ModelConfig) -> int:
    """Width of the values and of the output projection's input: a d, or a dv under mla."""
    return model.num_heads * model.value_head_dim


def _norm_parameters(model: ModelConfig, size: int) -> int:
    """One norm over `size` features: a gain, and a bias for LayerNorm with model.bias."""
    return size * (2 if model.normalization is Normalization.LAYERNORM and model.bias else 1)


def layer_parameters(
    model: ModelConfig, tp: int = 1, layer: int | None = None, ep: int = 1, etp: int | None = None
) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank: of layer `layer`
    (global index), whose MLP may be a mixture of experts (its routed experts split over
    `ep` expert-parallel ranks); None = a dense layer.

    Column-parallel weights and biases (QKV, fc1) and row-parallel weights (projection,
    fc2) are split over t; row-parallel biases and the norms are replicated. With
    model.qkv_bias alone (Qwen2) only QKV has a bias. The queries are a d wide
    (`attention_width`); model.qk_norm adds two norms over d (replicated). Under mla
    (`ptdp.config.shapes`) the down-projections, their biases (model.bias) and the latents'
    two RMSNorms are replicated and the up-projections column-parallel.
    """
    if layer is not None and model.is_moe_layer(layer):
        dense = layer_parameters(model, tp)
        experts = model.num_experts // ep
        moe = moe_parameters(model, tp, experts, etp)
        return dense - mlp_parameters(model, model.ffn_size, tp) + moe
    h, f, t, q = model.hidden_size, model.ffn_size, tp, attention_width(model)
    qkv = q + 2 * model.query_groups * model.head_dim
    parts = 2 if model.activation is Activation.SWIGLU else 1
    weights = linear_weights(model, tp)
    if model.is_mla:
        latents = latent_widths(model)
        biases = latents + 2 * h + f * parts // t if model.bias else 0
        norms = latents - model.qk_rope_head_dim  # nn.RMSNorm gains over q_lora and c
        return weights + biases + norms + 2 * _norm_parameters(model, h)
    if model.bias:
        biases = (qkv + f * parts) // t + 2 * h
    else:
        biases = qkv // t if model.qkv_bias else 0
    qk_norms = 2 * _norm_parameters(model, model.head_dim) if model.qk_norm else 0
    return weights + biases + 2 * _norm_parameters(model, h) + qk_norms


def linear_weights(model: ModelConfig, tp: int = 1) -> int:
    """Weights of one dense layer's linear layers (the attention's, fc1, fc2) on one tensor
    rank: the operands of its GEMMs, float8 under precision = fp8."""
    h, f = model.hidden_size, model.ffn_size
    parts = 2 if model.activation is Activation.SWIGLU else 1
    split = attention_split_weights(model) + h * f * parts + f * h
    return split // tp + attention_replicated_weights(model)


def mlp_parameters(model: ModelConfig, width: int, tp: int = 1) -> int:
    """Parameters of one MLP h -> width -> h on one tensor rank: fc1 (and its bias) split
    over t, fc2's weight split, its bias replicated."""
    h, t = model.hidden_size, tp
    parts = 2 if model.activation is Activation.SWIGLU else 1
    count = (h * width * parts + width * h) // t
    return count + (width * parts // t + h if model.bias else 0)


def moe_parameters(
    model: ModelConfig, tp: int = 1, experts: int | None = None, etp: int | None = None
) -> int:
    """Parameters of one mixture-of-experts block on one tensor rank: the router [e, h]
    (replicated), `experts` routed experts (None = all e) split over `etp` (None = t) and
    the shared experts' MLP. The router's balancing bias is a buffer, not a parameter."""
    routed = model.num_experts if experts is None else experts
    count = model.num_experts * model.hidden_size
    count += routed * mlp_parameters(model, model.moe_ffn_size, tp if etp is None else etp)
    if model.moe_shared_experts:
        count += mlp_parameters(model, model.moe_shared_ffn_size, tp)
    return count


def mtp_parameters(model: ModelConfig, tp: int = 1, ep: int = 1, etp: int | None = None) -> int:
    """Parameters of the multi-token-prediction modules (model.mtp_depth, `ptdp.model.mtp`)
    on one tensor rank: per depth two norms, the projection [2h -> h] (replicated), one
    layer of the last layer's kind and a final norm. The embedding and output layer are
    the model's (a later stage's copy of the embedding apart: `parameters_per_stage`)."""
    if not model.mtp_depth:
        return 0
    h, last = model.hidden_size, _last_layer(model)
    layer = layer_parameters(model, tp, last, ep, etp)
    return model.mtp_depth * (3 * _norm_parameters(model, h) + 2 * h * h + layer)


def _last_layer(model: ModelConfig) -> int | None:
    """The last layer's index where it is a mixture of experts, else None (dense)."""
    last = model.num_layers - 1
    return last if model.is_moe_layer(last) else None


def routed_parameters(model: ModelConfig, tp: int = 1, ep: int = 1, etp: int | None = None) -> int:
    """Routed-expert parameters of one MoE layer on one rank: its e / ep experts, split over
    etp (None = t; what expert parallelism divides; reduced and ZeRO-sharded over edp)."""
    width = tp if etp is None else etp
    return model.num_experts // ep * mlp_parameters(model, model.moe_ffn_size, width)


def _layers_parameters(
    model: ModelConfig, tp: int, first: int, count: int, ep: int = 1, etp: int | None = None
) -> int:
    """Parameters of the `count` layers from global index `first` on one tensor rank."""
    if not model.num_experts:
        return count * layer_parameters(model, tp)
    return sum(layer_parameters(model, tp, i, ep, etp) for i in range(first, first + count))


def _starts(layers: tuple[int, ...]) -> list[int]:
    """The global index of each stage's first layer."""
    return [sum(layers[:i]) for i in range(len(layers))]


@dataclass(frozen=True)
class ModelSize:
    """Parameters of a whole (unsharded) model, as publishers count them: the vocabulary
    unpadded, a tied output layer once."""

    total: int
    active: int
    """Those one token goes through: all but the routed experts it was not sent to
    (embedding, attention, norms, dense MLPs, routers, shared experts and k routed
    experts per mixture-of-experts layer). The output layer counts, as in the published
    figures. Equal to `total` for a dense model."""


def model_size(model: ModelConfig) -> ModelSize:
    """Total and active parameters of `model` (`ModelSize`)."""
    h, v = model.hidden_size, model.vocab_size
    total = sum(layer_parameters(model, 1, i) for i in range(model.num_layers))
    total += v * h * (1 if model.tie_embeddings else 2)
    if model.position_embedding is PositionEmbedding.LEARNED:
        total += model.seq_length * h
    total += h * (2 if model.normalization is Normalization.LAYERNORM and model.bias else 1)
    total += mtp_parameters(model)
    moe_layers = sum(model.is_moe_layer(i) for i in range(model.num_layers))
    moe_layers += model.mtp_depth if _last_layer(model) is not None else 0
    idle = (model.num_experts - model.moe_top_k) * mlp_parameters(model, model.moe_ffn_size)
    return ModelSize(total, total - moe_layers * idle)


def parameters_per_stage(
    model: ModelConfig,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    layers: tuple[int, ...] = (),
    ep: int = 1,
    etp: int | None = None,
) -> list[int]:
    """Local parameters of each virtual stage on one tensor-parallel rank.

    `layers`: each stage's layer count (`Layout.stage_layers`); empty = an even split.
    Stage 0 holds the embedding; the last stage the final norm and the output layer,
    which with pp * vpp > 1 is a separate copy even when tied to the embedding, and the
    multi-token-prediction modules (`mtp_parameters`, with their copy of the embedding when
    pp * vpp > 1). `ep`: the routed experts split over that many expert-parallel ranks,
    each over `etp` (None = t).
    """
    h, v, stages = model.hidden_size, model.padded_vocab_size(tp), pp * vpp
    layers = layers or (model.num_layers // stages,) * stages
    starts = _starts(layers)
    counts = [_layers_parameters(model, tp, a, n, ep, etp) for a, n in zip(starts, layers)]
    counts[0] += v // tp * h
    if model.position_embedding is PositionEmbedding.LEARNED:
        counts[0] += model.seq_length * h
    norm = h * (2 if model.normalization is Normalization.LAYERNORM and model.bias else 1)
    counts[-1] += norm
    if not (model.tie_embeddings and stages == 1):
        counts[-1] += v // tp * h
    counts[-1] += mtp_parameters(model, tp, ep, etp)
    if model.mtp_depth and stages > 1:
        counts[-1] += v // tp * h
    return counts


def layer_tensors(model: ModelConfig, layer: int | None = None) -> int:
    """Parameter tensors of one transformer layer: the fused QKV, projection, fc1 (SwiGLU's
    gate and up in one) and fc2 weights, their biases, and two norms. A mixture-of-experts
    layer (`layer`, a global index) adds its router and the shared experts' MLP (its routed
    experts' fc1 and fc2 are one grouped tensor each, as the dense MLP's are). Under mla
    the attention has five linears (four at q_lora_rank = 0), biases on the down- and output
    projections, and a norm per latent."""
    norm = 2 if model.normalization is Normalization.LAYERNORM and model.bias else 1
    if model.is_mla:
        linears = len(attention_linears(model))
        biases = linears if model.bias else 0  # the down and output projections', fc1, fc2
        count = linears + 2 + biases + (linears - 3) + 2 * norm
    else:
        biases = 4 if model.bias else 1 if model.qkv_bias else 0
        count = 4 + biases + (4 if model.qk_norm else 2) * norm  # q/k norms: two more
    if layer is not None and model.is_moe_layer(layer):
        count += 1 + (2 + (2 if model.bias else 0) if model.moe_shared_experts else 0)
    return count


def tensors_per_rank(
    model: ModelConfig,
    pp: int = 1,
    vpp: int = 1,
    layers: tuple[int, ...] = (),
    placement: Placement = Placement.LOOPED,
) -> list[int]:
    """Parameter tensors on each pipeline rank (what a per-tensor optimizer loop visits), as
    `parameters_per_stage` places them: the embedding (and learned positions) on stage 0,
    the final norm and output layer (a copy when tied, unless one stage holds both) last."""
    stages, out = StageMap(pp, vpp, placement), [0] * pp
    for stage, count in enumerate(tensors_per_stage(model, pp * vpp, layers)):
        out[stages.rank(stage)] += count
    return out


def tensors_per_stage(
    model: ModelConfig, stages: int = 1, layers: tuple[int, ...] = ()
) -> list[int]:
    """Parameter tensors of each virtual stage, placed as `parameters_per_stage` places
    their parameters."""
    layers = layers or (model.num_layers // stages,) * stages
    counts = [
        sum(layer_tensors(model, i) for i in range(a, a + n))
        for a, n in zip(_starts(layers), layers)
    ]
    counts[0] += 2 if model.position_embedding is PositionEmbedding.LEARNED else 1
    counts[-1] += 2 if model.normalization is Normalization.LAYERNORM and model.bias else 1
    if not (model.tie_embeddings and stages == 1):
        counts[-1] += 1
    if model.mtp_depth:  # norms, the projection and the layer of each depth
        norms = 3 * (2 if model.normalization is Normalization.LAYERNORM and model.bias else 1)
        per_depth = norms + 1 + layer_tensors(model, _last_layer(model))
        counts[-1] += model.mtp_depth * per_depth + (1 if stages > 1 else 0)
    return counts


def parameters_per_rank(
    model: ModelConfig,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    layers: tuple[int, ...] = (),
    placement: Placement = Placement.LOOPED,
    ep: int = 1,
    etp: int | None = None,
) -> list[int]:
    """Local parameters on one tensor rank of each pipeline rank (its stages by `placement`)."""
    per_stage = parameters_per_stage(model, tp, pp, vpp, layers, ep, etp)
    return _by_rank(per_stage, StageMap(pp, vpp, placement))


def expert_parameters_per_stage(
    model: ModelConfig,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    layers: tuple[int, ...] = (),
    ep: int = 1,
    etp: int | None = None,
) -> list[int]:
    """The routed-expert part of `parameters_per_stage` (`routed_parameters` per MoE layer):
    the parameters whose gradients go over the edp ranks rather than all of dp x cp."""
    stages = pp * vpp
    layers = layers or (model.num_layers // stages,) * stages
    per_layer = routed_parameters(model, tp, ep, etp) if model.num_experts else 0
    counts = [per_layer * n for n in moe_layers_per_stage(model, layers)]
    if _last_layer(model) is not None:  # multi-token prediction's MoE layers
        counts[-1] += per_layer * model.mtp_depth
    return counts


def expert_parameters_per_rank(
    model: ModelConfig,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    layers: tuple[int, ...] = (),
    placement: Placement = Placement.LOOPED,
    ep: int = 1,
    etp: int | None = None,
) -> list[int]:
    """The routed-expert part of `parameters_per_rank`."""
    per_stage = expert_parameters_per_stage(model, tp, pp, vpp, layers, ep, etp)
    return _by_rank(per_stage, StageMap(pp, vpp, placement))


def _by_rank(per_stage: list[int], stages: StageMap) -> list[int]:
    counts = [0] * stages.pp
    for stage, count in enumerate(per_stage):
        counts[stages.rank(stage)] += count
    return counts
