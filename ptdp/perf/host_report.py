"""Host memory in `ptdp simulate`'s report, as text and JSON (`ptdp.perf.cost.host_memory`)."""

from __future__ import annotations

from ptdp.perf.cost.hardware import GIB, System
from ptdp.perf.cost.host_memory import (
    HOST_RESERVE_FRACTION,
    NodeFit,
    Start,
    applies,
    node_fit,
    ranks,
)
from ptdp.perf.rank_rows import shown_ranks
from ptdp.perf.simulate.simulator import Prediction

HOST_FLAG = "[node] host_memory_gib in the hardware file, or --host-memory-gib"


def host_lines(p: Prediction, system: System, start: Start, async_save: bool) -> list[str]:
    """Each phase's host memory per rank of each pipeline rank, then whether the fullest
    node's ranks fit in its host memory."""
    if not applies(system):
        return [
            f"host memory: on {system.device.name} the training state above is host memory "
            "(starts and saves are not modelled apart)"
        ]
    capacity = system.host_memory_bytes
    node = (
        f"the node's {capacity / GIB:.0f} GiB shared by its {system.gpus_per_node} ranks, "
        f"{100 * HOST_RESERVE_FRACTION:.0f}% reserved"
        if capacity
        else "the node's host memory not given"
    )
    lines = [
        f"host memory per rank (GiB; {node}); each phase beside the process baseline, the "
        "training state in device memory:",
        "  pp rank | baseline | from HF | scratch | resume |  save | async save",
    ]
    fullest = max(p.host, key=lambda h: h.need(start, async_save)).rank
    for r in shown_ranks(len(p.host), fullest):
        if r is None:
            lines.append("      ... |")
            continue
        h = p.host[r]
        lines.append(
            f"  {h.rank:7d} | {h.baseline / GIB:8.2f} | {h.hf_start / GIB:7.2f} | "
            f"{h.scratch / GIB:7.2f} | {h.resume / GIB:6.2f} | {h.save / GIB:5.2f} | "
            f"{h.async_save / GIB:10.2f}"
        )
    fit = node_fit(p.host, p.layout, system, start, async_save)
    return [*lines, host_fit_line(fit, start)]


def host_fit_line(fit: NodeFit, start: Start) -> str:
    """The verdict on the fullest node, naming the start checked (`--start`)."""
    what = (
        f"{fit.phase} needs {fit.per_rank / GIB:.1f} GiB per rank, {ranks(fit.ranks)} per node "
        f"= {fit.need / GIB:.1f} GiB"
    )
    any_start = ": the larger of HF and resume" if start is Start.ANY else ""
    head = f"host memory (--start {start.value}{any_start})"
    if fit.usable is None:
        return f"{head}: {what}; not checked: give {HOST_FLAG}"
    room = f"the node's {fit.usable / GIB:.0f} GiB usable (of {fit.capacity / GIB:.0f} GiB)"
    if fit.fits:
        return f"{head}: {what}, within {room}"
    return f"{head}: {what}, over {room} by {(fit.need - fit.usable) / GIB:.1f} GiB"


def host_dict(p: Prediction, system: System, start: Start, async_save: bool) -> dict:
    """`host_lines`' numbers, JSON-ready (GiB); empty on a CPU, where nothing applies."""
    if not applies(system) or not p.host:
        return {}
    fit = node_fit(p.host, p.layout, system, start, async_save)
    phases = ("baseline", "hf_start", "scratch", "resume", "save", "async_save")
    return {
        "host_memory_gib": [
            {"pp_rank": h.rank, **{k: getattr(h, k) / GIB for k in phases}} for h in p.host
        ],
        "host_fit": {
            "start": start.value,
            "phase": fit.phase,
            "per_rank_gib": fit.per_rank / GIB,
            "ranks_per_node": fit.ranks,
            "node_need_gib": fit.need / GIB,
            "node_capacity_gib": None if fit.capacity is None else fit.capacity / GIB,
            "node_usable_gib": None if fit.usable is None else fit.usable / GIB,
            "fits": fit.fits,
        },
    }
