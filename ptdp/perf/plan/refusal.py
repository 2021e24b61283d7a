"""Why the planner refused a layout, by the constraint that binds, and what it says when it
refuses them all.

Each `Rejected` carries its `Constraint`: the search sets it where it refuses a layout
itself (memory, the global batch against d, the GPU count against t*cp*p, the experts
against ep, a schedule not simulated); a reason from `ptdp.rules.layout.validate` is sorted by
the keys it names (`constraint_of`). When nothing fits, `refusal` groups the rejected
layouts by constraint and gives each group's numbers and what would lift it: the closest
layout's memory against the usable memory, the data-parallel sizes that do not divide
the global batch (with a batch and GPU counts that would), the layer count, the GPU count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from ptdp.perf.cost.hardware import GIB


class Constraint(Enum):
    """What rules a layout out; the order in which `refusal` names them."""

    BATCH = "the global batch"
    LAYERS = "the layer count"
    WORLD = "the GPU count"
    SHAPE = "the model's shape"
    EXPERTS = "the experts"
    SCHEDULE = "the schedule"
    MEMORY = "memory"
    HOST_MEMORY = "host memory"
    OTHER = "the config"


@dataclass(frozen=True)
class Rejected:
    """A layout the search did not keep, and why."""

    layout: str
    reason: str
    kind: Constraint = Constraint.OTHER
    need: float = 0.0
    """Memory: the bytes the model counts on the rank nearest its limit (`reserve.fit`); host
    memory: the fullest node's ranks' (`host_memory.node_fit`)."""
    usable: float = 0.0
    """Memory: the bytes that rank has beside its reserve; host memory: the node's beside
    its reserve."""
    dp: int = 0
    """Global batch: the data-parallel size d that does not divide it."""
    product: int = 0
    """GPU count: the t*cp*p that does not divide it."""


_KEYS = (  # the keys of validate's reasons, first match wins
    (Constraint.BATCH, ("global_batch_size", "microbatches per step", "micro-batch")),
    (Constraint.LAYERS, ("num_layers", "pipeline_layers", "fewer stages")),
    (Constraint.WORLD, ("world size", "GPUs")),
    (Constraint.SHAPE, ("num_heads", "num_query_groups", "MLP width", "seq_length")),
    (Constraint.EXPERTS, ("expert", "parallel.ep")),
)


def constraint_of(reason: str) -> Constraint:
    """The constraint a reason from `ptdp.rules.layout.validate` names (OTHER where none)."""
    for kind, keys in _KEYS:
        if any(key in reason for key in keys):
            return kind
    return Constraint.OTHER


@dataclass(frozen=True)
class Search:
    """What the search could vary, for the counts of GPUs that `refusal` proposes."""

    gpus: int
    batch: int
    layers: int
    gpus_per_node: int
    tp: int | None = None
    cp: int | None = None
    pp: int | None = None

    def divides(self, n: int) -> bool:
        """Whether some t (a divisor of the node's GPUs), cp and p (a divisor of the layers),
        as pinned, leave n GPUs a data-parallel size that divides the global batch."""
        ts = [self.tp] if self.tp else _divisors(self.gpus_per_node)
        ps = [self.pp] if self.pp else _divisors(self.layers)
        k = self.cp or 1
        return any(
            n % (t * k * p) == 0 and self.batch % (n // (t * k * p)) == 0 for t in ts for p in ps
        )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _count(n: int, what: str = "layout") -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def refusal(rejected: Sequence[Rejected], system: str, search: Search) -> list[str]:
    """What `ptdp plan` says when no layout fits: a headline naming the constraints that
    bind, then one line per constraint with its numbers and what would lift it."""
    groups: dict[Constraint, list[Rejected]] = {}
    for r in rejected:
        groups.setdefault(r.kind, []).append(r)
    order = [k for k in Constraint if k in groups]
    where = f"{_count(search.gpus, 'GPU')} of {system}"
    if order in ([Constraint.MEMORY], [Constraint.HOST_MEMORY]):
        head = f"no layout fits in {order[0].value} on {where}:"
    elif not order:
        head = f"nothing to search on {where}:"
    else:
        names = ", ".join(k.value for k in order[:-1])
        bound = f"{names} and {order[-1].value}" if names else order[-1].value
        head = f"no layout can run on {where}, bound by {bound}:"
    return [head] + [
        f"{k.value} ({_count(len(groups[k]))}): {_summary(k, groups[k], search, len(order) == 1)}"
        for k in order
    ]


def _summary(kind: Constraint, group: list[Rejected], search: Search, alone: bool) -> str:
    if kind is Constraint.MEMORY:
        return _memory(group, search)
    if kind is Constraint.HOST_MEMORY:
        return _host_memory(group)
    if kind is Constraint.BATCH and any(r.dp for r in group):
        return _batch(group, search, alone)
    if kind is Constraint.WORLD and any(r.product for r in group):
        products = sorted({r.product for r in group if r.product})
        return f"{search.gpus} GPUs are not a multiple of t*cp*p = {', '.join(map(str, products))}"
    reasons = list(dict.fromkeys(r.reason for r in group))
    more = f" (and {_count(len(reasons) - 1, 'other reason')})" if len(reasons) > 1 else ""
    return f"{reasons[0]}{more}"


def _memory(group: list[Rejected], search: Search) -> str:
    """The closest layout's need against its usable memory, and the GPUs that would split
    its model state enough if it shrank as 1 / GPUs (the model state divides over t*p, and
    with ZeRO over d; the reserve and some activations do not, so it is a floor)."""
    measured = [r for r in group if r.usable > 0]
    if not measured:
        return group[0].reason
    best = min(measured, key=lambda r: r.need / r.usable)
    ratio = best.need / best.usable
    more = search.gpus * 2 ** math.ceil(math.log2(ratio))
    return (
        f"each needs more than a GPU holds; the closest, {best.layout}, "
        f"{best.reason}: over by {(best.need - best.usable) / GIB:.1f} GiB, {ratio:.1f}x. "
        f"The model state per GPU shrinks at best as 1 / GPUs (over t*p, and with ZeRO over "
        f"d): at least {ratio:.1f}x the GPUs (e.g. --gpus {more}), or a device with more memory"
    )


def _host_memory(group: list[Rejected]) -> str:
    """The closest layout's node need against the node's usable host memory, and what lowers
    it (`ptdp.perf.cost.host_memory`: a start reads about the rank's own shard, a resume its
    own state)."""
    best = min(group, key=lambda r: r.need / r.usable if r.usable > 0 else math.inf)
    if best.usable <= 0:
        return best.reason
    over = (best.need - best.usable) / GIB
    return (
        f"each node's ranks need more host memory than it holds; the closest, {best.layout}, "
        f"{best.reason.removeprefix('host memory: ')}: over by {over:.1f} GiB, "
        f"{best.need / best.usable:.1f}x. A rank's start shrinks with its shard (over t, p and "
        "ep; a resume's also with ZeRO over d): more GPUs, a node with more host memory "
        "(--host-memory-gib), or --start for how the run starts"
    )


def _batch(group: list[Rejected], search: Search, alone: bool) -> str:
    """The data-parallel sizes the GPUs leave, a global batch they divide, and the nearest
    GPU counts whose layouts divide this one. `alone`: nothing else was refused."""
    ds = sorted({r.dp for r in group if r.dp})
    low = ds[0]
    only = alone and ds == [search.gpus] and all(r.dp for r in group)
    split = " (their only split: t = cp = p = 1)" if only else ""
    text = (
        f"{search.batch} samples are not divisible by the data-parallel size d = "
        f"{', '.join(map(str, ds))} that {search.gpus} GPUs leave{split}; use a global batch "
        f"that is a multiple of {low}, e.g. {-(-search.batch // low) * low}"
    )
    below = next((n for n in range(search.gpus - 1, 0, -1) if search.divides(n)), None)
    above = next(
        (n for n in range(search.gpus + 1, 4 * search.gpus + 1) if search.divides(n)), None
    )
    counts = [str(n) for n in (below, above) if n]
    return text + (f", or --gpus {' or '.join(counts)}" if counts else "")
