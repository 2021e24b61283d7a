"""Memory a rank's framework holds beside the model's count: CUDA context, NCCL buffers, allocator.

A fixed reserve per device file is wrong both ways: a one-GPU run holds a context and no
communicator, a PTD-P rank sits in five or six communicators, and the caching allocator's
waste grows with the transients, not with nothing. So the reserve of one pipeline rank is

    context + sum over its communicators (collective rings/trees + point-to-point) + allocator

with each term from a documented default or the source that sets it (no constant is fitted
to a training result). A device file's `[device.achieved] reserved_gib`, when given,
replaces the whole formula (a user who measured theirs; CPU calibration files keep 1 GiB).

Sources (NCCL `src/` read at NVIDIA/nccl 5067397, June 2026; figures also in older releases):
- CUDA context with the libraries' kernels: 0.75 GiB under lazy module loading
  (`CUDA_MODULE_LOADING=LAZY`, PyTorch's default since 1.13 / CUDA 11.7), measured on one
  H100 with torch 2.11 and CUDA 13.0 (`CUDA_CONTEXT_BYTES`); PyTorch PR #86509 measured
  287 MB lazy and 667 MB eager on an older stack (https://github.com/pytorch/pytorch/pull/86509).
- One NCCL connection's buffers, per protocol (`src/init.cc` `computeBuffSizes`): LL
  `NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x 16 B` = 8 x 512 x 8 x 16 =
  512 KiB; LL128 `NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x NCCL_STEPS x 8 B` =
  120 x 640 x 8 x 8 = 4.69 MiB; Simple `NCCL_BUFFSIZE` = 4 MiB (1 << 22; constants in
  `src/include/device.h`): 9.19 MiB. NVIDIA/nccl issue #1685 (8x H100,
  `NCCL_DEBUG_SUBSYS=ALLOC`) logs two allocations per connection and channel, 10485760 B
  (those 9.19 MiB in 2 MiB granules) and 2097152 B (read here as the other end's share):
  `CONNECTION_BYTES` = 12 MiB.
- A point-to-point connection across nodes uses the Simple protocol only, of
  `NCCL_P2P_NET_CHUNKSIZE x NCCL_STEPS` = 128 KiB x 8 = 1 MiB (`src/init.cc`; LL buffers only
  with `NCCL_ALLOC_P2P_NET_LL_BUFFERS=1`), in a 2 MiB granule, plus the 2 MiB send side.
- Channels: a collective communicator inside one NVSwitch node runs 32 (NCCL's logs on
  8-GPU A100/H100 nodes: "32 coll channels, ..., 32 p2p channels, 32 p2p channels per
  peer"); one spanning nodes runs 2 per NIC (the graph search finds one ring per NIC and
  `src/graph/connect.cc` duplicates them, `nChannels * 2`; issue #1453's 3-node H100 log:
  "Channel 00/16"). A point-to-point peer gets 32 channels inside a node and 2 in a
  communicator that spans nodes (`src/graph/paths.cc` `ncclTopoComputeP2pChannelsPerPeer`
  takes the minimum over every peer, and a network peer gets `NCCL_NCHANNELS_PER_NET_PEER`,
  2 by default, logged as "2 p2p channels per peer").
- Connections per channel: a ring receives from one neighbour ("Ring uses a limited amount
  of memory as it only has 2 connections regardless of the scale", NCCL maintainer in
  issue #864/#986); a communicator spanning nodes also connects its tree (up and down), so
  three. `NCCL_RUNTIME_CONNECT=1` (default since 2.22) connects only the algorithms a
  communicator runs: counting ring and tree for every spanning communicator is the upper end.
- NVLink SHARP (NVLS) on H100/H200 NVSwitch nodes (`NCCL_NVLS_ENABLE=2`, on where the GPU
  reports multicast support; `src/transport/nvls.cc`): `NVLS_NCHANNELS_SM90` = 16 channels x
  2 x (`NCCL_NVLS_CHUNKSIZE` 128 KiB x `NCCL_STEPS` 8) x one head per local rank of the
  communicator (`ncclNvlsBufferSetup`): 32 MiB per local rank, 256 MiB for a group of 8.
- PyTorch's `batch_isend_irecv`, which ptdp's pipeline and cp ring use, runs on the group's
  own communicator (a lone send/recv would make a 2-rank one): ProcessGroupNCCL.cpp
  `pointToPoint`, "For batch P2P, we need to treat it like a collective when selecting
  communicator".
- Check against a measurement: #1685's intra-node all-to-all connects 7 peers x 32 channels,
  7 x 32 x 12 MiB = 2.82 GB by this formula against 3.28 GB measured (the formula is 14% low).

Not sourced (named terms, kept conservative):
- The caching allocator's fragmentation. Its documented rules (c10/cuda/CUDACachingAllocator:
  requests over 1 MiB come from the large pool, 1-10 MiB out of 20 MiB segments, larger ones
  cudaMalloc'ed rounded up to 2 MiB; a free block is split for smaller requests and merges
  only with free neighbours in its segment) bound the rounding at 2 MiB a segment (none for
  an [s b, h] tensor whose bytes are a multiple of 2 MiB, e.g. s = 2048 with h a multiple of
  512; not counted), but no source gives how much of a step's churn stays unreusable.
  `FRAGMENTED_TRANSIENTS` reserves the largest transient tensor once more
  (`largest_transient`: on the last stage the loss's logit gradient, fp32 [s b, v/t], or
  compiled at t = 1 the 16-bit [s b, v] buffer it shares with the logits; else the MLP's
  [s b, parts f/t] input-of-activation gradient): a smaller request may split that block
  while it is free, so the next request of its size needs a new segment. It grows with
  the activations (b, s), as fragmentation does. On one H100 the allocator held 0.28-2.83
  GiB beside the peak, against 1.53-3.07 GiB from this term (BENCHMARKS.md).
- The communicators a rank does not run anything on are still counted (PyTorch creates a
  group's NCCL communicator at its first collective; ptdp uses every group it builds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ptdp.config.enums import Activation, CpComm
from ptdp.config.sections import RunConfig
from ptdp.perf.cost.hardware import Device, System
from ptdp.perf.cost.memory import MemoryEstimate
from ptdp.perf.cost.moe import dense_equivalent
from ptdp.perf.cost.parameters import element_bytes
from ptdp.pipeline.placement import Placement
from ptdp.rules.layout import COMBINED, ORDER, Layout

MIB = 2**20
CUDA_CONTEXT_BYTES = 0.75 * 2**30
"""The CUDA context with the libraries' kernels under lazy module loading, PyTorch's default
since 1.13: measured on one H100 (torch 2.11, CUDA 13.0) as what a training process used
beyond PyTorch's reserved memory, 0.749-0.753 GiB in seven runs, eager and compiled, 125M
to 4B parameters (BENCHMARKS.md, "One H100: the GPU check"); PyTorch PR #86509 had 287 MB
for an older stack."""
CONNECTION_BYTES = 12 * MIB
"""One NVLink or collective connection and channel: LL + LL128 + Simple = 9.19 MiB in 2 MiB
granules at the receiver (10 MiB) and 2 MiB at the sender (NVIDIA/nccl #1685)."""
NET_P2P_CONNECTION_BYTES = 4 * MIB
"""A point-to-point connection over the network: Simple only, 1 MiB in a 2 MiB granule, and
the 2 MiB send side."""
NODE_CHANNELS = 32
"""Collective channels, and point-to-point channels per peer, inside one NVSwitch node."""
P2P_CHANNELS_PER_NET_PEER = 2
"""`NCCL_NCHANNELS_PER_NET_PEER`'s default: per peer in a communicator spanning nodes."""
MAX_CHANNELS = 32
"""The channels NCCL logs at most on these systems ("32 coll channels")."""
NVLS_BYTES_PER_LOCAL_RANK = 16 * 2 * 128 * 1024 * 8
"""NVLS buffers per head (one head per local rank of the communicator) on H100/H200."""
NVLS_KINDS = ("h100-sxm", "h200")
"""Device kinds whose built-in nodes (HGX/DGX, NVSwitch) support NVLink multicast."""
FRAGMENTED_TRANSIENTS = 1.0
"""Not sourced: copies of the largest transient tensor the allocator may hold unreusable."""


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator a rank belongs to and what it runs."""

    name: str
    ranks: Sequence[int]
    collectives: bool
    """Runs collectives (ring channels, and a tree if it spans nodes)."""
    peers: tuple[int, ...] = ()
    """Ranks this one exchanges point-to-point messages with on it."""


@dataclass(frozen=True)
class Reserve:
    """Bytes one rank holds beside the model's count, by term."""

    context: float
    nccl: float
    allocator: float
    fixed: float | None = None
    """The device file's `reserved_gib` in bytes, replacing the formula when given."""

    @property
    def total(self) -> float:
        return self.fixed if self.fixed is not None else self.context + self.nccl + self.allocator


def communicators(cfg: RunConfig, layout: Layout, rank: int) -> list[Communicator]:
    """The NCCL communicators of global `rank` (`ptdp.parallel.mesh`): each axis group of more
    than one rank, dp_cp under cp, ep and edp under expert parallelism, the tied embedding's
    pair, and the world, on which the pipeline's sends and receives run
    (`comm.send_recv_async` names global peers). Only this rank's groups are built, by
    arithmetic (the planner asks for thousands of ranks)."""
    sizes = {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp}
    world = math.prod(sizes.values())
    if world == 1:
        return []
    out = []
    for axis in (*ORDER[:3], *COMBINED, "pp"):
        if axis == "dp_cp" and layout.cp == 1:  # the same group as dp
            continue
        ranks = _group(sizes, rank, axis)
        if len(ranks) < 2:
            continue
        ring_p2p = axis == "cp" and cfg.parallel.cp_comm is CpComm.RING
        peers = _neighbours(ranks, rank, wrap=True) if ring_p2p else ()
        out.append(Communicator(axis, ranks, collectives=not ring_p2p, peers=peers))
    out += _expert_communicators(layout, _group(sizes, rank, "dp_cp"), rank)
    stages = _group(sizes, rank, "pp")
    if layout.pp > 1 and cfg.model.tie_embeddings and rank in (stages[0], stages[-1]):
        out.append(Communicator("embedding", (stages[0], stages[-1]), collectives=True))
    # An interleaved (looped) pipeline also sends from the last stage to the first.
    looped = layout.vpp > 1 and layout.stages.placement is Placement.LOOPED
    out.append(Communicator("world", range(world), True, _neighbours(stages, rank, looped)))
    return out


def _expert_communicators(layout: Layout, dp_cp: range, rank: int) -> list[Communicator]:
    """Under expert parallelism: the ep group, whose all-to-alls connect every member to
    every other point to point, and the edp group reducing the experts' gradients (both
    split from `rank`'s dp_cp group, `ptdp.rules.layout.EXPERT_AXES`)."""
    ep = layout.ep
    if ep <= 1:
        return []
    i = dp_cp.index(rank)
    members = dp_cp[i - i % ep : i - i % ep + ep]
    peers = tuple(r for r in members if r != rank)
    out = [Communicator("ep", members, collectives=False, peers=peers)]
    if len(dp_cp) > ep:
        out.append(Communicator("edp", dp_cp[i % ep :: ep], collectives=True))
    return out


def _group(sizes: dict[str, int], rank: int, axis: str) -> range:
    """The ranks of `rank`'s group along `axis` (a mesh axis or a `COMBINED` one, whose axes
    are adjacent in `ORDER`): evenly spaced, the stride of its fastest axis."""
    inner = COMBINED.get(axis, (axis,))
    stride = math.prod(sizes[a] for a in ORDER[: ORDER.index(inner[0])])
    span = stride * math.prod(sizes[a] for a in inner)
    start = rank % stride + rank // span * span
    return range(start, start + span, stride)


def _neighbours(ring: Sequence[int], rank: int, wrap: bool) -> tuple[int, ...]:
    """The previous and next member (of a ring if `wrap`; one peer for two members)."""
    i, n = ring.index(rank), len(ring)
    near = {ring[(i - 1) % n], ring[(i + 1) % n]} if wrap else set(ring[max(0, i - 1) : i + 2])
    return tuple(sorted(near - {rank}))


def _in_node(ranks: Sequence[int], node: int, gpus_per_node: int) -> int:
    """How many of `ranks` sit on `node` (a range counted without walking it)."""
    if not isinstance(ranks, range):
        return sum(r // gpus_per_node == node for r in ranks)
    lo, hi, step = node * gpus_per_node, (node + 1) * gpus_per_node, ranks.step
    first = max(0, -(-(lo - ranks.start) // step))  # members k with lo <= start + k step < hi
    last = min(len(ranks), -(-(hi - ranks.start) // step))
    return max(0, last - first)


def nccl_bytes(comm: Communicator, rank: int, gpus_per_node: int, nvls: bool = False) -> float:
    """Buffers one rank holds for `comm`: collective channels x connections x 12 MiB (and
    NVLS's per local rank where `nvls`), plus point-to-point peers x channels per peer x the
    connection's buffers (module doc)."""
    node = rank // gpus_per_node
    local = _in_node(comm.ranks, node, gpus_per_node)
    spans = local < len(comm.ranks)
    total = 0.0
    if comm.collectives:
        channels = min(MAX_CHANNELS, 2 * gpus_per_node) if spans else NODE_CHANNELS
        total += channels * (3 if spans else 1) * CONNECTION_BYTES
        if nvls and local > 1:
            total += local * NVLS_BYTES_PER_LOCAL_RANK
    per_peer = P2P_CHANNELS_PER_NET_PEER if spans else NODE_CHANNELS
    for peer in comm.peers:
        remote = peer // gpus_per_node != node
        total += per_peer * (NET_P2P_CONNECTION_BYTES if remote else CONNECTION_BYTES)
    return total


def rank_reserve(
    cfg: RunConfig,
    layout: Layout,
    system: System,
    memory: MemoryEstimate,
    seen: dict[tuple, float] | None = None,
) -> Reserve:
    """The reserve of pipeline rank `memory.rank` (its tp = cp = dp = 0 member; the others
    sit in groups of the same sizes and spans on the built-in nodes). `seen` keeps the NCCL
    term by `_position`, and the allocator's by stage kind, for the other ranks of the same
    layout."""
    device = system.device
    if device.reserved_bytes is not None:
        return Reserve(0.0, 0.0, 0.0, fixed=device.reserved_bytes)
    seen = {} if seen is None else seen
    key = _position(layout, memory.rank, system.gpus_per_node)
    if key not in seen:
        rank = memory.rank * layout.tp * layout.cp * layout.dp
        nvls = device.kind in NVLS_KINDS
        comms = communicators(cfg, layout, rank)
        seen[key] = sum(nccl_bytes(c, rank, system.gpus_per_node, nvls) for c in comms)
    last = (memory.rank == layout.stages.rank(layout.stages.last),)
    if last not in seen:
        seen[last] = FRAGMENTED_TRANSIENTS * largest_transient(cfg, layout, last[0])
    return Reserve(CUDA_CONTEXT_BYTES, seen[key], seen[last])


def _position(layout: Layout, stage_rank: int, gpus_per_node: int) -> tuple[int, ...]:
    """What a pipeline rank's communicators depend on: its offset in its node (its tp, cp,
    dp groups are the first rank's shifted by whole stages), first or last stage (embedding
    pair, pipeline neighbours), the stages and ranks its node holds."""
    step = layout.tp * layout.cp * layout.dp
    rank, world = stage_rank * step, step * layout.pp
    node = rank // gpus_per_node
    return (
        rank % gpus_per_node,
        stage_rank == 0,
        stage_rank == layout.pp - 1,
        _in_node(range(0, world, step), node, gpus_per_node),
        _in_node(range(world), node, gpus_per_node),
    )


def largest_transient(cfg: RunConfig, layout: Layout, last_stage: bool) -> float:
    """Bytes of the largest tensor a backward allocates and frees on one rank: the MLP's
    input-of-activation gradient [s b, parts f/t], or on the last stage the loss's logit
    gradient, fp32 [s b, v/t], or compiled at t = 1 the 16-bit [s b, v] buffer it writes
    over the saved logits (`ptdp.perf.cost.memory`'s transients; s/cp tokens under cp)."""
    model, t, e = cfg.model, layout.tp, element_bytes(cfg.train.precision)
    tokens = model.seq_length // layout.cp * cfg.train.micro_batch_size
    parts = 2 if model.activation is Activation.SWIGLU else 1
    width = model.ffn_size  # an MoE layer's: its dense equivalent's (ptdp.perf.cost.moe)
    if model.num_experts:
        width = max(width, dense_equivalent(model).ffn_size)
    mlp = e * parts * width // t
    per_logit = e if cfg.train.compile and t == 1 else 4
    logits = per_logit * (model.padded_vocab_size(t) // t) if last_stage else 0
    return float(tokens * max(mlp, logits))


def with_reserve(
    memory: list[MemoryEstimate], cfg: RunConfig, layout: Layout, system: System
) -> list[MemoryEstimate]:
    """`memory` with each pipeline rank's `reserved` set (`rank_reserve`)."""
    seen: dict[tuple, float] = {}
    return [replace(m, reserved=rank_reserve(cfg, layout, system, m, seen).total) for m in memory]


def fit(
    memory: tuple[MemoryEstimate, ...] | list[MemoryEstimate], device: Device
) -> tuple[float, float]:
    """(need, usable) at the rank nearest its limit: the model's count there and the device's
    memory less that rank's reserve. The layout fits if need <= usable."""
    worst = max(memory, key=lambda m: m.total + m.reserved)
    return worst.total, device.memory_bytes - worst.reserved
