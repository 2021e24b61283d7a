"""Seconds of context parallelism: a cp rank's layer and its K/V transfers (the bytes and
the model are in `ptdp.perf.cost.context`)."""

from __future__ import annotations

from ptdp.config.enums import CpComm, Recompute
from ptdp.config.sections import ModelConfig
from ptdp.perf.cost.collectives import gather_seconds, group_link
from ptdp.perf.cost.context import kv_block_bytes, local_model
from ptdp.perf.cost.costs import Compute, Passes, attention_core, layer_seconds, sync_seconds
from ptdp.perf.cost.hardware import Link, System

MIN_CP_TOKENS = 4096
"""The planner searches cp > 1 only while each rank keeps at least this many tokens: below,
a rank's attention blocks are too short to hide the ring's transfers, and the activations
of so short a sequence fit without it."""


def ring_link(system: System, tp: int, cp: int) -> Link:
    """The slowest hop of a cp ring whose ranks are tp apart: NVLink inside a node, else the
    network card of one GPU (every GPU sends to its neighbour at once)."""
    return system.intra if tp * cp <= system.gpus_per_node else system.inter


def cp_comm_seconds(
    model: ModelConfig, *, micro_batch: int, tp: int, cp: int, comm: CpComm, c: Compute
) -> tuple[Passes, Passes]:
    """One layer, one microbatch: (seconds on the wire, seconds exposed) as F and B passes."""
    if cp == 1:
        return Passes(), Passes()
    kv = kv_block_bytes(model, micro_batch=micro_batch, tp=tp, cp=cp, e=c.e)
    if comm is CpComm.ALLGATHER:
        link = group_link(c.system, cp, tp)
        gather = gather_seconds(cp * kv, cp, link)  # forward
        reduce = gather_seconds(cp * kv, cp, link, "reduce_scatter")  # backward
        wire = Passes(gather, reduce, 0.0)
        return wire, wire + Passes(sync_seconds(1, c), sync_seconds(1, c), 0.0)
    link = ring_link(c.system, tp, cp)
    core = attention_core(model, micro_batch, tp, c).times(1.0 / cp)
    if c.system.device.gloo:  # a send costs the thread that posts it: nothing hides it
        core = Passes()
    one, two = link.transfer_seconds(kv), link.transfer_seconds(2 * kv)
    steps = cp - 1
    wire = Passes(steps * one, steps * two + one, 0.0)
    exposed = Passes(
        steps * max(0.0, one - core.f / cp), steps * max(0.0, two - core.b / cp) + one, 0.0
    )
    # Every shift is waited on by both ends: steps forward; backward, the key/value blocks
    # and the gradient accumulator each step, and the accumulator's last hop home. The
    # first wait of each step follows its block's kernel; the others follow a wait.
    shift, after = c.system.device.shift_sync, c.system.device.wait_after_compute
    waits = Passes(steps * (shift + after), (2 * steps + 1) * shift + (steps + 1) * after, 0.0)
    return wire, exposed + waits


def cp_layer_seconds(
    model: ModelConfig,
    *,
    micro_batch: int,
    tp: int,
    sequence_parallel: bool,
    recompute: Recompute,
    c: Compute,
    cp: int = 1,
    comm: CpComm = CpComm.RING,
    moe: bool = False,
    ep: int = 1,
    etp: int | None = None,
) -> Passes:
    """`costs.layer_seconds` of one cp rank: the s/cp-token layer, its attention the cp
    blocks of s/cp tokens the ring computes (all-gather: 1/cp of the whole sequence's
    kernel), plus the exposed K/V transfers (module doc); `moe`: an MoE layer, its experts
    split over `ep` ranks (their all-to-alls apart: `ptdp.perf.cost.experts`)."""
    local = local_model(model, cp)
    passes = layer_seconds(
        local,
        micro_batch=micro_batch,
        tp=tp,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        c=c,
        moe=moe,
        ep=ep,
        etp=etp,
    )
    if cp == 1:
        return passes
    short = attention_core(local, micro_batch, tp, c)
    if comm is CpComm.RING:
        # Under the balanced split the ring computes cp blocks, each with the work of the
        # rank's own causal block of s/cp tokens (the others are full half-blocks): the
        # layer above holds one, the rest run at that block's efficiency.
        extra = Passes((cp - 1) * short.f, (cp - 1) * short.b, 0.0)
    else:  # one call against the whole window's keys: 1/cp of the whole sequence's kernel
        whole = attention_core(model, micro_batch, tp, c).times(1.0 / cp)
        extra = Passes(whole.f - short.f, whole.b - short.b, 0.0)
    _, exposed = cp_comm_seconds(model, micro_batch=micro_batch, tp=tp, cp=cp, comm=comm, c=c)
    passes = passes + extra + exposed
    if recompute is not Recompute.NONE:  # the attention forward reruns in B, transfers too
        passes += Passes(0.0, extra.f + exposed.f, 0.0)
    return passes


def best_comm(
    model: ModelConfig,
    *,
    micro_batch: int,
    tp: int,
    sequence_parallel: bool,
    recompute: Recompute,
    c: Compute,
    cp: int,
) -> CpComm:
    """The cp_comm whose layer is faster on this system (ring on a tie)."""

    def seconds(comm: CpComm) -> float:
        p = cp_layer_seconds(
            model,
            micro_batch=micro_batch,
            tp=tp,
            sequence_parallel=sequence_parallel,
            recompute=recompute,
            c=c,
            cp=cp,
            comm=comm,
        )
        return p.f + p.b + p.w

    return min((CpComm.RING, CpComm.ALLGATHER), key=seconds)
