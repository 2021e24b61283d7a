"""Microbenchmarks on the local device for `ptdp calibrate`: GEMMs, fused attention,
memory-bound kernels, a kernel launch, and the collectives the runtime uses.

How each is timed is `ptdp.perf.calibrate.timing`'s: GEMMs as the fastest of a few batches, their
operands rotating past the caches; collectives as their fastest batch on CUDA and their
median batch on CPU (`collective_seconds`); attention and the memory-bound kernels on CUDA
in batches timed by events, on CPU one call at a time between the others, as a training
step runs them (`in_context_seconds`).

Collectives go through `ptdp.parallel.comm` (the only module that calls them), the
all-to-all through the primitive expert parallelism's dispatch and combine call. Every rank
runs the same number of calls, and a batch's time is the slowest rank's.

Letters: m, n, k = GEMM sizes ([m, k] x [k, n]); b = batch, a = heads, s = sequence,
d = head size; e = bytes per element.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ptdp.errors import PtdpError
from ptdp.parallel import comm
from ptdp.perf.calibrate.timing import (
    Timing,
    in_context_rounds,
    in_context_seconds,
    interleaved_seconds,
    synchronize,
    time_call,
)

# ----------------------------------------------------------------------------- compute


def _kernel_timer(device: torch.device) -> Callable[..., list[float]]:
    """How attention and the memory-bound kernels are timed: on CPU one call at a time
    between the others (`in_context_seconds`: a CPU's small kernels ran 2-8 times faster
    repeated than inside a step); on CUDA in interleaved batches (a GPU kernel's operands
    come from HBM either way, and single calls would time the host)."""
    return in_context_seconds if device.type == "cpu" else interleaved_seconds


@dataclass(frozen=True)
class GemmShape:
    """One GEMM a transformer layer issues: [m, k] x [k, n]."""

    name: str
    m: int
    n: int
    k: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


def layer_gemm_shapes(hidden: int, tokens: int) -> list[GemmShape]:
    """The forward GEMMs of a GPT layer (QKV, projection, MLP in and out) on `tokens` rows,
    and the weight gradient of the MLP's first (its inner size is the token count)."""
    h, t = hidden, tokens
    return [
        GemmShape(f"qkv h={h}", t, 3 * h, h),
        GemmShape(f"proj h={h}", t, h, h),
        GemmShape(f"fc1 h={h}", t, 4 * h, h),
        GemmShape(f"fc2 h={h}", t, h, 4 * h),
        GemmShape(f"fc1-wgrad h={h}", h, 4 * h, t),
    ]


