"""Seconds per pass of one microbatch through one model chunk, and per collective.

Compute model. A GEMM of [m, k] x [k, n] takes
    2 m n k / (peak * gemm_efficiency) + e (m k + k n + m n) / (HBM * memory_efficiency)
plus one kernel launch: the first term is the tensor cores at their sustained rate, the
second streaming the operands through HBM. The sum gives a saturating efficiency curve
that depends on GEMM size through its arithmetic intensity: large square GEMMs run near
`gemm_efficiency`, thin ones (the attention score GEMMs, whose inner size is the head
size) far below it. Memory-bound kernels (norms, GeLU, softmax, dropout, residual adds,
the loss) move `elementwise_traffic` bytes through HBM per byte of activation the layer
stores for backward (Korthikanti et al.'s count) in the forward pass, and twice that in
the backward pass.

Calibrated devices (`ptdp calibrate`) carry an efficiency curve over GEMM size measured
on these same layer shapes instead: a GEMM takes 2 m n k / (peak * curve(2 m n k)), which
holds operand traffic and launch costs as measured. Their fused attention runs at the
measured efficiency and backward / forward ratio for its work per sequence and head, and
their memory-bound kernels are priced one by one, each at its own measured bandwidth for
the bytes it moves (ptdp/perf/cost/kernels.py), in place of the `elementwise_traffic` term.
A calibrated CPU also carries the fixed cost of a layer pass that no kernel timing holds
(Python, module calls, autograd: ptdp's own model timed at a negligible size), added per
layer and microbatch, and the same for the embedding, head and loss.

CUDA graphs (`train.cuda_graphs`, `Software.cuda_graphs`): each compiled region's pass (a
layer's forward, its backward, the loss's) is one graph replay, so its kernels pay no launch
of their own and the pass takes its kernels' seconds or one launch, whichever is longer
(`Compute.replayed`). GEMMs priced by a device's measured curve keep their times: the curve
does not tell a launch from the kernel. The embedding, optimizer and collectives outside
the regions are priced as without graphs (they stay eager or carry no launch term).
`train.attention_backend = math` prices the unfused core (`Software.fused_attention`
False, `ptdp.perf.cost.switches`); the fused kernels (flash, cudnn, efficient, auto) are one
kernel here: the device files carry no figure per kernel.

Backward of a linear layer: the input gradient (dgrad, [m, n] x [n, k]) goes to B and the
weight gradient (wgrad, [k, m] x [m, n]) to W; everything else of a backward goes to B
(the zero-bubble split, Qi et al. arXiv 2401.10241). Full recomputation adds a forward to
B, selective recomputation the attention core's forward (ptdp checkpoints the fused
kernel too, so it reruns there as well). Each microbatch's weight gradients are then added
into the software's gradient buffers, a memory-bound pass over the stage's parameters
(`accumulation_seconds`, in W), unless its weight-gradient GEMMs accumulate in place.

Communication model (a collective's seconds and a group's link: `ptdp.perf.cost.collectives`).
Tensor parallelism runs 2 all-reduces in forward and 2 in backward per layer (sequence
parallelism: reduce-scatter + all-gather pairs of the same volume, costed as the
all-reduces; on a CPU, where ptdp's reduce-scatter over gloo is an all-reduce of the whole
tensor, the all-gathers come on top); they are not overlapped with compute, as in the
runtime. On a CPU, where the host threads run the collective, each blocking call between
compute also costs the ranks' resynchronisation (`sync_seconds`, measured by `ptdp
calibrate`): 2 calls a pass, 4 with sequence parallelism, and the head's (the
vocabulary-parallel loss's three all-reduces, its input's conjugate collective), whose
bytes are not counted; cp ring shifts, ZeRO-3's per-layer collectives, pipeline transfers,
the data-parallel reduction's and the distributed optimizer's gather's buckets and the
step's scalar all-reduces (`ptdp.perf.simulate.reduction` and `optimizer_step`) pay it per
wait too.

Letters: b = micro-batch, s = sequence, h = hidden, a = heads, d = head size, f = MLP
width, v = vocabulary, t = tensor-parallel size, e = bytes per element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ptdp.config.enums import Activation, Precision, Recompute
from ptdp.config.sections import ModelConfig
from ptdp.config.shapes import Split, attention_linears
from ptdp.perf.cost.collectives import all_reduce_seconds, gather_seconds, group_link
from ptdp.perf.cost.folding import Experts
from ptdp.perf.cost.hardware import System
from ptdp.perf.cost.kernels import Call, layer_traffic
from ptdp.perf.cost.layer_bytes import head_activation_bytes, layer_activation_bytes
from ptdp.perf.cost.moe import dense_equivalent, permute_bytes, routed_rows
from ptdp.perf.cost.parameters import element_bytes
from ptdp.perf.cost.software import Software


@dataclass(frozen=True)
class Gemm:
    """[m, k] x [k, n], `batch` times."""

    m: int
    n: int
    k: int
    batch: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch

    def nbytes(self, e: int) -> float:
        return float(e * self.batch * (self.m * self.k + self.k * self.n + self.m * self.n))

    def dgrad(self) -> Gemm:
        return Gemm(self.m, self.k, self.n, self.batch)

    def wgrad(self) -> Gemm:
        return Gemm(self.k, self.n, self.m, self.batch)


@dataclass(frozen=True)
class Passes:
    """Seconds of forward (F), input gradient (B) and weight gradient (W)."""

    f: float = 0.0
    b: float = 0.0
    w: float = 0.0

    def __add__(self, other: Passes) -> Passes:
        return Passes(self.f + other.f, self.b + other.b, self.w + other.w)

    def times(self, k: float) -> Passes:
        return Passes(self.f * k, self.b * k, self.w * k)


FP8_CAST_BYTES = 5
"""HBM bytes per element of casting a 16-bit GEMM operand to float8 with a dynamic scale:
read for its amax (2), read again (2) and written in 8 bits (1)."""


@dataclass(frozen=True)
class Compute:
    """One device at one precision: the pieces of the compute model."""

    system: System
    precision: Precision
    software: Software

    @property
    def e(self) -> int:
        return element_bytes(self.precision)

    @property
    def peak(self) -> float:
        """FLOP/s of attention and of every GEMM outside the linear layers: the bf16 rate
        under fp8, which casts only the linear layers' operands to float8."""
        fp8 = self.precision is Precision.FP8
        return self.system.device.peak_flops("bf16" if fp8 else self.precision.value)

    @property
    def linear_peak(self) -> float:
        """FLOP/s of the linear layers' GEMMs: the device's fp8 rate under fp8, reached at
        the same fraction as bf16's (the fitted curve; unmeasured for fp8)."""
        return self.system.device.peak_flops(self.precision.value)

    @property
    def bandwidth(self) -> float:
        d = self.system.device
        return d.memory_bandwidth * d.memory_efficiency

    def gemm(self, g: Gemm, peak: float = 0.0) -> float:
        """Seconds of GEMM `g` at `peak` FLOP/s (default: `self.peak`)."""
        d, peak = self.system.device, peak or self.peak
        if d.gemm_curve:
            return g.flops / (peak * d.gemm_efficiency_at(g.flops))
        compute = g.flops / (peak * d.gemm_efficiency)
        return self.launched(compute + g.nbytes(self.e) / self.bandwidth)

    def launched(self, seconds: float, kernels: float = 1) -> float:
        """`kernels` kernels running `seconds` in all, with their launches (the device's
        `kernel_overhead` each). A GPU's host queues kernels ahead of the stream, so a launch
        costs only where the kernels are shorter than the launches: the slower of the two
        sets the pace. A CPU runs each kernel in the thread that launched it: they add.
        Replayed from a CUDA graph (`Software.cuda_graphs`) the kernels need no launch of
        their own: `replayed` charges the region's one."""
        if self.software.cuda_graphs:
            return seconds
        launches = kernels * self.system.device.kernel_overhead
        if self.system.device.gloo:
            return seconds + launches
        return max(seconds, launches)

    def replayed(self, passes: Passes) -> Passes:
        """One microbatch's passes of a compiled region (a layer, the loss) under CUDA graphs:
        each pass is one replay, its kernels' seconds or the graph's one launch (the device's
        `kernel_overhead`), whichever is longer, as `launched` prices one kernel. One graph
        holds the backward, so B and W share a launch (charged to B). Without graphs:
        `passes` as they are."""
        if not self.software.cuda_graphs:
            return passes
        launch, w = self.system.device.kernel_overhead, passes.w
        return Passes(max(passes.f, launch), max(passes.b + w, launch) - w, w)

    def stream(self, nbytes: float) -> float:
        """Memory-bound kernels moving `nbytes` through HBM."""
        return nbytes / self.bandwidth

    def linear(self, g: Gemm) -> float:
        """Seconds of a linear layer's GEMM `g`; under fp8 with the casts of its two operands
        (torchao's dynamic scaling: each read for its amax, read again and written in 8 bits,
        `FP8_CAST_BYTES` per element at the streaming bandwidth)."""
        if self.precision is not Precision.FP8:
            return self.gemm(g)
        operands = g.batch * (g.m * g.k + g.k * g.n)
        return self.gemm(g, self.linear_peak) + self.stream(FP8_CAST_BYTES * operands)

    def linears(self, gemms: list[Gemm]) -> Passes:
        return Passes(
            sum(self.linear(g) for g in gemms),
            sum(self.linear(g.dgrad()) for g in gemms),
            sum(self.linear(g.wgrad()) for g in gemms),
        )


