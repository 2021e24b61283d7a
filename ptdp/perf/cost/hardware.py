"""A cluster as the cost model reads it: a device, the link inside a node, the network between.

`System` is a cluster of identical nodes, `Device` one accelerator (peak rates, memory and
the calibrated achieved fractions), `Link` one link as one GPU sees it; each answers what
the cost model asks of it: a GEMM's or the fused attention's efficiency at its size, a
memory-bound kernel's bandwidth, a message's or a collective's latency and bandwidth.
Bandwidths are bytes/s per GPU and per direction, times seconds. The clusters are data:
`ptdp.perf.cost.hardware_file` reads them from TOML files (the built-in ones in
`ptdp/perf/cost/hardware/`, or the user's), and `ptdp calibrate` writes them
(`ptdp.perf.calibrate.calibration_file`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.errors import ConfigError
from ptdp.perf.calibrate.fit import interpolate_log

GB = 1e9
GIB = 2**30
BACKWARD_FLOPS = 2.5
"""Fused attention's backward FLOPs per forward FLOP: 5 GEMMs against 2 (FlashAttention-2),
the count a measured backward efficiency is relative to."""

LINK_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
"""Collectives a link may carry figures of its own for (`Link.ops`): the ring ones and
expert parallelism's all-to-all."""


@dataclass(frozen=True)
class Link:
    """A link as one GPU sees it: nominal bandwidth per direction, achieved fraction, latency."""

    name: str
    bandwidth: float
    """Bytes/s per GPU per direction, nominal."""
    efficiency: float
    """Fraction of `bandwidth` that collectives and transfers achieve."""
    latency: float
    """Seconds per message or collective call (launch and set-up)."""
    step_latency: float = 0.0
    """Seconds per step of a ring collective (a hop's synchronisation: an all-reduce over n
    GPUs takes 2 (n-1) steps, an all-gather n-1), on top of `latency`."""
    p2p: tuple[float, float] | None = None
    """(latency seconds, achieved bytes/s) of a point-to-point message where measured apart
    from the ring collectives (`ptdp calibrate`: on gloo a send costs a third of an
    all-reduce's latency); None: as the collectives."""
    ops: tuple[tuple[str, float, float], ...] = ()
    """(collective, latency seconds, achieved bus bytes/s) of each collective measured
    apart (`ptdp calibrate` on CPUs: over gloo a reduce-scatter moved its bytes at a third
    of an all-reduce's rate); the others: the link's own figures."""

    @property
    def achieved(self) -> float:
        return self.bandwidth * self.efficiency

    def collective(self, op: str) -> tuple[float, float]:
        """(latency seconds, achieved bus bytes/s) of collective `op` on this link."""
        return next(
            ((lat, bw) for name, lat, bw in self.ops if name == op), (self.latency, self.achieved)
        )

    def transfer_seconds(self, nbytes: float) -> float:
        """One point-to-point message of `nbytes` (a pipeline transfer, a cp ring shift)."""
        if self.p2p is not None:
            latency, bandwidth = self.p2p
            return latency + nbytes / bandwidth
        return self.latency + nbytes / self.achieved


