"""Memory per device: parameters, gradients, optimizer state and stored activations.

Model-state bytes per parameter follow what the runtime does (`ptdp/parallel/buckets.py`,
`ptdp/train/step/optim.py`): with bf16/fp16, 16-bit weights (2 B), an fp32 gradient buffer
(4 B), fp32 master weights (4 B) and AdamW's two fp32 moments (8 B); with fp32, 4 B
weights, 4 B gradients and 8 B of moments. ZeRO-1 (`parallel.zero`, the distributed
optimizer) divides the master weights and moments by the data-parallel size, ZeRO-2 the
gradient buffer too. ZeRO-2 then holds, besides its 1/dp, the full-size fp32 gradient
of the buckets being filled or reduced (`grad_buckets`): two buckets per model chunk
with overlapped reduction (one filling, the one before it reducing); the whole chunk
without overlap or under a split backward (B leaves a gradient in every bucket holding
a norm or bias until W fills the rest); and a tied embedding's bucket on the two stages
holding it (reduced at the step's end). ZeRO-3 divides the 16-bit weights by dp too and
holds, gathered for the layer computing, the largest unit it gathers (a layer, or the
embedding or output layer) twice, the next one being prefetched (`gathered_bytes`); kept
between forward and backward (`parallel.zero3_reshard_after_forward = false`), the rank's
whole chunk stays gathered. With context parallelism the state is sharded over the dp x cp
ranks that reduce the gradients (`ptdp.perf.cost.context`). Expert parallelism
(`parallel.ep`, `parallel.etp`) leaves e / ep routed experts on a rank at 1/etp of their
width, whose state ZeRO shards over the edp = tp cp dp / (ep etp) ranks holding the same
experts (`ptdp.perf.cost.folding`); their activations are the rows the rank routes
(`ptdp.perf.cost.moe`), 1/tp of its microbatch's gathered over etp.

Context parallelism (`ptdp.perf.cost.context`): activations are those of the s/cp-token model,
plus all-gather's gathered K/V; the K/V blocks in flight are working memory.

Activations per layer are Korthikanti et al.'s (arXiv 2205.05198, `ptdp.perf.cost.activations`)
for the recompute mode and sequence parallelism; with fused attention (flash or
memory-efficient SDPA, what ptdp runs on GPUs and on CPU without dropout) no s x s tensor
is stored, so "none" stores what the paper's "selective" does. A pipeline rank stores them
for as many (microbatch, chunk) forwards as are in flight at once, which
`ptdp.pipeline.verify` counts on the schedule's own action lists, from each F until its BW,
or until its W when the backward is split (B leaves the graph for W): p - r for 1F1B on
rank r, m for GPipe, p on every rank for ZB-H1 and 2p - 1 for ZB-H2 (capped at m), more
for interleaved (Korthikanti: x (1 + (p-1)/(p v)) on rank 0).

A split backward (ZB-H1, ZB-H2, ZB-V) holds a microbatch's activations from its F until
its B, which frees all but what W needs (`ptdp/parallel/wgrad.py`, `ptdp/pipeline/runtime.py`):
each linear layer's (X, dY) and the gradients of every other parameter (norms, biases,
embeddings), `stash`, held until its W; `split_peak` walks each rank's actions for the
moment their sum peaks, and W's weight gradients of a stage are working memory. Compiled
layers (`train.compile`) compute every gradient in B, so W holds all of the chunk's
parameter gradients instead. Under gloo (`gloo_sends`) the same walk adds every stage output
and input gradient sent to another rank: gloo completes a send only when the runtime waits
on it, at the step's end (NCCL frees them at once).

At the peak, besides what is stored, a backward pass holds its transients (`working`): the
layer being recomputed (full, its input counted once) or its attention core (selective),
plus the gradients alive inside one layer's backward (`layer_backward_bytes`: eager, at
fc2's backward, dY, fc2's input gradient and its weight's; compiled, the incoming and
outgoing [s, b, h] gradients and the larger of the MLP's inner gradients and attention's
dQ, dK, dV, dO);
on the last stage, the larger of the loss's backward (`head_backward_bytes`: eager, two
fp32 [s b, v] gradients, 6 GiB for GPT-2's vocabulary at 16,384 tokens; compiled, only
the output weight's gradient, the logits' gradient taking the saved logits' buffer) and a
layer's, less the head's stored tensors that the loss's backward has freed by then.

Eager 16-bit training (`fp32_norm_inputs`) keeps each norm's input as the fp32 copy CUDA
autocast makes: 36 bytes per s b h in a GPT-2 layer where Korthikanti et al. count 32
(without dropout), and 4 + 2 at the final norm and output layer. Measured on one H100
(BENCHMARKS.md, "One H100: the GPU check"), what a step adds beside the model state is
counted within 0.2% for GPT-2 125M and 1.3B, eager and compiled, and a 4B model with full
recomputation; CPU autocast keeps LayerNorm in 16 bits, where this counts 4 bytes per
s b h too many.

Grouped-query attention's K and V count at every head's width, as ptdp repeats them before
SDPA (measured on CPU ranks); `native_gqa` (Megatron-Core) at their groups'. SwiGLU keeps
4f per token (gate, up, silu's output, the product); `fused_swiglu` 3f.

`train.attention_backend = math` (PyTorch's reference attention) stores the unfused core's
s x s tensors, as `fused_attention` False, and in eager layers its scaled copies of q and k
(`switch_bytes.math_copies_bytes`). `train.cuda_graphs`: the first layer's input and the labels,
copied into the graphs' private pool (`switch_bytes.graph_input_bytes`), count as activations;
every other tensor of the graphed regions lives in that pool as it would in the allocator's.

Known omissions: p2p receive buffers; CPU's composite RMSNorm's x rsqrt(mean x^2) (CUDA's
fused kernel does not keep it); fused attention's logsumexp and the norms' mean and 1/std (under
0.3% of a layer at s = 1024); with a tied embedding on one stage, the output weight's
16-bit gradient, alive from the loss's backward to the embedding's; the CUDA context, NCCL
buffers and allocator waste are the reserve (`ptdp.perf.cost.reserve`); under CUDA graphs,
that the graphs' private pool and the eager allocator cannot reuse each other's free memory
(the optimizer's transients beside the pool's segments), a graph recorded again when its
inputs' liveness changes, and the reserve's fit on runs with graphs (not measured). The
in-flight count is ptdp's plan's: Megatron-LM 2021's interleaved code (`--software megatron-2021`,
`ptdp.perf.simulate.megatron2021`) at m = p ran all forwards first, so its ranks past the middle
held m v forwards, more than counted here.

Letters: s = sequence, b = micro-batch, h = hidden, f = MLP width, v = vocabulary,
t = tensor-parallel size, e = bytes per activation element.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ptdp.config.enums import Recompute
from ptdp.config.sections import RunConfig
from ptdp.perf.cost import context
from ptdp.perf.cost.folding import Experts
from ptdp.perf.cost.layer_bytes import (
    fp32_norm_inputs,
    head_activation_bytes,
    head_backward_bytes,
    layer_activation_bytes,
    layer_backward_bytes,
)
from ptdp.perf.cost.moe import dense_equivalent, moe_layers_per_stage
from ptdp.perf.cost.parameters import (
    bytes_per_parameter,
    element_bytes,
    expert_parameters_per_rank,
    linear_weights,
    parameters_per_rank,
)
from ptdp.perf.cost.stash import split_peak, stage_stash_bytes
from ptdp.perf.cost.switch_bytes import graph_input_bytes, math_attention, math_copies_bytes
from ptdp.perf.cost.zero_bytes import gathered_bytes, grad_bucket_bytes
from ptdp.pipeline.actions import RELEASE_KINDS, Kind
from ptdp.pipeline.plan import PipelinePlan
from ptdp.pipeline.schedules import SCHEDULES
from ptdp.rules.layout import Layout, validate


def in_flight(plan: PipelinePlan) -> tuple[int, ...]:
    """Most (microbatch, chunk) forwards each rank of `plan` holds at once.

    Counted as `verify` counts: from a forward until its BW, or its W when the backward is
    split. Where the schedule declares a bound that `verify` enforces (GPipe m, 1F1B
    pp - rank, ZB-H1 pp, ZB-H2 2 pp - 1) the peak is that bound capped at m; otherwise
    (interleaved) it is what `verify` counts on the plan's lists, without its dry run.
    """
    bound = plan.in_flight_bound
    if bound is not None:
        return tuple(min(held, plan.num_microbatches * plan.vpp) for held in bound)
    return plan.peak_in_flight


def stage_in_flight(plan: PipelinePlan, stage: int) -> int:
    """Most microbatches of one stage whose forward ran and whose BW, or W when split, has not."""
    held = peak = 0
    for a in plan.compute[plan.stages.rank(stage)]:
        if a.stage == stage:
            held += 1 if a.kind is Kind.F else -1 if a.kind in RELEASE_KINDS else 0
            peak = max(peak, held)
    return peak


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one device of one pipeline rank."""

    rank: int
    params: float
    grads: float
    optimizer: float
    activations: float
    """Stored for backward: per-layer bytes x layers per chunk x forwards in flight."""
    working: float
    """Transient: the layer being recomputed (full) or its attention core (selective), plus
    one layer's backward gradients; on the last stage the larger of the loss's backward and
    that less one microbatch's head activations (module doc)."""
    in_flight: int
    stash: float = 0.0
    """Split backward: held from B until W (module doc) x microbatches awaiting their W."""
    grad_buckets: float = 0.0
    """ZeRO-2: full-size fp32 gradients of the buckets being filled or reduced (module doc)."""
    gathered: float = 0.0
    """ZeRO-3: 16-bit weights gathered for the layers computing and prefetched (module doc)."""
    reserved: float = 0.0
    """Held beside `total`: CUDA context, NCCL buffers, allocator (`ptdp.perf.cost.reserve`)."""

    @property
    def total(self) -> float:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.activations
            + self.working
            + self.stash
            + self.grad_buckets
            + self.gathered
        )