def layer_gemms(
    model: ModelConfig,
    micro_batch: int,
    tp: int,
    moe: bool = False,
    load: float = 1.0,
    ep: int = 1,
    etp: int | None = None,
    sequence_parallel: bool = False,
) -> list[Gemm]:
    """The linear layers of a transformer layer on one tensor rank (forward): the
    attention's (`ptdp.config.shapes`: QKV and projection, or MLA's five, whose replicated
    down-projections run on the rank's sequence slice under `sequence_parallel` and on every
    token elsewhere) and the MLP's two; `moe`:
    with a mixture-of-experts block for the MLP, its router on the rank's own tokens,
    the GEMMs of the rank's e / ep routed experts at the busiest expert's rows (`load`: over
    the mean; the rows of ep ranks' routed tokens, `folding.Experts.routed_tokens`), each
    expert 1/etp of its width (None: etp = t), and the shared experts' MLP."""
    h, f, t = model.hidden_size, model.ffn_size, tp
    tokens = micro_batch * model.seq_length
    parts = 2 if model.activation is Activation.SWIGLU else 1
    sliced = math.ceil(tokens / t) if sequence_parallel else tokens
    attention = [
        Gemm(sliced if x.split is Split.NONE else tokens, x.local_outputs(t), x.local_inputs(t))
        for x in attention_linears(model)
    ]
    if not moe:
        return [*attention, Gemm(tokens, f * parts // t, h), Gemm(tokens, h, f // t)]
    split = Experts.of(tp, 1, ep, etp)
    routed = math.ceil(split.routed_tokens(tokens))
    rows, e, fe = routed_rows(model, routed, load, ep), model.num_experts, model.moe_ffn_size
    own = math.ceil(tokens / tp) if split.etp != tp else tokens  # routed before the gather
    gemms = [*attention, Gemm(own, e, h)]  # the router, on the rank's own tokens
    held, et = e // ep, split.etp  # the rank's experts, the ranks splitting each
    gemms += [Gemm(rows, fe * parts // et, h, held), Gemm(rows, h, fe // et, held)]
    if fs := model.moe_shared_ffn_size:
        gemms += [Gemm(tokens, fs * parts // t, h), Gemm(tokens, h, fs // t)]
    return gemms


def attention_core(model: ModelConfig, micro_batch: int, tp: int, c: Compute) -> Passes:
    """Scores QK^T and their product with V: all of it input gradients (B).

    A sliding window shorter than the sequence needs an explicit mask, with which the
    fused kernels compute every s x s block (none is skipped as causal ones are).
    """
    s, d, dv = model.seq_length, model.qk_head_dim, model.value_head_dim
    heads = micro_batch * model.num_heads // tp
    scores, values = Gemm(s, s, d, heads), Gemm(s, dv, s, heads)
    if c.software.fused_attention:
        masked = 0 < model.sliding_window < s
        flops = (scores.flops + values.flops) * (1.0 if masked else c.software.causal_fraction)
        dev = c.system.device
        efficiency, ratio = dev.attention_at(flops / heads)
        forward = c.launched(flops / (c.peak * (efficiency or dev.gemm_efficiency)))
        return Passes(forward, forward * (ratio or c.software.fused_backward_ratio), 0.0)
    forward = c.gemm(scores) + c.gemm(values)
    backward = sum(c.gemm(g.dgrad()) + c.gemm(g.wgrad()) for g in (scores, values))
    return Passes(forward, backward, 0.0)


def sync_seconds(calls: int, c: Compute, after_compute: int | None = None) -> float:
    """What `calls` blocking collectives cost beyond their bytes, `after_compute` of them
    (default: all) right after a layer's compute rather than after another wait: the
    device's measured resynchronisation per call and the extra of a wait after compute
    (`Device.collective_sync`, `Device.wait_after_compute`; 0 on GPUs, where the host
    queues the collective and runs ahead)."""
    after = calls if after_compute is None else after_compute
    device = c.system.device
    return calls * device.collective_sync + after * device.wait_after_compute


def accumulation_seconds(params: int, tensors: int, c: Compute) -> float:
    """One microbatch's gradients of `params` parameters in `tensors` tensors added into the
    software's gradient buffers (`Software.accumulation_bytes`): per element the gradient
    read and the buffer read and written, one call a tensor, priced at the mean tensor's
    size. Where the weight-gradient GEMMs accumulate in place there is no such pass."""
    buffer = c.software.accumulation_bytes
    if not buffer or not tensors:
        return 0.0
    nbytes = params * (c.e + 2 * buffer)
    return Call("add", nbytes / tensors, tensors).seconds(c.system.device)


def layer_seconds(
    model: ModelConfig,
    *,
    micro_batch: int,
    tp: int,
    sequence_parallel: bool,
    recompute: Recompute,
    c: Compute,
    moe: bool = False,
    ep: int = 1,
    etp: int | None = None,
) -> Passes:
    """One transformer layer, one microbatch, on one GPU (tensor-parallel communication
    included); `moe`: one whose MLP is a mixture of experts (`ptdp.perf.cost.moe`), its
    routed experts split over `ep` ranks and each over `etp` (`ptdp.perf.cost.folding`;
    their all-to-alls: `ptdp.perf.cost.experts`), with the etp group's gather and
    reduce-scatter, and the dispatch's permutation (`moe.permute_bytes`)."""
    load = c.software.moe_load_imbalance
    gemms = layer_gemms(model, micro_batch, tp, moe, load, ep, etp, sequence_parallel)
    linears = c.linears(gemms)
    core = attention_core(model, micro_batch, tp, c)
    kw = dict(micro_batch=micro_batch, tp=tp, sequence_parallel=sequence_parallel, moe=moe)
    fused = c.software.fused_attention
    stored = layer_activation_bytes(
        model,
        recompute=Recompute.NONE,
        precision=c.precision,
        fused_attention=fused,
        etp=etp,
        **kw,
    )
    del kw["moe"]
    fixed_f, fixed_b = c.system.device.layer_overhead  # measured: holds every launch
    launches = 0.0 if fixed_f or fixed_b else c.software.elementwise_kernels
    ratio = c.software.backward_traffic_ratio
    if c.system.device.memory_kernels:  # each kernel at its own measured bandwidth
        kernels = dense_equivalent(model) if moe else model
        f, b = layer_traffic(kernels, e=c.e, device=c.system.device, unfused=not fused, **kw)
    else:
        f = c.stream(c.software.elementwise_traffic * stored)
        b = ratio * f
    if moe:  # the permutation's gather in and scatter out, again in backward
        permuted = c.stream(permute_bytes(model, micro_batch, tp, etp, load, c.e))
        f, b = f + permuted, b + permuted
    traffic, traffic_b = c.launched(f, launches), c.launched(b, ratio * launches)
    boundary = micro_batch * model.seq_length * model.hidden_size * c.e
    link = group_link(c.system, tp, 1)
    # Attention's pair, the shared MLP's apart; the routed experts' over etp (below) unless
    # they split like the dense MLP (etp = t), whose pair they then pay.
    et = tp if etp is None else etp
    pairs = 1 + (not moe or et == tp) + bool(moe and model.moe_shared_experts)
    comm = pairs * all_reduce_seconds(boundary, tp, link)
    if moe and 1 < et != tp:  # the etp group's gather and reduce-scatter of its rows
        comm += all_reduce_seconds(boundary * et / tp, et, group_link(c.system, et, 1))
    if sequence_parallel and c.system.device.gloo:  # reduce-scatters run as all-reduces
        comm += pairs * gather_seconds(boundary, tp, link)  # so the all-gathers come on top
    comm_f = comm_b = comm
    if c.software.tp_comm_overlap:
        comm_f, comm_b = max(0.0, comm - linears.f), max(0.0, comm - linears.b - linears.w)
    elif tp > 1:  # each pass waits on 2 all-reduces, or 2 all-gather + reduce-scatter pairs:
        # 2 right after GEMMs; sequence parallelism's others follow a wait and a norm
        comm_f = comm_b = comm + sync_seconds(4 if sequence_parallel else 2, c, 2)
    forward = linears.f + core.f + traffic + comm_f + fixed_f
    backward = linears.b + core.b + traffic_b + comm_b + fixed_b
    passes = Passes(forward, backward, linears.w)
    if recompute is Recompute.FULL:
        passes += Passes(0.0, forward, 0.0)
    elif recompute is Recompute.SELECTIVE:  # the attention core's forward again
        kept = layer_activation_bytes(
            model,
            recompute=Recompute.SELECTIVE,
            precision=c.precision,
            fused_attention=fused,
            moe=moe,
            etp=etp,
            **kw,
        )  # with fused attention nothing of the core is stored, so only the kernel reruns
        redo = core.f + c.stream(c.software.elementwise_traffic * (stored - kept))
        passes += Passes(0.0, redo, 0.0)
    return c.replayed(passes)


def head_seconds(
    model: ModelConfig,
    *,
    micro_batch: int,
    tp: int,
    c: Compute,
    compiled: bool = False,
    sequence_parallel: bool = False,
) -> Passes:
    """Final norm, output layer and vocabulary-parallel loss, one microbatch; compiled,
    the padding slice or mask, upcast and softmax are fused, so the memory-bound passes
    move fewer bytes."""
    tokens = micro_batch * model.seq_length
    logits = c.linears([Gemm(tokens, model.padded_vocab_size(tp) // tp, model.hidden_size)])
    stored = head_activation_bytes(
        model, micro_batch=micro_batch, tp=tp, precision=c.precision, compiled=compiled
    )
    traffic = c.stream(c.software.elementwise_traffic * stored)
    fixed_f, fixed_b = c.system.device.head_overhead  # the embedding's too (it is small)
    backward = c.software.backward_traffic_ratio * traffic + fixed_b
    comm = head_sync(tp, sequence_parallel, c)
    return c.replayed(logits + Passes(traffic + fixed_f, backward, 0.0) + comm)


def head_sync(tp: int, sequence_parallel: bool, c: Compute) -> Passes:
    """The resynchronisation of the head's blocking tensor-parallel collectives, one
    microbatch: the vocabulary-parallel loss's 3 all-reduces forward (maximum, target logit,
    sum of exponentials) and its input's conjugate collective (an all-reduce backward; with
    sequence parallelism an all-gather forward and a reduce-scatter backward). Their bytes
    are not counted: a few per token for the loss, one boundary tensor for the input."""
    if tp <= 1:
        return Passes()
    # The loss's 3 all-reduces follow each other: only the first comes after compute.
    return Passes(sync_seconds(3 + sequence_parallel, c, 1), sync_seconds(1, c), 0.0)


def embedding_seconds(model: ModelConfig, *, micro_batch: int, tp: int, c: Compute) -> Passes:
    """Token (and position) lookup, its tensor-parallel all-reduce, its gradient scatter."""
    nbytes = micro_batch * model.seq_length * model.hidden_size * c.e
    comm = all_reduce_seconds(nbytes, tp, group_link(c.system, tp, 1))
    if tp > 1 and not c.software.tp_comm_overlap:
        comm += sync_seconds(1, c)
    return Passes(c.stream(3 * nbytes) + comm, 0.0, c.stream(2 * nbytes))
