"""Search the parallel layouts of a model on a cluster and rank them by simulated speed.

The search follows the paper's guidelines (Narayanan et al., section 3 and takeaways
1-3) rather than brute force:

1. tensor parallel size t among the divisors of the GPUs per node (its all-reduces then
   stay on NVLink; larger t would cross the network), context parallel size cp among the
   powers of 2 that leave each rank at least `MIN_CP_TOKENS` tokens of a sequence divisible
   by 2 cp (cp = 1 for short sequences), pipeline size p among the divisors of the layer
   count, data parallel d = n / (t cp p) dividing the global batch B; for a mixture of
   experts, each folded expert layout (`ptdp.perf.cost.folding`): etp among the divisors
   of t, ep among the divisors of the expert count with ep etp dividing t cp d ((1, 1) for
   a dense model), each a layout of its own (its memory and speed differ: e / ep experts
   per rank at 1/etp of their width, the all-to-alls' rows and links), and each schedule
   candidate again with `parallel.moe_overlap` where the schedule pairs passes;
2. for each (t, cp, p, ep, etp), the least recomputation whose model state and activations fit in
   memory (1F1B's in-flight bound), at ZeRO level 0, or a higher level (1, 2, 3: the
   layouts of d, up to `Software.max_zero`) where it lets less recomputation fit, the
   level whose best micro-batch equation (1) finds fastest; with cp > 1 the faster
   cp_comm (ring or all-gather) that fits; then the micro-batch b that minimises the
   paper's equation (1), (B/(d b) + p - 1) (t_f(b) + t_b(b)), with t_f, t_b one stage's
   times from the cost model;
3. for that b, the 1F1B schedule, every feasible interleaving v (layers divisible by
   p v, microbatches a multiple of p) and the zero-bubble ZB-H1 and ZB-H2 (where the
   software splits the backward, `Software.split_backward`); layouts that do not fit (the
   verifier's in-flight count, and what a split backward holds for W) are dropped, the rest
   ranked by iteration time, simulated by replaying their action lists: in order of a
   proven lower bound on it (`ptdp.perf.simulate.bound`), as far as what is printed needs;
4. the recommendation is the fastest layout unless others come within `tolerance` of it
   (the model's error on the paper's Table 1, 6%): among those, a layout without ZeRO-3
   first (`recommend`), then the paper's takeaways, the smallest model-parallel size t p
   (#2), then the largest t (#1).

Every candidate goes through `ptdp.rules.layout.validate`, so what the planner returns is a
config the runtime accepts.

Steps 1-3 up to the candidates live in `ptdp.perf.plan.search`, their replay and step 4 in
`ptdp.perf.plan.ranking`, the reasons printed in `ptdp.perf.plan.explain` (where nothing
fits, what binds in `ptdp.perf.plan.refusal`), and the command line's pins in
`ptdp.perf.plan.keys`; `plan` runs them in turn.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import wraps
from typing import TypeVar

from ptdp.config.enums import CpComm, Recompute
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.perf.cost.costs import Compute
from ptdp.perf.cost.hardware import System
from ptdp.perf.cost.host_memory import Start
from ptdp.perf.cost.software import PTDP, Software
from ptdp.perf.cost.switches import run_software
from ptdp.perf.plan.explain import explain, host_memory_line
from ptdp.perf.plan.ranking import Option, Progress, Unranked, rank, recommend
from ptdp.perf.plan.refusal import Constraint, Rejected, Search, refusal
from ptdp.perf.plan.search import Plans, Space, divisors, search
from ptdp.perf.simulate.simulator import require_software, require_vocab
from ptdp.pipeline.schedules import SCHEDULES
from ptdp.rules.domains import check_config

__all__ = [
    "Option",
    "PlanResult",
    "Plans",
    "Progress",
    "Rejected",
    "Unranked",
    "plan",
    "recommend",
]

T = TypeVar("T")


@dataclass(frozen=True)
class PlanResult:
    options: tuple[Option, ...]
    """The fastest layouts that fit, fastest first: exactly the first len(options) of the
    ranking of every layout that fits. At least `plan`'s `top` (or all that fit), and every
    layout within `tolerance` of the fastest, so `recommended` indexes it; all that fit with
    `prune=False`."""
    recommended: int
    """Index of the recommended layout in `options` (see the module docstring, step 4), which
    is also its place in the full ranking."""
    rejected: tuple[Rejected, ...]
    micro_batch_costs: tuple[tuple[int, float], ...]
    """For the best (t, p): equation (1)'s estimate in seconds for each b that fits."""
    explanation: tuple[str, ...]
    """Why the recommended layout; where none fits, what binds (`refusal.refusal`)."""
    unranked: tuple[Unranked, ...] = ()
    """The other layouts that fit, by lower bound on their step time: each slower than every
    option. Those the search replayed anyway (the fastest of their t) carry their option."""

    @property
    def best(self) -> Option | None:
        """The recommended layout."""
        return self.options[self.recommended] if self.options else None

    @property
    def fitting(self) -> int:
        """How many layouts fit: ranked and unranked."""
        return len(self.options) + len(self.unranked)


def collector_paused(fn: Callable[..., T]) -> Callable[..., T]:
    """Run `fn` (a search) with Python's cycle collector paused (then restored as it was).

    A search keeps its plans, millions of small action tuples, alive until it ends; the
    collector traverses them again at every full collection (half of `plan`'s CPU time at
    384 GPUs for GPT-3) and finds nothing: a search makes no reference cycles, so reference
    counting frees everything as before.
    """

    @wraps(fn)
    def paused(*args: object, **kwargs: object) -> T:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return paused