def gemm_seconds(
    shape: GemmShape, dtype: torch.dtype, device: torch.device, timing: Timing, cold_bytes: int
) -> float:
    """Seconds per call, the operands rotating through as many sets (at most 64) as fill
    `cold_bytes`: in a training step a GEMM's weight was last touched a layer pass ago, so
    it comes from the last-level cache or memory, not from the private caches a GEMM timed
    on the same operands again and again reads (on the 2-core CPU of BENCHMARKS.md, layer-
    sized GEMMs ran at 0.73-0.85 of that hot rate with their operands rotated past it)."""
    e = torch.empty((), dtype=dtype).element_size()
    nbytes = e * (shape.m * shape.k + shape.k * shape.n + shape.m * shape.n)
    sets = [
        (
            torch.randn(shape.m, shape.k, dtype=dtype, device=device),
            torch.randn(shape.k, shape.n, dtype=dtype, device=device),
            torch.empty(shape.m, shape.n, dtype=dtype, device=device),
        )
        for _ in range(max(1, min(64, -(-cold_bytes // nbytes))))
    ]
    turn = itertools.cycle(sets)

    def call() -> object:
        a, b, out = next(turn)
        return torch.mm(a, b, out=out)

    return time_call(call, device, timing)


@dataclass(frozen=True)
class AttentionShape:
    """Causal fused attention (torch SDPA) on q, k, v of [b, a, s, d]."""

    b: int
    a: int
    s: int
    d: int

    @property
    def causal_flops(self) -> float:
        """QK^T and the product with V over the causal half of the s x s scores (the count
        of ptdp/perf/cost/costs.py with causal_fraction 0.5)."""
        return 0.5 * 4.0 * self.b * self.a * self.s * self.s * self.d


def attention_calls(
    shape: AttentionShape, dtype: torch.dtype, device: torch.device
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(forward, forward + backward) of one causal SDPA call. The forward runs with
    autograd on, as in training: without it a CPU takes a cheaper path (no log-sum-exp kept
    for backward), which would credit the difference to the backward."""
    size = (shape.b, shape.a, shape.s, shape.d)
    q, k, v = (torch.randn(size, dtype=dtype, device=device, requires_grad=True) for _ in "qkv")
    grad = torch.randn(size, dtype=dtype, device=device)

    def forward() -> torch.Tensor:  # its graph is dropped unused
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both() -> object:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), grad)

    return forward, both


def attention_seconds(
    shapes: list[AttentionShape], dtype: torch.dtype, device: torch.device, timing: Timing
) -> list[tuple[float, float]]:
    """(forward, backward) seconds of one causal SDPA call of each shape; backward =
    (forward + backward) - forward. Every call is timed in interleaved rounds, so a busy
    spell of a shared machine lasting seconds slows one round of every shape instead of
    every batch of one shape (a backward 2.6 times its value in the calibrations before and
    after, timed shape by shape): on CUDA a round is a batch of each and the fastest counts;
    on CPU one call of each (`in_context_seconds`) and the medians count."""
    fns = [fn for shape in shapes for fn in attention_calls(shape, dtype, device)]
    if device.type != "cpu":
        times = interleaved_seconds(fns, device, timing)
        return [(fwd, max(0.0, both - fwd)) for fwd, both in zip(times[::2], times[1::2])]
    # CPU: one call at a time (`in_context_seconds`); the backward is the median over rounds
    # of each round's (forward + backward) - forward, which a busy spell slows alike.
    rounds = in_context_rounds(fns, timing)
    timed = []
    for shape, fwd, both in zip(shapes, rounds[::2], rounds[1::2]):
        backward = statistics.median(b - f for f, b in zip(fwd, both))
        if backward <= 0:
            raise PtdpError(
                f"causal attention {shape} timed no slower with its backward "
                "than without it: other work took this machine's cores during the "
                "measurement; rerun on a quieter machine (or with fewer processes per core)"
            )
        timed.append((statistics.median(fwd), backward))
    return timed


# ------------------------------------------------------------------------- memory-bound


STREAM_KERNELS = ("layer_norm", "rms_norm", "gelu", "silu", "softmax", "add", "adamw")
"""Memory-bound kernels of a training step: norms, activations, residual adds (and the
copies, fills and sums priced like them), the optimizer step."""
WITH_BACKWARD = ("layer_norm", "rms_norm", "gelu", "silu", "softmax")
"""Those whose input gradient is a kernel of its own (timed as `<kernel>_backward`)."""


def stream_call(
    kernel: str, nbytes: int, dtype: torch.dtype, device: torch.device, *, backward: bool = False
) -> tuple[float, Callable[[], object]]:
    """(bytes moved, a call) of `kernel` on tensors of about `nbytes`.

    Bytes are the least each kernel must move: a read and a write per element for norms,
    activations and softmax, two reads and a write for an add, and for the AdamW step on fp32
    state 28 bytes a parameter (read weight, gradient, two moments; write weight and
    moments), the count of ptdp/perf/simulate/optimizer_step.py. A backward (autograd's input
    gradient) reads the saved tensor and the incoming gradient and writes the outgoing one: 3
    passes.
    """
    hidden = 1024
    if kernel == "adamw":
        numel = max(hidden, nbytes // 4)
        param = torch.nn.Parameter(torch.zeros(numel, device=device))
        param.grad = torch.randn(numel, device=device)
        # As ptdp.train.step.optim.adamw_kernel picks: fused on CUDA, foreach on CPU.
        kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
        opt = torch.optim.AdamW([param], lr=1e-4, **kind)
        return 28.0 * numel, opt.step
    e = torch.empty((), dtype=dtype).element_size()
    rows = max(1, nbytes // (e * hidden))
    x = torch.randn(rows, hidden, dtype=dtype, device=device, requires_grad=backward)
    weight = torch.ones(hidden, dtype=dtype, device=device)
    bias = torch.zeros(hidden, dtype=dtype, device=device)
    y, out = torch.randn_like(x), torch.empty_like(x)
    kernels: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = {
        "layer_norm": (2, lambda t: F.layer_norm(t, (hidden,), weight, bias)),
        "rms_norm": (2, lambda t: F.rms_norm(t, (hidden,), weight)),
        "gelu": (2, lambda t: F.gelu(t, approximate="tanh")),
        "silu": (2, F.silu),
        "softmax": (2, lambda t: torch.softmax(t, dim=-1)),
        "add": (3, lambda t: torch.add(t, y, out=out)),
    }
    if kernel not in kernels or (backward and kernel not in WITH_BACKWARD):
        known = ", ".join(WITH_BACKWARD if backward else STREAM_KERNELS)
        raise ValueError(f"unknown kernel {kernel!r}{' backward' * backward}; known: {known}")
    passes, fn = kernels[kernel]
    if backward:
        result = fn(x)
        grad = torch.randn_like(result)
        call = functools.partial(torch.autograd.grad, result, x, grad, retain_graph=True)
        return float(3 * x.numel() * e), call

    def forward() -> object:
        with torch.no_grad():
            return fn(x)

    return float(passes * x.numel() * e), forward


def stream_seconds(
    calls: list[tuple[str, int, bool]], dtype: torch.dtype, device: torch.device, timing: Timing
) -> list[tuple[float, float]]:
    """(bytes moved, seconds) of one call of each (kernel, input bytes, backward), timed in
    interleaved rounds (as `attention_seconds`, for the same reason)."""
    made = [stream_call(k, n, dtype, device, backward=b) for k, n, b in calls]
    times = _kernel_timer(device)([fn for _, fn in made], device, timing)
    return [(nbytes, seconds) for (nbytes, _), seconds in zip(made, times)]


def launch_seconds(device: torch.device, timing: Timing) -> float:
    """Fixed cost of one kernel: an in-place add on one element, back to back."""
    x = torch.zeros(1, device=device)
    return time_call(lambda: x.add_(1.0), device, timing)


# ------------------------------------------------------------------------- collectives


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
"""What the runtime calls: tensor- and data-parallel reductions and gathers (comm.py's
flat and in-place forms), expert parallelism's all-to-all and the pipeline's
point-to-point transfers."""


def build_groups(world: int, size: int, stride: int) -> comm.Group:
    """Split the world into groups of `size` ranks `stride` apart (stride 1: neighbours in
    rank order, as a tensor-parallel group inside a node; stride = ranks per node: one rank
    per node). Every rank creates every group (dist.new_group is collective); returns this
    rank's, or a single-rank group when the split leaves it out."""
    rank, mine = dist.get_rank(), comm.Group.single()
    block = size * stride
    for start in range(0, world - block + 1, block):
        for offset in range(stride):
            ranks = [start + offset + i * stride for i in range(size)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = comm.Group(group, size, ranks.index(rank))
    return mine


def _collective_call(
    op: str, nbytes: int, g: comm.Group, dtype: torch.dtype, device: torch.device
) -> Callable[[], object]:
    """One call of `op` on a full tensor of about `nbytes` over `g` (a no-op off the group)."""
    e = torch.empty((), dtype=dtype).element_size()
    numel = max(g.size, nbytes // e // g.size * g.size)
    full = torch.zeros(numel, dtype=dtype, device=device)  # zeros: sums never overflow
    shard = torch.zeros(numel // g.size, dtype=dtype, device=device)
    if g.size == 1:
        return lambda: None
    if op == "all_reduce":
        return lambda: comm.all_reduce_sum_(full, g)
    if op == "all_gather":
        return lambda: comm.all_gather_flat(full, shard, g)
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter_flat_async(shard, full, g).wait()
    if op == "all_to_all":  # each rank sends 1/n of `full` to each rank (dispatch/combine)
        rows = full.view(g.size, -1)  # whole rows, as the dispatch sends them
        split = [1] * g.size
        return lambda: comm.all_to_all(rows, g, split, split)
    if op == "p2p":  # one direction: a group's first rank sends to its second
        peer = dist.get_global_rank(g.group, 1 - g.rank) if g.rank < 2 else -1
        sends = [(full, peer, 0)] if g.rank == 0 else []
        recvs = [(full, peer, 0)] if g.rank == 1 else []
        return lambda: [w.wait() for w in comm.send_recv_async(sends, recvs)]
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(COLLECTIVES)}")


def _slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's `seconds` (what a synchronous step waits for)."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    return float(comm.all_reduce_max_value(value, comm.world_group()).item())


def lockstep_batch(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Seconds per call of `calls` calls of `fn` started together after a barrier, timed by
    the slowest rank. Collective: every rank calls it."""
    comm.barrier(None, comm.world_group().size)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return _slowest(time.perf_counter() - start, device) / calls


def collective_seconds(
    op: str,
    nbytes: int,
    g: comm.Group,
    dtype: torch.dtype,
    device: torch.device,
    timing: Timing,
) -> float:
    """Seconds per call of `op` over `g`, each batch timed by its slowest rank, every rank in
    step: the fastest batch on CUDA, the median batch on CPU. A CPU's collective runs on
    gloo's threads, which share the cores with the ranks' own: some calls wait out a
    scheduler slice for them, a step pays those too, and the fastest batch leaves them out
    (on the Xeon of BENCHMARKS.md, 15 batches of a 256 KiB all-reduce ranged from 385 to
    985 us a call, median 621; tp = 2 steps paid 1.0-1.8 ms a call on average)."""
    fn = _collective_call(op, nbytes, g, dtype, device)

    def batch(calls: int) -> float:
        return lockstep_batch(fn, calls, device)

    batch(1)  # warm-up: NCCL builds the group's communicator on its first call
    one = batch(1)
    calls = timing.calls(one)
    times = [batch(calls) for _ in range(timing.trials)]
    return statistics.median(times) if device.type == "cpu" else min(times)


# ----------------------------------------------------------------------------- framework


TINY_GPT = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 8, "vocab_size": 64}
"""ptdp's GPT at a size whose arithmetic is negligible (batch 1): what its calls cost is
what no kernel timing sees (`framework_overhead`, `waits.collective_sync`)."""


def tiny_gpt(
    layers: int,
    device: torch.device,
    dtype: torch.dtype,
    tp: comm.Group | None = None,
    *,
    batch: int = 1,
    **shape: int,
) -> tuple[torch.nn.Module, torch.Tensor]:
    """`TINY_GPT` (or its keys changed by `shape`) built with its first `layers` layers (0:
    embedding and head alone), and `batch` sequences of tokens for it."""
    from ptdp.config.sections import ModelConfig
    from ptdp.model.gpt import GPT

    cfg = ModelConfig(**(TINY_GPT | shape), dropout=0.0)
    model = GPT(cfg, layers=range(layers), tp=tp).to(device=device, dtype=dtype)
    return model, torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), device=device)


def optimizer_overhead(
    dtype: torch.dtype, device: torch.device, timing: Timing
) -> tuple[float, float]:
    """(per step, per parameter tensor) seconds of ptdp's optimizer step
    (`ptdp.train.step.optim.Optimizer`: the gradient norm, clipping, AdamW and the copy to
    16-bit weights) beyond the bytes it moves, from the tiny GPT (`TINY_GPT`) at 0 and 2
    layers. On a CPU torch's foreach AdamW runs each of its ops tensor by tensor and the
    norm reduces each tensor on its own: a cost per tensor that the one-tensor `adamw`
    stream timing does not see.
    """
    from ptdp.config.sections import OptimConfig
    from ptdp.parallel.data import GradBuffers
    from ptdp.parallel.roles import NO_ROLES
    from ptdp.train.step.optim import Optimizer

    one = comm.Group.single()
    fns: list[Callable[[], object]] = []
    tensors: list[int] = []
    for layers in (0, 2):
        model, _ = tiny_gpt(layers, device, torch.float32)  # fp32 masters, as in training
        buffers = GradBuffers([model], roles=NO_ROLES, dp=one, tp=one, embedding=one)
        optimizer = Optimizer([model], buffers, OptimConfig(), param_dtype=dtype, tp=one, pp=one)
        buffers.cast_params(dtype)
        for chunk in buffers.chunks:
            chunk.grads.normal_()  # as a backward leaves them
        tensors.append(len(optimizer.pieces))

        def step(o: Optimizer = optimizer) -> None:
            o.clip(1.0, o.grad_norm())
            o.step()

        fns.append(step)
    t0, t2 = interleaved_seconds(fns, device, timing.at_least(15))
    per_tensor = max(0.0, (t2 - t0) / (tensors[1] - tensors[0]))
    return max(0.0, t0 - per_tensor * tensors[0]), per_tensor


def framework_overhead(
    dtype: torch.dtype, device: torch.device, timing: Timing
) -> tuple[tuple[float, float], tuple[float, float]]:
    """((forward, backward) per transformer layer, (forward, backward) of the rest: the
    embedding, final norm, output layer and loss) of ptdp's own GPT (`ptdp.model.gpt`) at a
    size whose arithmetic is negligible (`TINY_GPT`), from models of 0 and 2 layers,
    forward (with autograd on, as in training) and forward + backward.

    What remains is what no kernel timing above sees: Python, module calls, the dispatcher
    and autograd's graph (built in forward, walked in backward) per op of the layer, the
    embedding and the head, and the gradient buffers' hook on each parameter tensor (ptdp's
    `GradBuffers`, as training attaches them: on the Xeon of BENCHMARKS.md about 3 us a
    tensor and microbatch). Any process group is left alone (tensor size 1).
    """
    from ptdp.parallel.data import GradBuffers
    from ptdp.parallel.roles import NO_ROLES

    one = comm.Group.single()
    fns: list[Callable[[], object]] = []
    buffers = []  # alive while timed: their hooks hold them weakly
    for layers in (0, 2):
        model, tokens = tiny_gpt(layers, device, torch.float32)  # fp32 masters, as in training
        buffers.append(GradBuffers([model], roles=NO_ROLES, dp=one, tp=one, embedding=one))
        buffers[-1].cast_params(dtype)
        fns.append(lambda m=model, t=tokens: m(t, t))
        fns.append(lambda m=model, t=tokens: m(t, t).backward())
    # Calls of about a millisecond: many short batches, so that some miss a neighbour's job.
    timing = timing.at_least(15)
    f0, fb0, f2, fb2 = interleaved_seconds(fns, device, timing)
    rest = (f0, max(0.0, fb0 - f0))
    layer = (max(0.0, (f2 - f0) / 2), max(0.0, (fb2 - f2 - rest[1]) / 2))
    return layer, rest
