"""What the performance model counts for a mixture-of-experts layer (`ptdp.model.moe`),
beside what its attention shares with a dense layer. Without expert parallelism
(`parallel.ep = 1`) every rank holds every expert: the experts' parameters, gradients and
optimizer state are all on each rank (`ptdp.perf.cost.parameters`), and an MoE block's
collectives are the dense MLP's (one more pair for the shared experts' MLP).

Expert parallelism (`parallel.ep`): the e routed experts are split over ep ranks taken
from the dp cp ranks (the ep group: ep consecutive members of a dp_cp group, so tp ranks
apart in the global order tp, cp, dp, pp). A rank holds e / ep experts; the router, the
attention, the shared experts and the dense layers stay replicated. Each MoE layer, per
microbatch, sends every token-choice's row [h] to the rank holding its expert (dispatch)
and the expert's output back (combine), an all-to-all each, in forward and again in
backward: 4 all-to-alls. Under a uniform routing a rank keeps 1/ep of its t k rows and
sends the rest (`alltoall_bytes`); every tensor rank routes its whole microbatch, so the
rows are not divided by t. The routed experts' gradients are reduced over the edp =
dp cp / ep ranks holding the same experts, and ZeRO shards their state over those; the
rest of the model's over dp cp as before. The seconds are in `ptdp.perf.cost.experts`.

Compute (`ptdp.perf.cost.costs.layer_gemms`): the router's logits, a GEMM [t, h] x [h, e]
(ptdp computes it in fp32; priced at the training precision), the routed experts as e / ep
GEMMs of `routed_rows` rows each (the rows of ep ranks' tokens: t k ep / e per expert, so
a rank's expert work is t k rows whatever ep, in fewer, taller GEMMs), and the shared
experts' MLP. A token-choice costs the same on every expert, so a perfect balance gives
each expert its mean rows; the `Software.moe_load_imbalance` factor (default 1.0) scales
those rows, and so the routed experts' GEMM time, by the busiest expert's load over the
mean (the log's "load max/mean", `moe_load_max_over_mean`), and the all-to-all bytes of the
rank holding it likewise. ptdp's grouped GEMM on one rank holding all experts runs as fast
as the total rows allow, so 1.0 is the right figure there; a factor above 1 prices a run
whose experts, or expert-parallel ranks, wait for the busiest one. The grouped GEMM
(`ptdp.parallel.grouped`: one kernel for all of a rank's experts on GPUs) is priced as one
GEMM of the rank's whole expert work, its tiles filling the device across experts: its
efficiency follows the t k rows a rank computes, the same at every ep, while the weights
it streams are its e / ep experts'.

Activations, memory-bound kernels and backward transients take the MoE layer as the
dense layer of its active width (`dense_equivalent`: a token's k routed experts and the
shared experts side by side), plus what dispatch and combine keep per layer and
microbatch (`dispatch_bytes`): the rows gathered for the experts [t k, h], the experts'
outputs the combine weighs [t k, h] (`ptdp.model.dispatch`: in their dtype, fp32 where the
experts' fp32 bias promotes them, else the precision's), the router's fp32 input [t, h]
and two fp32 [t, e] score tensors. Every tensor rank routes the whole sequence (gathered under
sequence parallelism), so these are not divided by t.

Letters: t = tokens of a microbatch (s b; s/cp per rank under context parallelism),
h = hidden, e = routed experts, k = experts per token, ep = expert-parallel size.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ptdp.config.enums import Recompute
from ptdp.config.sections import ModelConfig


def dense_equivalent(model: ModelConfig) -> ModelConfig:
    """`model` as a dense model whose MLP is as wide as what one token of an MoE layer goes
    through: k routed experts and the shared experts."""
    width = model.moe_top_k * model.moe_ffn_size + model.moe_shared_ffn_size
    return replace(model, num_experts=0, ffn_hidden_size=width)


def moe_layers_per_stage(model: ModelConfig, layers: tuple[int, ...]) -> list[int]:
    """MoE layers among each stage's `layers` (counts, in global order)."""
    out, first = [], 0
    for count in layers:
        out.append(sum(model.is_moe_layer(i) for i in range(first, first + count)))
        first += count
    return out


def routed_rows(model: ModelConfig, tokens: int, load: float = 1.0, ep: int = 1) -> int:
    """Rows of the busiest routed expert: the t k ep / e of a perfect balance (the tokens of
    the ep ranks that send it theirs) times `load`."""
    return math.ceil(tokens * ep * model.moe_top_k / model.num_experts * load)


def alltoall_bytes(tokens: int, top_k: int, hidden: int, ep: int, bytes_per_element: int) -> float:
    """Bytes one rank sends to the other ranks of its ep group in ONE all-to-all (a dispatch
    or a combine) under a uniform routing:

        tokens * top_k * hidden * bytes_per_element * (ep - 1) / ep

    `tokens`: the rank's tokens of one microbatch, seq_length / cp * micro_batch_size (every
    tensor rank routes them all); of its tokens * top_k rows of `hidden` elements, the 1/ep
    whose experts it holds stay. 0 at ep = 1."""
    return tokens * top_k * hidden * bytes_per_element * (ep - 1) / ep


def dispatch_bytes(model: ModelConfig, *, micro_batch: int, recompute: Recompute, e: int) -> float:
    """What an MoE block keeps for backward beyond its dense equivalent (module doc); none
    under full recomputation, which keeps only the layer's input."""
    if recompute is Recompute.FULL:
        return 0.0
    t, h = model.seq_length * micro_batch, model.hidden_size
    combined = 4 if model.bias else e  # the experts' outputs: fp32 bias + rows is fp32
    return float(t * (model.moe_top_k * h * (e + combined) + 4 * h + 2 * 4 * model.num_experts))