@collector_paused
def plan(
    base: RunConfig,
    *,
    gpus: int,
    system: System,
    software: Software = PTDP,
    tp: int | None = None,
    pp: int | None = None,
    cp: int | None = None,
    cp_comm: CpComm | None = None,
    ep: int | None = None,
    zero: int | None = None,
    vpp: int | None = None,
    micro_batch: int | None = None,
    recompute: Recompute | None = None,
    sequence_parallel: bool | None = None,
    etp: int | None = None,
    moe_overlap: bool | None = None,
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v"),
    max_micro_batch: int = 16,
    tolerance: float = 0.06,
    progress: Progress | None = None,
    top: int = 5,
    prune: bool = True,
    start: Start = Start.ANY,
) -> PlanResult:
    """Rank the layouts of `base.model` for `gpus` devices and `base.train.global_batch_size`.

    Fixed arguments (tp, pp, cp, cp_comm, ep, etp, moe_overlap, zero, vpp, micro_batch,
    recompute, sequence_parallel) restrict the search; precision, optimizer and the other parallel
    options come from `base`, train.cuda_graphs and train.attention_backend too: they are
    priced as set (`ptdp.perf.cost.switches`), not searched. Schedules that split the
    backward are searched only if `software.split_backward`, ZeRO levels up to
    `software.max_zero`.

    Layouts are replayed in order of a proven lower bound on their step time, only as far as
    the `top` fastest, the recommendation and the explanation need (`ptdp.perf.plan.ranking`);
    `prune=False` replays every layout that fits (the same output, slower).

    On a GPU cluster a layout must also fit in the node's host memory as the run starts
    (`start`: from Hugging Face weights, resuming, from scratch, or ANY, the larger of the
    first two) and saves (`base.train.async_save`), `ptdp.perf.cost.host_memory`.
    """
    if not software.split_backward:
        schedules = tuple(s for s in schedules if not SCHEDULES[s].splits_backward)
    require_vocab(base)
    check_config(base)  # NaN and ranges, before the search takes them for layouts' faults
    software = run_software(base, software, system)  # the user's switches, never searched
    pins = replace(base.parallel, sequence_parallel=bool(sequence_parallel), recompute=recompute)
    require_software(replace(base, parallel=pins), software)  # pinned sp / selective: refused
    if not software.sequence_parallel:  # the 2021 code: neither sp nor selective to search
        sequence_parallel = False
    modes = (
        [recompute]
        if recompute
        else [r for r in Recompute if software.sequence_parallel or r is not Recompute.SELECTIVE]
    )
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: the number of GPUs to plan for must be 1 or more")
    pinned_sizes = {"tp": tp, "cp": cp, "pp": pp}
    product = math.prod(n for n in pinned_sizes.values() if n)
    if gpus % product:
        given = {k: n for k, n in pinned_sizes.items() if n}
        flags = " ".join(f"--parallel.{k} {n}" for k, n in given.items())
        symbols = {"tp": "t", "cp": "cp", "pp": "p"}
        what = f"{'*'.join(symbols[k] for k in given)} = {product}" if len(given) > 1 else "it"
        raise ConfigError(
            f"{flags}: {what} does not divide --gpus {gpus}, so no layout has "
            f"{'them' if len(given) > 1 else 'it'}; pin sizes whose product divides the GPU "
            "count, or leave them to the search"
        )
    if base.train.global_batch_size < 1:
        raise ConfigError(
            f"train.global_batch_size = {base.train.global_batch_size} must be 1 or more "
            "(samples per step); e.g. --train.global_batch_size 512"
        )
    c = Compute(system, base.train.precision, software)
    plans = Plans()
    node = system.gpus_per_node
    space = Space(
        tps=(tp,) if tp else tuple(t for t in divisors(node) if gpus % t == 0),
        modes=tuple(modes),
        schedules=schedules,
        max_micro_batch=max_micro_batch,
        cp=cp,
        pp=pp,
        cp_comm=cp_comm,
        ep=ep,
        zero=zero,
        vpp=vpp,
        micro_batch=micro_batch,
        sequence_parallel=sequence_parallel,
        etp=etp,
        moe_overlap=moe_overlap,
    )
    found = search(base, gpus, c, space, plans)
    rejected, eq1 = found.rejected, found.eq1
    ranking = rank(
        found.configs,
        gpus,
        system,
        software,
        rejected,
        progress,
        plans,
        top=top,
        tolerance=tolerance,
        prune=prune,
        start=start,
    )
    options, unranked = ranking.options, tuple(ranking.unranked)
    if not options:  # what binds, by constraint (`ptdp.perf.plan.refusal`)
        limits = Search(gpus, base.train.global_batch_size, base.model.num_layers, node, tp, cp, pp)
        return PlanResult((), 0, tuple(rejected), (), tuple(refusal(rejected, system.name, limits)))
    chosen = recommend(options, tolerance)
    lay = options[chosen].prediction.layout
    etp = options[chosen].config.parallel.etp  # as searched (a dense layout's Layout has t)
    table = tuple(eq1.get((lay.tp, lay.cp, lay.pp, lay.ep, etp, lay.zero), ()))
    lines = explain(options, chosen, table, system, tolerance, unranked)
    refused = sum(r.kind is Constraint.HOST_MEMORY for r in rejected)
    lines += host_memory_line(options[chosen], system, start, refused)
    return PlanResult(tuple(options), chosen, tuple(rejected), table, tuple(lines), unranked)