def estimate_memory(
    cfg: RunConfig,
    world_size: int,
    *,
    fused_attention: bool = True,
    autocast_norms: bool = True,
    layout: Layout | None = None,
    gloo_sends: bool = False,
    native_gqa: bool = False,
    fused_swiglu: bool = False,
    gemm_accumulates: bool = False,
    math_kernel: bool | None = None,
    discards_outputs: bool = False,
) -> list[MemoryEstimate]:
    """Per pipeline rank (all tensor and data-parallel ranks alike), for the config's layout.

    `gloo_sends`: the pipeline's sends complete only when the runtime waits on them, at the
    step's end (gloo, `PipelineRuntime._release_sent_outputs`), so every stage output and
    input gradient sent to another rank stays until then; NCCL frees each soon after.

    `layout` is `validate(cfg, world_size)` if the caller has it (with its built plan).
    `fused_attention`, `autocast_norms`, `native_gqa`, `fused_swiglu` and `gemm_accumulates`
    (weight-gradient GEMMs adding into the buffers themselves) describe the software
    (`ptdp.perf.cost.software.Software`: ptdp's by default; Megatron's fused LayerNorm keeps
    16-bit inputs, its attention grouped K and V, its SwiGLU gate and up alone).
    `math_kernel`: PyTorch's math attention runs the core (`Software.math_kernel`); None: where
    `train.attention_backend = math` on a software with fused attention.
    `discards_outputs`: the norms' and experts' activation outputs are recomputed, not kept
    (`Software.discards_outputs`).
    """
    layout = layout or validate(cfg, world_size)
    if math_kernel is None:
        math_kernel = fused_attention and math_attention(cfg)
    fused_attention = fused_attention and not math_attention(cfg)  # train.attention_backend
    model, par, prec = cfg.model, cfg.parallel, cfg.train.precision
    tp, pp, vpp = layout.tp, layout.pp, layout.vpp
    b, cp = cfg.train.micro_batch_size, layout.cp
    held = in_flight(layout.pipeline)
    stages = layout.stages
    last_held = stage_in_flight(layout.pipeline, stages.last)
    state = bytes_per_parameter(prec, zero=layout.zero, dp=layout.dp * cp)
    # The routed experts' state: sharded over the edp ranks holding the same experts.
    folded = Experts.of(tp, layout.dp * cp, layout.ep, layout.etp)
    expert_state = bytes_per_parameter(prec, zero=layout.zero, dp=folded.edp)
    buckets = grad_bucket_bytes(cfg, layout)
    gathered = gathered_bytes(cfg, layout)
    local = context.local_model(model, cp)  # activations: the s/cp tokens of one cp rank
    kw = dict(micro_batch=b, tp=tp, sequence_parallel=par.sequence_parallel, precision=prec)
    eager_norms = autocast_norms and fp32_norm_inputs(cfg)
    kw_layer = dict(
        fused_attention=fused_attention,
        autocast_norms=eager_norms,
        native_gqa=native_gqa,
        fused_swiglu=fused_swiglu,
        discards_outputs=discards_outputs,
        **kw,
    )
    layer = layer_activation_bytes(local, recompute=par.recompute, **kw_layer)
    full = layer_activation_bytes(local, recompute=Recompute.NONE, **kw_layer)
    # Full recompute: the recomputed layer's first norm input is the checkpoint's saved
    # input, already counted, unless the norm keeps an fp32 copy of it.
    recomputed = full - (0.0 if eager_norms else layer)
    working = {Recompute.NONE: 0.0, Recompute.FULL: recomputed}.get(par.recompute, full - layer)
    eager = not cfg.train.compile
    working += layer_backward_bytes(
        local,
        micro_batch=b,
        tp=tp,
        precision=prec,
        eager=eager,
        weight_gradient=not gemm_accumulates,
    )
    moe_layer = layer
    if model.num_experts:  # an MoE layer's (ptdp.perf.cost.moe); the larger transients
        kw_moe = dict(moe=True, etp=layout.etp, **kw_layer)
        moe_layer = layer_activation_bytes(local, recompute=par.recompute, **kw_moe)
        moe_full = layer_activation_bytes(local, recompute=Recompute.NONE, **kw_moe)
        moe_working = {Recompute.NONE: 0.0, Recompute.FULL: moe_full}.get(
            par.recompute, moe_full - moe_layer
        )
        moe_working += layer_backward_bytes(
            dense_equivalent(local), micro_batch=b, tp=tp, precision=prec
        )
        working = max(working, moe_working)
    compiled = cfg.train.compile
    head_working = head_backward_bytes(
        local, micro_batch=b, tp=tp, precision=prec, compiled=compiled
    )
    e, comm = element_bytes(prec), par.cp_comm
    cp_stored = context.stored_bytes_per_layer(
        model, micro_batch=b, tp=tp, cp=cp, comm=comm, recompute=par.recompute, e=e
    )
    layer, moe_layer = layer + cp_stored, moe_layer + cp_stored
    copies = math_copies_bytes(cfg, local, tp) if math_kernel else 0.0  # scaled q and k
    layer, moe_layer = layer + copies, moe_layer + copies
    working += context.working_bytes(model, micro_batch=b, tp=tp, cp=cp, comm=comm, e=e)
    head = head_activation_bytes(
        local, micro_batch=b, tp=tp, precision=prec, compiled=compiled, autocast_norms=eager_norms
    )
    if model.mtp_depth:  # on the last stage: each depth's layer (the last one's kind), head
        kind = moe_layer if model.is_moe_layer(model.num_layers - 1) else layer
        head += model.mtp_depth * (kind + head)
    # Layers of the rank's largest chunk (exact for vpp = 1 or an even split, else a bound).
    split = layout.stage_layers or (model.num_layers // (pp * vpp),) * (pp * vpp)
    per_chunk = [max(split[s] for s in stages.stages_of(rank)) for rank in range(pp)]
    moe = moe_layers_per_stage(model, split)
    # Bytes of the rank's largest chunk's layers (MoE layers at their own count).
    chunk_bytes = [
        max((split[s] - moe[s]) * layer + moe[s] * moe_layer for s in stages.stages_of(rank))
        for rank in range(pp)
    ]
    split_peaks = None
    splits = SCHEDULES[layout.schedule].splits_backward
    if splits or gloo_sends:  # activations until B (BW), the stash until W, sends until the end
        stored = [
            (split[s] - moe[s]) * layer + moe[s] * moe_layer + (head if s == stages.last else 0)
            for s in range(pp * vpp)
        ]
        kept = [0.0] * (pp * vpp)
        if splits:
            kept = [
                stage_stash_bytes(replace(cfg, model=local), tp, pp, vpp, s)
                for s in range(pp * vpp)
            ]
        sent = sent_back = None
        if gloo_sends:
            shard = tp if par.sequence_parallel else 1
            output = e * local.seq_length * b * model.hidden_size / shard
            sent = [
                output if s < stages.last and not stages.same_rank(s, s + 1) else 0.0
                for s in range(pp * vpp)
            ]
            sent_back = [
                output if s > 0 and not stages.same_rank(s - 1, s) else 0.0 for s in range(pp * vpp)
            ]
        split_peaks = [
            split_peak(layout.pipeline, r, stored, kept, sent, sent_back) for r in range(pp)
        ]
    out = []
    where = (pp, vpp, split, stages.placement, layout.ep, layout.etp)
    per_rank = parameters_per_rank(model, tp, *where)
    routed = expert_parameters_per_rank(model, tp, *where)
    for rank, (count, experts) in enumerate(zip(per_rank, routed)):
        rest = count - experts
        with_head = rank == stages.rank(stages.last)
        if model.num_experts:
            acts = held[rank] * chunk_bytes[rank]
        else:
            acts = held[rank] * per_chunk[rank] * layer
        acts += last_held * head if with_head else 0.0
        stash = 0.0
        if split_peaks is not None:
            acts, stash, _ = split_peaks[rank]
        if rank == stages.rank(0):  # CUDA graphs: the eager inputs copied into the pool
            acts += graph_input_bytes(cfg, local, tp)
        # A rank of stages without layers (the embedding or the loss alone) has no layer's
        # transients.
        rank_working = working if per_chunk[rank] else 0.0
        # The loss's backward, or a layer's once one microbatch's head is freed.
        if with_head:
            rank_working = max(head_working, rank_working - head)
        if splits and not compiled:  # W's weight gradients, then accumulated
            wgrads = element_bytes(prec) * per_chunk[rank] * linear_weights(local, tp)
            rank_working = max(rank_working, wgrads)
        out.append(
            MemoryEstimate(
                rank,
                rest * state.params + experts * expert_state.params,
                rest * state.grads + experts * expert_state.grads,
                rest * state.optimizer + experts * expert_state.optimizer,
                acts,
                rank_working,
                held[rank],
                stash,
                buckets[rank],
                gathered[rank],
            )
        )
    return out
