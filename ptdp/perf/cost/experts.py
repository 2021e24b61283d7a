"""Seconds of expert parallelism: the all-to-alls of an MoE layer (the bytes and what a rank
holds are in `ptdp.perf.cost.moe` and `ptdp.perf.cost.parameters`).

Per MoE layer and microbatch a rank runs 4 all-to-alls over its ep group: dispatch and
combine in forward, their conjugates in backward, each sending `moe.alltoall_bytes` of the
rows it routes (`folding.Experts.routed_tokens`: its sequence shard, gathered over etp) to
the other ranks, times `Software.moe_load_imbalance` (the rank holding the busiest expert
receives that much over the mean: exact with one expert per rank, a bound above). They
block the layer (the experts wait for their rows, the next layer for the combined output);
full recomputation runs the forward pair again in the backward. With `parallel.moe_overlap`
(1F1B's forward of one microbatch paired with the backward of another, DualPipe's and
Megatron-Core's "1F1B A2A overlap") a pass's all-to-alls run behind the other pass's
compute of the same layer: exposed = max(0, all-to-alls - paired compute) (`overlapped`).

Links. An ep group is ep ranks etp apart (`ptdp.perf.cost.folding`): inside one node while
ep etp fits in it (NVLink/NVSwitch). Across nodes
each GPU sends its rows for the peers on other nodes through its own network card while
those for its node's peers go over NVLink, at once: the GPU with the fewest group members
on its node (k) sends (ep - k)/(ep - 1) of its bytes over the network (`alltoall_link`).
A deduplicating dispatch (`Software.moe_node_dedup`, DeepEP) sends a token over the network
once per other node holding any of its experts (of the N nodes' e / N experts each, a node
is hit with probability 1 - C(e - e/N, k) / C(e, k)) and fans it out over NVLink there:
the slower of the network's bytes and NVLink's (every row bound to another GPU crosses
NVLink once, from its sender or from the node's receiving GPU), `dedup_seconds`.
Group-limited routing (model.moe_router_groups, DeepSeek-V3's node-limited routing) takes a
token's experts from its best G = moe_router_group_top_k groups only; where a node holds
whole groups (DeepSeek-V3 on 8 nodes: one group of 32 experts each) a node is hit when one
of its groups is chosen, 1 - C(groups - its groups, G) / C(groups, G), which bounds the
nodes a token crosses to by G (`node_hit`).

Letters: t = tokens of a microbatch on a rank (s b / cp), k = experts per token, h =
hidden, e = bytes per element.
"""

from __future__ import annotations

import functools
import math
from collections import Counter

from ptdp.config.enums import Recompute
from ptdp.config.sections import ModelConfig
from ptdp.perf.cost.collectives import all_to_all_seconds, group_members
from ptdp.perf.cost.costs import Compute, Passes, sync_seconds
from ptdp.perf.cost.folding import Experts
from ptdp.perf.cost.hardware import Link, System
from ptdp.perf.cost.moe import alltoall_bytes


@functools.lru_cache(maxsize=4096)  # the planner asks again for every layout it weighs
def alltoall_link(system: System, size: int, stride: int) -> Link:
    """The link an all-to-all of `size` GPUs spaced `stride` apart runs at (module doc): the
    in-node link, or for a group across nodes one whose bandwidth takes each GPU's bytes
    split between its network card and NVLink, at the all-to-all figures of each
    (`Link.collective`), with the network's latencies."""
    if size <= 1:
        return system.intra
    local = _members_per_node(system, size, stride)
    if local == size:
        return system.intra
    _, intra = system.intra.collective("all_to_all")
    latency, inter = system.inter.collective("all_to_all")
    off, on = (size - local) / (size - 1), (local - 1) / (size - 1)
    bandwidth = 1.0 / max(off / inter, on / intra)
    name = f"{size - local} of {size - 1} peers over {system.inter.name}"
    step = system.inter.step_latency
    return Link(name, bandwidth, 1.0, latency, step, ops=(("all_to_all", latency, bandwidth),))


def _members_per_node(system: System, size: int, stride: int) -> int:
    """The fewest members of one group of `size` GPUs `stride` apart on any node it spans."""
    period = math.lcm(size * stride, system.gpus_per_node)
    return min(
        min(Counter(system.node_of(gpu) for gpu in group).values())
        for group in group_members(size, stride, period)
    )


