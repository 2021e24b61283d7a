"""What the performance model counts for a mixture-of-experts layer (`ptdp.model.moe`),
beside what its attention shares with a dense layer. Every rank holds every expert (no
expert parallelism yet), so there is no all-to-all: the experts' parameters, gradients
and optimizer state are all on each rank (`ptdp.perf.cost.parameters`), and an MoE
block's collectives are the dense MLP's (one more pair for the shared experts' MLP).

Compute (`ptdp.perf.cost.costs.layer_gemms`): the router's logits, a GEMM [t, h] x [h, e]
(ptdp computes it in fp32; priced at the training precision), the routed experts as e
GEMMs of `routed_rows` rows each, and the shared experts' MLP. A token-choice costs the
same on every expert, so a perfect balance gives each expert t k / e rows; the
`Software.moe_load_imbalance` factor (default 1.0) scales those rows, and so the routed
experts' GEMM time, by the busiest expert's load over the mean (the log's "load max/mean",
`moe_load_max_over_mean`). ptdp's grouped GEMM on one rank holding all experts runs as
fast as the total rows allow, so 1.0 is the right figure there; a factor above 1 prices a
run whose experts wait for the busiest one.

Activations, memory-bound kernels and backward transients take the MoE layer as the
dense layer of its active width (`dense_equivalent`: a token's k routed experts and the
shared experts side by side), plus what dispatch and combine keep per layer and
microbatch (`dispatch_bytes`): the rows gathered for the experts [t k, h], the fp32
partial sums the combine weighs [t k, h], the router's fp32 input [t, h] and two fp32
[t, e] score tensors. Every tensor rank routes the whole sequence (gathered under
sequence parallelism), so these are not divided by t.

Letters: t = tokens of a microbatch (s b), h = hidden, e = routed experts, k = experts
per token.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ptdp.config import ModelConfig, Recompute


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


def routed_rows(model: ModelConfig, tokens: int, load: float = 1.0) -> int:
    """Rows of the busiest routed expert: the t k / e of a perfect balance times `load`."""
    return math.ceil(tokens * model.moe_top_k / model.num_experts * load)


def dispatch_bytes(
    model: ModelConfig, *, micro_batch: int, recompute: Recompute, e: int
) -> float:
    """What an MoE block keeps for backward beyond its dense equivalent (module doc); none
    under full recomputation, which keeps only the layer's input."""
    if recompute is Recompute.FULL:
        return 0.0
    t, h = model.seq_length * micro_batch, model.hidden_size
    return float(t * (model.moe_top_k * h * (e + 4) + 4 * h + 2 * 4 * model.num_experts))