@dataclass(frozen=True)
class Device:
    """One accelerator: peak rates, memory and the calibrated achieved fractions."""

    name: str
    kind: str
    peak_tflops: tuple[tuple[str, float], ...]
    """(precision, dense TFLOP/s) pairs."""
    memory_bytes: float
    memory_bandwidth: float
    """HBM bytes/s, nominal."""
    gemm_efficiency: float
    """Fraction of the dense peak that a large GEMM sustains."""
    memory_efficiency: float
    """Fraction of `memory_bandwidth` that streaming (element-wise) kernels reach."""
    kernel_overhead: float
    """Seconds of fixed cost per kernel (launch, tail)."""
    reserved_bytes: float | None
    """Memory the framework holds beside the model's count, as the file fixes it
    (`reserved_gib`); None: per layout and rank by `ptdp.perf.cost.reserve`'s formula."""
    match: tuple[str, ...] = ()
    gemm_curve: tuple[tuple[float, float], ...] = ()
    """Measured (GEMM FLOPs, efficiency) knots, sizes increasing, efficiency non-decreasing;
    when given, it replaces `gemm_efficiency` (see `gemm_efficiency_at`)."""
    attention_efficiency: float = 0.0
    """Fraction of the peak the fused attention forward sustains (0: `gemm_efficiency`)."""
    attention_backward_ratio: float = 0.0
    """Fused attention backward / forward time as measured (0: the software's figure)."""
    attention_curve: tuple[tuple[float, float, float], ...] = ()
    """Measured (causal FLOPs per sequence and head, forward efficiency, backward efficiency
    of `BACKWARD_FLOPS` times those FLOPs) knots; when given, they replace the two figures
    above (see `attention_at`)."""
    memory_kernels: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    """Measured (kernel, ((bytes moved per call, bytes/s), ...)): each memory-bound kernel's
    bandwidth from inside the caches to past them (see `kernel_bandwidth`)."""
    layer_overhead: tuple[float, float] = (0.0, 0.0)
    """Seconds per transformer layer and microbatch, (forward, backward), that no kernel
    runs: Python, the dispatcher, autograd (`ptdp calibrate` on a CPU measures it)."""
    head_overhead: tuple[float, float] = (0.0, 0.0)
    """The same for the embedding, output layer and loss of one microbatch."""
    optimizer_overhead: tuple[float, float] = (0.0, 0.0)
    """Seconds of the optimizer step beyond the bytes it moves, (per step, per parameter
    tensor): a CPU's foreach AdamW, gradient norm and clipping run tensor by tensor
    (`ptdp calibrate` on a CPU measures it; 0 on GPUs, whose fused kernel takes them all)."""
    collective_sync: float = 0.0
    """Seconds each blocking collective between compute costs beyond moving its bytes: the
    ranks' resynchronisation (the later rank woken only after the earlier one went back to
    compute) and the tensor-parallel autograd functions' Python (`ptdp calibrate` measures
    it on CPUs, where the host runs the collective; 0: none, as on GPUs)."""
    wait_after_compute: float = 0.0
    """Seconds more such a wait costs when it follows milliseconds of compute rather than
    another wait: the ranks come to it out of step, and on a CPU the later one's wake-up
    then sometimes waits milliseconds (`ptdp calibrate` on CPUs; 0 on GPUs)."""
    split_backward_ratio: float = 1.0
    """(B + W) / fused seconds of a backward split for a zero-bubble schedule: W reads each
    layer's input and output gradient back after B instead of while they are in cache
    (`ptdp calibrate` on CPUs measures it; 1: no cost, the figure where none was measured)."""
    ring_sync: float | None = None
    """Seconds each key/value shift of ring attention costs beyond moving its bytes: an
    isend and an irecv both ways, waited on between the ring's own kernels and Python
    (`ptdp calibrate` on CPUs; None: `collective_sync`'s figure)."""

    @property
    def shift_sync(self) -> float:
        """What a ring shift costs beyond its bytes (`ring_sync`, else `collective_sync`)."""
        return self.collective_sync if self.ring_sync is None else self.ring_sync

    @property
    def gloo(self) -> bool:
        """ptdp's collectives on this device go over gloo (a CPU; NCCL on GPUs): its
        reduce-scatter is an all-reduce of the whole tensor where the runtime needs one
        along a dimension (`comm._reduce_scatter`), and a send is written in the thread that
        posts it, so no compute hides it."""
        return self.kind == "cpu"

    def gemm_efficiency_at(self, flops: float) -> float:
        """Efficiency of a GEMM of `flops`: the measured curve (log-linear between its knots,
        flat beyond them) if there is one, else the single `gemm_efficiency`."""
        return interpolate_log(self.gemm_curve, flops) if self.gemm_curve else self.gemm_efficiency

    def attention_at(self, flops_per_head: float) -> tuple[float, float]:
        """(forward efficiency, backward / forward) of fused attention doing `flops_per_head`
        per sequence and head: the measured curve (log-linear between knots, flat beyond)
        if there is one, else the two single figures (0: not measured)."""
        curve = self.attention_curve
        if not curve:
            return self.attention_efficiency, self.attention_backward_ratio
        forward = interpolate_log([(x, y) for x, y, _ in curve], flops_per_head)
        backward = interpolate_log([(x, b) for x, _, b in curve], flops_per_head)
        return forward, BACKWARD_FLOPS * forward / backward

    def kernel_bandwidth(self, kernel: str, nbytes: float) -> float:
        """Bytes/s of memory-bound `kernel` moving `nbytes` in one call: its measured curve
        if there is one, else what streaming kernels reach."""
        for name, curve in self.memory_kernels:
            if name == kernel:
                return interpolate_log(curve, nbytes)
        return self.memory_bandwidth * self.memory_efficiency

    def peak_flops(self, precision: str) -> float:
        """Dense FLOP/s at `precision` (fp32, tf32, bf16 or fp16)."""
        table = dict(self.peak_tflops)
        if table.get(precision, 0.0) <= 0:
            raise ConfigError(f"device {self.name} has no {precision} peak; known: {table}")
        return table[precision] * 1e12


@dataclass(frozen=True)
class System:
    """A cluster of identical nodes: `gpus_per_node` devices joined by `intra`, nodes by `inter`."""

    name: str
    description: str
    device: Device
    gpus_per_node: int
    intra: Link
    inter: Link
    host_memory_bytes: float | None = None
    """The node's host (CPU) memory, shared by its `gpus_per_node` ranks (`[node]
    host_memory_gib`; `ptdp.perf.cost.host_memory`); None: not given, not checked."""

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node