def node_hit(experts: int, top_k: int, held: int, groups: int = 0, group_top_k: int = 0) -> float:
    """The probability that a token sends one of its top_k choices to a given node holding
    `held` of the `experts`, routed at random among them, or among its best `group_top_k`
    of `groups` groups (module doc); where a group spans several nodes, each chosen group
    takes top_k / group_top_k of the token's experts."""
    uniform = 1.0 - math.comb(experts - held, top_k) / math.comb(experts, top_k)
    if not groups or not group_top_k:
        return uniform
    size = experts // groups
    if held % size == 0:  # the node holds whole groups
        return 1.0 - math.comb(groups - held // size, group_top_k) / math.comb(groups, group_top_k)
    if size % held == 0:  # a group over size / held nodes
        picks = max(1, round(top_k / group_top_k))
        inside = 1.0 - math.comb(size - held, picks) / math.comb(size, picks)
        return group_top_k / groups * inside
    return uniform


def dedup_seconds(
    system: System,
    *,
    rows: float,
    tokens: float,
    experts: int,
    top_k: int,
    ep: int,
    stride: int,
    groups: int = 0,
    group_top_k: int = 0,
) -> float | None:
    """One deduplicating all-to-all (module doc) of `rows` bytes of token-choice rows from
    `tokens` bytes of tokens, over ep GPUs `stride` apart, routed among `group_top_k` of
    `groups` groups where those are set; None inside one node (a plain all-to-all there)."""
    local = _members_per_node(system, ep, stride)
    if local == ep:
        return None
    nodes = ep // local
    held = experts * local // ep  # a node's experts
    hit = node_hit(experts, top_k, held, groups, group_top_k)
    latency, inter = system.inter.collective("all_to_all")
    _, intra = system.intra.collective("all_to_all")
    wire = max(tokens * (nodes - 1) * hit / inter, rows * (ep - 1) / ep / intra)
    return latency + (ep - 1) * system.inter.step_latency + wire


def alltoall_seconds(
    model: ModelConfig, *, micro_batch: int, tp: int, ep: int, c: Compute, etp: int | None = None
) -> float:
    """One all-to-all (a dispatch or a combine) of one MoE layer and microbatch on a rank:
    `model` is the rank's (s/cp tokens under context parallelism); the rows it routes are
    its tokens gathered over etp (`Experts.routed_tokens`), over ep ranks etp apart."""
    if ep <= 1:
        return 0.0
    split = Experts.of(tp, 1, ep, etp)
    tokens = split.routed_tokens(model.seq_length * micro_batch)
    load = c.software.moe_load_imbalance
    sent = alltoall_bytes(tokens, model.moe_top_k, model.hidden_size, ep, c.e) * load
    if c.software.moe_node_dedup:
        row = tokens * model.hidden_size * c.e * load
        seconds = dedup_seconds(
            c.system,
            rows=row * model.moe_top_k,
            tokens=row,
            experts=model.num_experts,
            top_k=model.moe_top_k,
            ep=ep,
            stride=split.ep_stride,
            groups=model.moe_router_groups,
            group_top_k=model.moe_router_group_top_k,
        )
        if seconds is not None:
            return seconds
    return all_to_all_seconds(sent, ep, alltoall_link(c.system, ep, split.ep_stride))


def ep_comm_seconds(
    model: ModelConfig,
    *,
    micro_batch: int,
    tp: int,
    ep: int,
    recompute: Recompute,
    c: Compute,
    etp: int | None = None,
) -> Passes:
    """The 4 all-to-alls of one MoE layer and microbatch as F and B seconds (module doc):
    dispatch and combine in each pass, each waited on right after compute (CPUs: its
    resynchronisation); full recomputation repeats the forward pair in B."""
    if ep <= 1:
        return Passes()
    one = alltoall_seconds(model, micro_batch=micro_batch, tp=tp, ep=ep, c=c, etp=etp)
    pair = 2 * one + sync_seconds(2, c)
    again = pair if recompute is Recompute.FULL else 0.0
    return Passes(pair, pair + again, 0.0)


def overlapped(a2a: Passes, compute: Passes, fraction: float = 1.0) -> Passes:
    """`parallel.moe_overlap`: each pass's all-to-alls behind `fraction` of the paired
    microbatch's other pass of the same layer (F's behind B + W, B's behind F; `compute`
    without the all-to-alls); what is left is exposed."""
    behind_f, behind_b = fraction * (compute.b + compute.w), fraction * compute.f
    return Passes(max(0.0, a2a.f - behind_f), max(0.0, a2a.b - behind_b), a2a.w)


def reduction_groups(
    params: int, experts: int, *, tp: int, dp_cp: int, ep: int, etp: int | None = None
) -> list[tuple[int, int, int]]:
    """(parameters, group size, stride in GPUs) of the groups a rank's gradients of `params`
    parameters, `experts` of them routed experts', are reduced over (and ZeRO shards their
    state over): all over the dp cp ranks tp apart where the experts split like the dense
    layers (ep = 1, etp = t); else the routed experts' over their edp ranks etp ep apart
    (`folding.Experts`), the rest over dp cp."""
    split = Experts.of(tp, dp_cp, ep, etp)
    if not experts or (ep <= 1 and split.etp == tp):
        return [(params, dp_cp, tp)]
    return [(params - experts, dp_cp, tp), (experts, split.edp, split.edp_stride)]
