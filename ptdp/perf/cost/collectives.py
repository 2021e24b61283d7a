"""Seconds of one collective over a group of GPUs, and the link the group runs on.

A ring all-reduce of N bytes over n GPUs moves 2 (n-1)/n N bytes per
GPU in 2 (n-1) steps, a reduce-scatter or all-gather (n-1)/n N in n - 1 steps, at the bus
bandwidth of the group's slowest link, plus one latency per call and one step latency per
step (the alpha-beta model of Thakur et al. 2005): small messages, as tensor parallelism
at a small hidden size sends, pay mostly latency. Which link a group uses follows from
its ranks and the node size (`group_link`).

Expert parallelism's all-to-alls (`all_to_all_seconds`, `ptdp.perf.cost.experts`): each of
the n GPUs sends its bytes for the others in n - 1 pairwise steps at once, one latency per
call and a step latency per peer.
"""

from __future__ import annotations

import functools
import math
from collections import Counter

from ptdp.perf.cost.hardware import Link, System


def all_reduce_seconds(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce over n GPUs: one call's latency, 2 (n-1) steps each paying the
    link's step latency, and 2 (n-1)/n N bytes per GPU at the achieved bus bandwidth (the
    link's all-reduce figures where it has them, `Link.ops`)."""
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1)
    latency, bandwidth = link.collective("all_reduce")
    return latency + steps * link.step_latency + steps / n * nbytes / bandwidth


def gather_seconds(nbytes: float, n: int, link: Link, op: str = "all_gather") -> float:
    """Ring all-gather (`op` "reduce_scatter": reduce-scatter) of a full tensor of `nbytes`
    over n GPUs: n - 1 steps, (n-1)/n N bytes per GPU."""
    if n <= 1:
        return 0.0
    steps = n - 1
    latency, bandwidth = link.collective(op)
    return latency + steps * link.step_latency + steps / n * nbytes / bandwidth


def all_to_all_seconds(sent: float, n: int, link: Link) -> float:
    """An all-to-all over n GPUs in which each sends `sent` bytes to the others (n - 1
    pairwise steps, every pair at once on a switched link): one call's latency, a step
    latency per peer, and the bytes at the link's all-to-all bandwidth (`Link.ops`, from
    `ptdp calibrate`; else its own figure)."""
    if n <= 1:
        return 0.0
    latency, bandwidth = link.collective("all_to_all")
    return latency + (n - 1) * link.step_latency + sent / bandwidth


def group_members(size: int, stride: int, period: int) -> list[list[int]]:
    """Every group of `size` GPUs spaced `stride` apart in rank order whose first GPU lies
    in [0, period) (tp groups: stride 1; dp groups: stride t, as `ptdp.parallel.mesh`
    orders ranks)."""
    bases = [r for r in range(period) if (r // stride) % size == 0]
    return [[base + i * stride for i in range(size)] for base in bases]


@functools.lru_cache(maxsize=4096)  # the planner asks again for every layout it weighs
def group_link(system: System, size: int, stride: int) -> Link:
    """The bottleneck link of the slowest group of `size` GPUs spaced `stride` apart.

    Which nodes a group spans comes from its members' ranks and the node size, over one
    period of the pattern (groups need not divide a node: t = 3 on 8-GPU nodes puts one
    group across two). A group inside one node runs on the NVLink/NVSwitch link. A group
    across nodes runs its ring through the network cards of its members: with k members
    on the node that holds fewest (k cards there), its bus bandwidth is k times one
    card's, capped by the in-node link, and every ring step waits for a network hop.
    """
    per_node = system.gpus_per_node
    if size <= 1:
        return system.intra
    period = math.lcm(size * stride, per_node)
    cards = [
        min(Counter(system.node_of(gpu) for gpu in group).values())
        for group in group_members(size, stride, period)
        if system.node_of(group[0]) != system.node_of(group[-1])
    ]
    if not cards:
        return system.intra
    k = min(cards)
    inter = system.inter
    bandwidth = min(system.intra.achieved, k * inter.achieved)
    return Link(f"{k} x {inter.name}", bandwidth, 1.0, inter.latency, inter.step_latency)
