"""What the performance model counts for a mixture-of-experts layer (`ptdp.model.moe`),
beside what its attention shares with a dense layer. Without expert parallelism
(`parallel.ep = 1`) every rank holds every expert: the experts' parameters, gradients and
optimizer state are all on each rank (`ptdp.perf.cost.parameters`), and an MoE block's
collectives are the dense MLP's (one more pair for the shared experts' MLP).

Expert parallelism (`parallel.ep`, `parallel.etp`): the e routed experts are split over ep
ranks, each over etp ranks, folded over one stage's tp cp dp ranks apart from attention
(`ptdp.perf.cost.folding`). A rank holds e / ep experts at 1/etp of their width; the
router, the attention, the shared experts and the dense layers stay as they were. Each
MoE layer, per microbatch, sends every token-choice's row [h] to the rank holding its
expert (dispatch) and the expert's output back (combine), an all-to-all each, in forward
and again in backward: 4 all-to-alls. A rank routes r = t etp / tp tokens (its sequence
shard gathered over etp; t under etp = tp, where every tensor rank routes its whole
microbatch); under a uniform routing it keeps 1/ep of its r k rows and sends the rest
(`alltoall_bytes`). The routed experts' gradients are reduced over the edp ranks holding
the same experts, and ZeRO shards their state over those; the rest of the model's over
dp cp as before. The seconds are in `ptdp.perf.cost.experts`.

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

Activations (`expert_bytes`, beside the attention and the shared experts' MLP counted as a
dense layer's): what each MoE layer keeps for backward on a rank, per microbatch, of its
r k routed rows: the permuted rows, the grouped GEMMs' inputs (fc1's: the rows; fc2's:
the activation's output [r k, f/etp]) and the activation's input (SwiGLU's gate and up,
2f/etp; ptdp's unfused SwiGLU also silu's output), the combine's expert outputs [r k, h]
(the weights' gradient needs them) and fp32 weights [r k], and the router's two fp32
[t/tp, e] score tensors of the rank's own tokens (routed before the etp gather); none
under full recomputation, which keeps the layer's input. The dispatch's permutation
reads and writes the routed rows once in (a gather) and once out (a scatter), again in
backward (`permute_bytes`). Memory-bound kernels and backward transients take the MoE
layer as the dense layer of its active width (`dense_equivalent`: a token's k routed
experts and the shared experts side by side), whose per-rank work the folded experts'
equals (r k rows of f/etp = t k f / tp).

Letters: t = tokens of a microbatch (s b; s/cp per rank under context parallelism),
h = hidden, e = routed experts, k = experts per token, ep = expert-parallel size.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ptdp.config.enums import Activation, Recompute
from ptdp.config.sections import ModelConfig
from ptdp.perf.cost.folding import Experts


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


def alltoall_bytes(
    tokens: float, top_k: int, hidden: int, ep: int, bytes_per_element: int
) -> float:
    """Bytes one rank sends to the other ranks of its ep group in ONE all-to-all (a dispatch
    or a combine) under a uniform routing:

        tokens * top_k * hidden * bytes_per_element * (ep - 1) / ep

    `tokens`: the tokens the rank routes of one microbatch (`folding.Experts.routed_tokens`:
    seq_length / cp * micro_batch_size * etp / tp); of its tokens * top_k rows of `hidden`
    elements, the 1/ep whose experts it holds stay. 0 at ep = 1."""
    return tokens * top_k * hidden * bytes_per_element * (ep - 1) / ep


def expert_bytes(
    model: ModelConfig,
    *,
    micro_batch: int,
    recompute: Recompute,
    e: int,
    tp: int = 1,
    etp: int | None = None,
    fused_swiglu: bool = False,
    load: float = 1.0,
    discards_outputs: bool = False,
) -> float:
    """What a rank keeps for backward of one MoE layer's routed experts and router, one
    microbatch (module doc); `model` is the rank's (s/cp tokens); `load` scales the rows
    to the busiest rank's; `discards_outputs` (`Software`): the activation's output (fc2's
    input) is recomputed in backward, not kept. None under full recomputation."""
    if recompute is Recompute.FULL:
        return 0.0
    split = Experts.of(tp, 1, 1, etp)
    routed = split.routed_tokens(model.seq_length * micro_batch)
    rows, h, width = routed * model.moe_top_k * load, model.hidden_size, model.moe_ffn_size
    if model.activation is Activation.SWIGLU:
        inner = 3 if fused_swiglu else 4  # gate and up, (silu(gate),) the product
    else:
        inner = 2  # the activation's input and output
    inner -= discards_outputs
    kept = rows * (2 * h * e + inner * width / split.etp * e + 4)
    own = routed / split.etp if split.etp != tp else routed  # scored before the etp gather
    return float(kept + 2 * 4 * own * model.num_experts)


def permute_bytes(
    model: ModelConfig, micro_batch: int, tp: int, etp: int | None, load: float, e: int
) -> float:
    """Bytes the dispatch's permutation moves per pass (module doc): the r k routed rows
    [h] read and written by the gather in and by the scatter out."""
    routed = Experts.of(tp, 1, 1, etp).routed_tokens(model.seq_length * micro_batch)
    return 4.0 * routed * model.moe_top_k * load * model.hidden_size * e
