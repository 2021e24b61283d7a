"""What a split backward (ZB-H1, ZB-H2, ZB-V) holds between a microbatch's B and its W.

B frees the layer's activations but what W needs (`ptdp/parallel/wgrad.py`): each linear
layer's input X and output gradient dY, and the gradients of every other parameter (norms,
biases, embeddings). `split_peak` walks a rank's actions to find when activations, this
stash and (under gloo) the sent tensors peak together (`ptdp.perf.cost.memory`). Measured
on CPU ranks (BENCHMARKS.md, "Peak memory of training steps on CPU ranks").

Letters: n = s b tokens, h = hidden, f = MLP width, v = vocabulary, t = tensor-parallel size.
"""

from __future__ import annotations

from ptdp.config.enums import Activation, Normalization, PositionEmbedding, Precision, Recompute
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.config.shapes import Split, attention_linears
from ptdp.perf.cost.moe import dense_equivalent
from ptdp.perf.cost.parameters import (
    element_bytes,
    layer_parameters,
    linear_weights,
    parameters_per_stage,
)
from ptdp.pipeline.actions import Kind
from ptdp.pipeline.partition import layer_ranges
from ptdp.pipeline.plan import PipelinePlan


def stash_bytes_per_layer(
    model: ModelConfig,
    *,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: Recompute = Recompute.NONE,
    precision: Precision = Precision.BF16,
) -> float:
    """Bytes one layer holds for W per microbatch beyond its counted activations (module doc).

    dY: QKV [n, qkv/t], projection [n, h], fc1 [n, f/t] (x 2 for SwiGLU's gate and up) and
    fc2 [n, h], n = s b tokens; the row-parallel dY is the whole [n, h] (its backward
    all-reduces or all-gathers before the GEMM). X: QKV and fc1 inputs [n, h] each (whole,
    all-gathered, under sequence parallelism), projection [n, h/t], fc2 [n, f/t]; B frees
    the rest of the layer's activations, so these are all it keeps of them (measured on CPU
    ranks, BENCHMARKS.md). Plus the gradients of the layer's biases and norms, in the
    weights' dtype. MLA's linears (`ptdp.config.shapes`) keep theirs alike, the replicated
    down-projections on the rank's sequence slice under sequence parallelism.
    """
    h, t, e = model.hidden_size, tp, element_bytes(precision)
    n = model.seq_length * micro_batch
    parts = 2 if model.activation is Activation.SWIGLU else 1
    f = model.ffn_size
    dy = n * (f * parts // t + h)
    x = n * (h + f // t)  # B frees the layer's other stored tensors
    for linear in attention_linears(model):
        rows = n // t if sequence_parallel and linear.split is Split.NONE else n
        dy += rows * linear.local_outputs(t)
        x += rows * linear.local_inputs(t)
    return e * (dy + x + layer_parameters(model, tp) - linear_weights(model, tp))


def stage_stash_bytes(cfg: RunConfig, tp: int, pp: int, vpp: int, stage: int) -> float:
    """Bytes one virtual stage holds for W per microbatch of a split backward (module doc):
    its layers' `stash_bytes_per_layer`, the embedding's gradient on the first stage, the
    output layer's dY [n, v/t] and the final norm's gradient on the last."""
    model, prec = cfg.model, cfg.train.precision
    e, n = element_bytes(prec), model.seq_length * cfg.train.micro_batch_size
    split = cfg.parallel.pipeline_layers
    layers = len(layer_ranges(model.num_layers, pp, vpp, split or None)[stage])
    if cfg.train.compile:  # plain F.linear: every gradient is computed in B and held
        experts = (cfg.parallel.ep, cfg.parallel.etp)
        return e * parameters_per_stage(model, tp, pp, vpp, split, *experts)[stage]
    kw = dict(
        micro_batch=cfg.train.micro_batch_size,
        tp=tp,
        sequence_parallel=cfg.parallel.sequence_parallel,
        recompute=cfg.parallel.recompute,
        precision=prec,
    )
    layer = stash_bytes_per_layer(model, **kw)
    if model.num_experts:  # an MoE layer as its dense equivalent (ptdp.perf.cost.moe)
        layer = max(layer, stash_bytes_per_layer(dense_equivalent(model), **kw))
    out = layers * layer
    h, v = model.hidden_size, model.padded_vocab_size(tp)
    if stage == 0:
        out += e * v // tp * h
        if model.position_embedding is PositionEmbedding.LEARNED:
            out += e * model.seq_length * h
    if stage == pp * vpp - 1:  # the output layer's dY and X, the final norm's gradient
        norm = h * (2 if model.normalization is Normalization.LAYERNORM and model.bias else 1)
        out += e * (n * v // tp + n * h + norm)
    return out


def split_peak(
    plan: PipelinePlan,
    rank: int,
    stored: list[float],
    stash: list[float],
    sent: list[float] | None = None,
    sent_back: list[float] | None = None,
) -> tuple[float, float, int]:
    """One rank's peak, walking its actions: each stage's `stored` bytes per microbatch from
    its F until its B or BW, then (split backward) its `stash` until its W; under gloo,
    `sent` (each stage's output, from its F) and `sent_back` (its input's gradient, from its
    B or BW) are held until the step's end. Returns the (activations with the sent tensors,
    stash, forwards in flight) at the moment their sum peaks."""
    acts = kept = 0.0
    held = 0
    best = (0.0, 0.0, 0)
    for a in plan.compute[rank]:
        if a.kind is Kind.F:
            acts, held = acts + stored[a.stage] + (sent[a.stage] if sent else 0.0), held + 1
        elif a.kind in (Kind.B, Kind.BW):
            acts, held = (
                acts - stored[a.stage] + (sent_back[a.stage] if sent_back else 0.0),
                held - 1,
            )
            kept += stash[a.stage] if a.kind is Kind.B else 0.0
        elif a.kind is Kind.W:
            kept -= stash[a.stage]
        if acts + kept > best[0] + best[1]:
            best = (acts, kept, held)
    return best
