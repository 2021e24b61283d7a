"""Search the parallel layouts of a model on a cluster and rank them by simulated speed.

The search follows the paper's guidelines (Narayanan et al., section 3 and takeaways
1-3) rather than brute force:

1. tensor parallel size t among the divisors of the GPUs per node (its all-reduces then
   stay on NVLink; larger t would cross the network), context parallel size cp among the
   powers of 2 that leave each rank at least `MIN_CP_TOKENS` tokens of a sequence divisible
   by 2 cp (cp = 1 for short sequences), pipeline size p among the divisors of the layer
   count, data parallel d = n / (t cp p) dividing the global batch B;
2. for each (t, cp, p), the least recomputation whose model state and activations fit in
   memory (1F1B's in-flight bound), at ZeRO level 0, or a higher level (1, 2, 3: the
   layouts of d, up to `Software.max_zero`) where it lets less recomputation fit, the
   level whose best micro-batch equation (1) finds fastest; with cp > 1 the faster
   cp_comm (ring or all-gather) that fits; then the micro-batch b that minimises the
   paper's equation (1), (B/(d b) + p - 1) (t_f(b) + t_b(b)), with t_f, t_b one stage's
   times from the cost model;
3. for that b, the 1F1B schedule, every feasible interleaving v (layers divisible by
   p v, microbatches a multiple of p) and the zero-bubble ZB-H1 and ZB-H2 (where the
   software splits the backward, `Software.split_backward`), each simulated by replaying
   its action lists; layouts that do not fit (the verifier's in-flight count, and what a
   split backward holds for W) are dropped, the rest ranked by iteration time;
4. the recommendation is the fastest layout unless others come within `tolerance` of it
   (the model's error on the paper's Table 1, 6%): among those, a layout without ZeRO-3
   first (`recommend`), then the paper's takeaways, the smallest model-parallel size t p
   (#2), then the largest t (#1).

Every candidate goes through `ptdp.layout.validate`, so what the planner returns is a
config the runtime accepts.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import wraps
from typing import TypeVar

from ptdp.config import CpComm, Recompute, RunConfig, Schedule, parse_overrides
from ptdp.errors import ConfigError
from ptdp.layout import ZERO_LEVELS, Layout, validate
from ptdp.perf.context_costs import MIN_CP_TOKENS, best_comm
from ptdp.perf.costs import PTDP, Compute, Software
from ptdp.perf.hardware import GIB, System
from ptdp.perf.memory import estimate_memory
from ptdp.perf.reserve import fit, with_reserve
from ptdp.perf.simulator import (
    Prediction,
    require_software,
    require_vocab,
    simulate,
    stage_costs,
)
from ptdp.pipeline.plan import PipelinePlan, build_plan
from ptdp.pipeline.schedules import SCHEDULES

T = TypeVar("T")
Progress = Callable[[int, int, str], None]
"""progress(done, total, what): called before each simulation."""


@dataclass(frozen=True)
class Option:
    """One simulated layout."""

    config: RunConfig
    prediction: Prediction

    def describe(self) -> str:
        p, lay = self.config.parallel, self.prediction.layout
        sp = " sp" if p.sequence_parallel else ""
        b = self.config.train.micro_batch_size
        cp = f" cp={lay.cp} {p.cp_comm.value}" if lay.cp > 1 else ""
        zero = f" zero={lay.zero}" if lay.zero else ""
        return (
            f"t={lay.tp}{sp}{cp} p={lay.pp} d={lay.dp}{zero} v={lay.vpp} b={b} "
            f"m={lay.num_microbatches} {p.schedule.value} recompute={p.recompute.value}"
        )


@dataclass(frozen=True)
class Rejected:
    layout: str
    reason: str


@dataclass(frozen=True)
class PlanResult:
    options: tuple[Option, ...]
    """Layouts that fit, fastest first."""
    recommended: int
    """Index of the recommended layout in `options` (see the module docstring, step 4)."""
    rejected: tuple[Rejected, ...]
    micro_batch_costs: tuple[tuple[int, float], ...]
    """For the best (t, p): equation (1)'s estimate in seconds for each b that fits."""
    explanation: tuple[str, ...]

    @property
    def best(self) -> Option | None:
        """The recommended layout."""
        return self.options[self.recommended] if self.options else None


class Plans:
    """The pipeline plans of one search: each (schedule, pp, m, vpp) built once, for the
    memory model of every micro-batch and recomputation tried and the replays (DESIGN
    invariant 1 holds: a layout's plan is still `build_plan`'s)."""

    def __init__(self) -> None:
        self._built: dict[tuple[str, int, int, int], PipelinePlan] = {}

    def __call__(self, schedule: str, pp: int, m: int, vpp: int) -> PipelinePlan:
        key = (schedule, pp, m, vpp)
        if key not in self._built:
            self._built[key] = build_plan(schedule, pp, m, vpp)
        return self._built[key]

    def layout(self, cfg: RunConfig, gpus: int) -> Layout:
        """`validate(cfg, gpus)` with its `pipeline` taken from here."""
        lay = validate(cfg, gpus, gpus=True)
        # Layout.pipeline is a cached_property: its cache is the instance's __dict__.
        lay.__dict__["pipeline"] = self(lay.schedule, lay.pp, lay.num_microbatches, lay.vpp)
        return lay


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layout_config(
    base: RunConfig,
    *,
    tp: int,
    pp: int,
    vpp: int,
    micro_batch: int,
    recompute: Recompute,
    sequence_parallel: bool,
    schedule: Schedule | None = None,
    cp: int = 1,
    zero: int | None = None,
    cp_comm: CpComm | None = None,
) -> RunConfig:
    """`base` with a layout filled in (dp derived from the world size). A given split of
    layers (parallel.pipeline_layers) is kept where it has pp*vpp stages; every other layout
    gets the even split. cp, zero and cp_comm default to `base`'s."""
    if schedule is None:
        schedule = Schedule.INTERLEAVED if vpp > 1 else Schedule.ONE_F_ONE_B
    split = base.parallel.pipeline_layers
    level = base.parallel.zero if zero is None else zero
    parallel = replace(
        base.parallel,
        tp=tp,
        pp=pp,
        dp=0,
        vpp=vpp,
        schedule=schedule,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
        pipeline_layers=split if len(split) == pp * vpp else (),
        cp=cp,
        zero=level,
        cp_comm=cp_comm or base.parallel.cp_comm,
        # keeping gathered parameters is ZeRO-3's option; other levels are refused with it
        zero3_reshard_after_forward=base.parallel.zero3_reshard_after_forward or level != 3,
    )
    return replace(base, parallel=parallel, train=replace(base.train, micro_batch_size=micro_batch))


def equation_1(cfg: RunConfig, gpus: int, c: Compute) -> float:
    """The paper's equation (1): (b'/b + p - 1) (t_f(b) + t_b(b)), b' = B / d, in seconds.

    t_f and t_b are the slowest stage's forward and backward (B + W) of one microbatch;
    communication between stages and the data-parallel reduction are left out, as in
    the paper.
    """
    layout = validate(cfg, gpus, gpus=True)
    slowest = max(p.f + p.b + p.w for p in stage_costs(cfg, layout, c))
    return (layout.num_microbatches + layout.pp - 1) * slowest


SEARCHED: dict[str, str] = {
    "parallel.tp": "tp",
    "parallel.pp": "pp",
    "parallel.cp": "cp",
    "parallel.cp_comm": "cp_comm",
    "parallel.zero": "zero",
    "parallel.vpp": "vpp",
    "parallel.schedule": "schedules",
    "parallel.recompute": "recompute",
    "parallel.sequence_parallel": "sequence_parallel",
    "train.micro_batch_size": "micro_batch",
}
"""Config keys the planner searches, and the `plan` argument that fixes each."""


def plan_request(
    base: RunConfig, overrides: list[str], top: int = 1
) -> tuple[RunConfig, dict[str, object]]:
    """`ptdp plan`'s base config (resolved from `--model`, `--config` and `overrides`, its
    `--section.key` options) and the keys it pins; `top`, the layouts to list, checked before
    the search."""
    if top < 1:
        raise ConfigError(f"--top {top}: the number of layouts to list must be 1 or more")
    given = parse_overrides(overrides)
    if "global_batch_size" not in given.get("train", {}):
        raise ConfigError("the planner needs --train.global_batch_size B (or --global-batch B)")
    return base, pinned(base, given)


def pinned(cfg: RunConfig, given: dict[str, dict[str, str]]) -> dict[str, object]:
    """`plan` keyword arguments fixing the searched keys that `given` names (the command line's
    `--section.key` overrides, parsed), at their values in `cfg`; 0 leaves a size to the search.

    Keys of `cfg` not given (defaults, or a TOML file's layout) are searched over.
    """
    if "dp" in given.get("parallel", {}) and cfg.parallel.dp:
        raise ConfigError(
            f"parallel.dp = {cfg.parallel.dp}: the planner derives d = gpus / (t p); "
            "fix --parallel.tp and --parallel.pp instead"
        )
    values: dict[str, object] = {}
    for key, arg in SEARCHED.items():
        section, name = key.split(".")
        if name not in given.get(section, {}):
            continue
        value = getattr(getattr(cfg, section), name)
        if isinstance(value, Schedule):
            value = (value.value,)
        elif type(value) is int and (value < 0 or value == 0 and name != "zero"):
            value = None  # 0 sizes and zero = -1 (follow optim.distributed) are searched
        values[arg] = value
    return values


def collector_paused(search: Callable[..., T]) -> Callable[..., T]:
    """Run `search` with Python's cycle collector paused (then restored as it was).

    A search keeps its plans, millions of small action tuples, alive until it ends; the
    collector traverses them again at every full collection (half of `plan`'s CPU time at
    384 GPUs for GPT-3) and finds nothing: a search makes no reference cycles, so reference
    counting frees everything as before.
    """

    @wraps(search)
    def paused(*args: object, **kwargs: object) -> T:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return search(*args, **kwargs)
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
    zero: int | None = None,
    vpp: int | None = None,
    micro_batch: int | None = None,
    recompute: Recompute | None = None,
    sequence_parallel: bool | None = None,
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v"),
    max_micro_batch: int = 16,
    tolerance: float = 0.06,
    progress: Progress | None = None,
) -> PlanResult:
    """Rank the layouts of `base.model` for `gpus` devices and `base.train.global_batch_size`.

    Fixed arguments (tp, pp, cp, cp_comm, zero, vpp, micro_batch, recompute,
    sequence_parallel) restrict the search; precision, optimizer and the other parallel
    options come from `base`. Schedules that split the backward are searched only if
    `software.split_backward`, ZeRO levels up to `software.max_zero`.
    """
    if not software.split_backward:
        schedules = tuple(s for s in schedules if not SCHEDULES[s].splits_backward)
    require_vocab(base)
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
    if base.train.global_batch_size < 1:
        raise ConfigError(
            f"train.global_batch_size = {base.train.global_batch_size} must be 1 or more "
            "(samples per step); e.g. --train.global_batch_size 512"
        )
    c = Compute(system, base.train.precision, software)
    plans = Plans()
    rejected: list[Rejected] = []
    candidates: list[RunConfig] = []
    eq1: dict[tuple[int, int, int, int], list[tuple[int, float]]] = {}
    model, batch = base.model, base.train.global_batch_size
    node = system.gpus_per_node
    tps = [tp] if tp else [t for t in divisors(node) if gpus % t == 0]
    for t, k, p in _sizes(model.num_layers, model.seq_length, gpus, tps, cp, pp):
        where = f"t={t} cp={k} p={p}" if k > 1 else f"t={t} p={p}"
        if gpus % (t * k * p):
            rejected.append(Rejected(where, f"t*cp*p = {t * k * p} does not divide {gpus} GPUs"))
            continue
        d = gpus // (t * k * p)
        if batch % d:
            rejected.append(Rejected(where, f"batch {batch} not divisible by d = {d}"))
            continue
        sp = (t > 1) if sequence_parallel is None else sequence_parallel
        lowest = 1 if base.optim.distributed else 0  # its old spelling of zero = 1
        top = software.max_zero if d * k > 1 else 0
        levels = [zero] if zero is not None else list(range(lowest, max(lowest, top) + 1))
        least, best = len(Recompute), None
        for level in levels:
            fitting, why = _fitting_micro_batches(
                base,
                gpus,
                (t, k, p, level),
                sp,
                modes,
                micro_batch,
                max_micro_batch,
                c,
                plans,
                cp_comm,
            )
            mode = list(Recompute).index(fitting[0].parallel.recompute) if fitting else least
            if mode >= least:  # a higher level only where it lets less recomputation fit
                continue
            least = mode
            costs = [(cfg.train.micro_batch_size, equation_1(cfg, gpus, c)) for cfg in fitting]
            i = min(range(len(costs)), key=lambda i: costs[i][1])
            if best is None or costs[i][1] < best[0]:  # the level equation (1) finds faster
                best = (costs[i][1], level, fitting[i], costs)
        if best is not None:
            eq1[(t, k, p, best[1])] = best[3]
            candidates += _schedules(best[2], gpus, vpp, schedules, rejected)
        else:
            rejected.append(Rejected(where, why))
    options = _simulate_all(candidates, gpus, system, software, rejected, progress, plans)
    options.sort(key=lambda o: o.prediction.iteration_seconds)
    if not options:
        return PlanResult((), 0, tuple(rejected), (), ("no layout fits",))
    chosen = recommend(options, tolerance)
    lay = options[chosen].prediction.layout
    table = tuple(eq1.get((lay.tp, lay.cp, lay.pp, lay.zero), ()))
    lines = explain(options, chosen, table, system, tolerance)
    return PlanResult(tuple(options), chosen, tuple(rejected), table, tuple(lines))


def recommend(options: list[Option], tolerance: float) -> int:
    """Index of the layout to recommend among `options` (sorted fastest first).

    Layouts within `tolerance` of the fastest are equal as far as the model can tell;
    among them ZeRO-3 only if nothing else is close (its step rests on per-microbatch
    gathers reaching the ring model's bandwidth, which the paper's ZeRO-3 fell far short
    of: Table 2, `costs.DEEPSPEED_2021`), then the paper's takeaways: the smallest t * p
    (#2), then the largest t (#1), then the fastest.
    """
    fastest = options[0].prediction.iteration_seconds
    close = [
        i
        for i, o in enumerate(options)
        if o.prediction.iteration_seconds <= fastest * (1 + tolerance)
    ]

    def key(i: int) -> tuple[bool, int, int, float]:
        lay = options[i].prediction.layout
        return (lay.zero == 3, lay.tp * lay.pp, -lay.tp, options[i].prediction.iteration_seconds)

    return min(close, key=key)


def context_sizes(seq_length: int, most: int) -> list[int]:
    """cp sizes to search: 1, and the powers of 2 up to `most` that split a sequence into 2 cp
    equal chunks leaving each rank at least `MIN_CP_TOKENS` tokens."""
    sizes, k = [1], 2
    while k <= most and seq_length % (2 * k) == 0 and seq_length // k >= MIN_CP_TOKENS:
        sizes.append(k)
        k *= 2
    return sizes


def _sizes(
    layers: int, seq_length: int, gpus: int, tps: list[int], cp: int | None, pp: int | None
) -> list[tuple[int, int, int]]:
    """(t, cp, p) to search: cp (`context_sizes`) and p among the divisors of the layers."""
    out = []
    for t in tps:
        for k in [cp] if cp else context_sizes(seq_length, gpus // t):
            pps = [pp] if pp else [p for p in divisors(layers) if gpus % (t * k * p) == 0]
            out += [(t, k, p) for p in pps]
    return out


def _fitting_micro_batches(
    base: RunConfig,
    gpus: int,
    sizes: tuple[int, int, int, int],
    sp: bool,
    modes: list[Recompute],
    micro_batch: int | None,
    max_micro_batch: int,
    c: Compute,
    plans: Plans,
    cp_comm: CpComm | None = None,
) -> tuple[list[RunConfig], str]:
    """1F1B configs of each micro-batch that fits, at the least recomputation that fits any,
    for (t, cp, p, zero) = `sizes`; under cp > 1 each at the faster cp_comm that fits."""
    t, k, p, zero = sizes
    d = gpus // (t * k * p)
    per_rank = base.train.global_batch_size // d
    batches = (
        [micro_batch] if micro_batch else [b for b in divisors(per_rank) if b <= max_micro_batch]
    )
    why = "no micro-batch size divides the batch"
    for mode in modes:
        fitting = []
        for b in batches:
            cfg = layout_config(
                base,
                tp=t,
                pp=p,
                vpp=1,
                micro_batch=b,
                recompute=mode,
                sequence_parallel=sp,
                cp=k,
                zero=zero,
            )
            comms = [cp_comm] if cp_comm or k == 1 else _comm_order(cfg, c)
            variants = [replace_comm(cfg, comm) for comm in comms]
            try:
                needs = [_need(x, gpus, c, plans) for x in variants]
            except ConfigError as exc:
                why = str(exc).replace("invalid configuration:\n  - ", "").split("\n")[0]
                continue
            fits = [x for x, (need, room) in zip(variants, needs) if need <= room]
            need, room = min(needs, key=lambda n: n[0] - n[1])
            if fits:
                fitting.append(fits[0])
            elif b == batches[0]:
                why = (
                    f"needs {need / GIB:.1f} GiB per GPU with recompute={mode.value} at b={b}, "
                    f"{room / GIB:.1f} GiB usable"
                )
        if fitting:
            return fitting, ""
    return [], why


def replace_comm(cfg: RunConfig, comm: CpComm | None) -> RunConfig:
    """`cfg` with parallel.cp_comm = `comm` (None: as it is)."""
    return cfg if comm is None else replace(cfg, parallel=replace(cfg.parallel, cp_comm=comm))


def _need(cfg: RunConfig, gpus: int, c: Compute, plans: Plans) -> tuple[float, float]:
    """(need, usable) per GPU of `cfg` at its rank nearest the limit (`reserve.fit`; raises
    ConfigError for an invalid layout)."""
    layout = plans.layout(cfg, gpus)
    memory = estimate_memory(cfg, gpus, fused_attention=c.software.fused_attention, layout=layout)
    return fit(with_reserve(memory, cfg, layout, c.system), c.system.device)


def _comm_order(cfg: RunConfig, c: Compute) -> list[CpComm]:
    """Both cp_comm variants, the faster layer first (`context_costs.best_comm`)."""
    par = cfg.parallel
    first = best_comm(
        cfg.model,
        micro_batch=cfg.train.micro_batch_size,
        tp=par.tp,
        sequence_parallel=par.sequence_parallel,
        recompute=par.recompute,
        c=c,
        cp=par.cp,
    )
    return [first] + [x for x in CpComm if x is not first]


def _schedules(
    cfg: RunConfig,
    gpus: int,
    vpp: int | None,
    schedules: tuple[str, ...],
    rejected: list[Rejected],
) -> list[RunConfig]:
    """`cfg` under each of `schedules` that fits: each at every feasible v it takes
    (`ScheduleSpec.takes_chunks`: interleaved any v > 1, ZB-V v = 2, the others v = 1); with
    p = 1 only 1F1B (no pipeline, no bubble)."""
    p, layers = cfg.parallel.pp, cfg.model.num_layers
    out = []
    chunks = [vpp] if vpp else [v for v in divisors(layers // p)]
    for v in chunks:
        names = [s for s in schedules if SCHEDULES[s].takes_chunks(v)]
        for name in names:
            if p == 1 and name != "1f1b":
                continue
            # As in `layout_config`: a given split only where it has p*v stages.
            split = cfg.parallel.pipeline_layers
            split = split if len(split) == p * v else ()
            par = replace(cfg.parallel, vpp=v, schedule=Schedule(name), pipeline_layers=split)
            candidate = replace(cfg, parallel=par)
            where = f"t={cfg.parallel.tp} p={p} v={v} {name}"
            try:
                m = validate(candidate, gpus, gpus=True).num_microbatches
            except ConfigError as exc:
                reason = str(exc).replace("invalid configuration:\n  - ", "").split("\n")[0]
                rejected.append(Rejected(where, reason))
                continue
            if name == "zb-v" and m > ZB_V_MAX * p:
                rejected.append(Rejected(where, _zb_v_skipped(p, m)))
                continue
            out.append(candidate)
    return out


ZB_V_MAX = 16
"""ZB-V is simulated up to this many microbatches per pipeline rank: its list schedule has no
steady state to replay in short (`ptdp.perf.replay.replay_steady`), and a full replay costs
m p; past it ZB-H1, replayed in short, is within 1% of it (its bubble is at most twice)."""


def _zb_v_skipped(p: int, m: int) -> str:
    bubble = (p - 1) / (6 * m)
    return (
        f"not simulated: m = {m} > {ZB_V_MAX} p microbatches, where zb-v's bubble (p-1)/(6m) = "
        f"{100 * bubble:.2f}% is within {100 * bubble:.2f}% of zb-h1's (p-1)/(3m)"
    )


def _simulate_all(
    candidates: list[RunConfig],
    gpus: int,
    system: System,
    software: Software,
    rejected: list[Rejected],
    progress: Progress | None,
    plans: Plans,
) -> list[Option]:
    options = []
    for i, cfg in enumerate(candidates):
        layout = plans.layout(cfg, gpus)
        what = f"t={layout.tp} p={layout.pp} v={layout.vpp} b={cfg.train.micro_batch_size}"
        if progress is not None:
            progress(i, len(candidates), what)
        prediction = simulate(
            cfg, system, gpus, software=software, layout=layout, timeline=False, plans=plans
        )
        need, room = fit(prediction.memory, system.device)
        if need > room:
            rejected.append(Rejected(what, f"needs {need / GIB:.1f} GiB, {room / GIB:.1f} usable"))
            continue
        options.append(Option(cfg, prediction))
    if progress is not None:
        progress(len(candidates), len(candidates), "done")
    return options


def explain(
    options: list[Option],
    chosen: int,
    eq1: tuple[tuple[int, float], ...],
    system: System,
    tolerance: float,
) -> list[str]:
    """Why this layout: each choice against the paper's guidelines and the runners-up."""
    best = options[chosen]
    lay, cfg, pred = best.prediction.layout, best.config, best.prediction
    node = system.gpus_per_node
    need, usable = (x / GIB for x in fit(pred.memory, system.device))
    lines = []
    by_t: dict[int, Option] = {}
    for o in options:
        by_t.setdefault(o.prediction.layout.tp, o)
    others = ", ".join(
        f"t={t}: {o.prediction.model_tflops_per_device:.0f}"
        for t, o in sorted(by_t.items())
        if t != lay.tp
    )
    inside = "equal to the GPUs per node" if lay.tp == node else f"inside one {node}-GPU node"
    what = (
        f"tensor parallel t={lay.tp}, {inside}: its all-reduces (2 forward, 2 backward per "
        f"layer) stay on {system.intra.name}"
        if lay.tp > 1
        else "no tensor parallelism (t=1): no all-reduces inside the layers"
    )
    lines.append(what + (f"; best model TFLOP/s per GPU with other t: {others}" if others else ""))
    span = lay.tp * lay.dp
    crosses = lay.pp > 1 and span >= node
    smallest = min(o.prediction.layout.tp * o.prediction.layout.pp for o in options)
    lines.append(
        f"pipeline p={lay.pp}"
        + (
            f" across nodes (neighbouring stages {span} GPUs apart, over {system.inter.name})"
            if crosses
            else ""
        )
        + f": model-parallel size t*p = {lay.tp * lay.pp} (smallest that fits: {smallest}); "
        f"peak memory {need:.1f} GiB of {usable:.1f} GiB usable after the reserve"
    )
    if eq1:
        table = ", ".join(f"b={b}: {s:.3g} s" for b, s in eq1)
        lines.append(
            f"micro-batch b={cfg.train.micro_batch_size} minimises equation (1) "
            f"(B/(d b) + p - 1)(t_f + t_b) among those that fit: {table}"
        )
    spec = SCHEDULES[cfg.parallel.schedule.value]
    formula = spec.bubble(lay.pp, lay.num_microbatches, lay.vpp)
    lines.append(
        f"schedule {cfg.parallel.schedule.value} v={lay.vpp}: m={lay.num_microbatches} "
        f"microbatches, simulated bubble {pred.bubble_fraction:.3f} (formula {spec.formula} = "
        f"{formula:.3f}); recompute={cfg.parallel.recompute.value} (the least that fits)"
    )
    lines.append(
        f"data parallel d={lay.dp}: {pred.dp_seconds:.3g} s of gradient reduction per step; "
        f"predicted {pred.iteration_seconds:.3g} s per step, {pred.model_tflops_per_device:.1f} "
        f"model TFLOP/s per GPU (MFU {100 * pred.mfu:.1f}%; executed with recomputation "
        f"{pred.tflops_per_device:.1f})"
    )
    if lay.cp > 1:
        where = "inside a node" if lay.tp * lay.cp <= node else "across nodes (ring on the network)"
        lines.append(
            f"context parallel cp={lay.cp} ({cfg.parallel.cp_comm.value}, the faster that fits), "
            f"{where}: each rank holds {cfg.model.seq_length // lay.cp} tokens of a sequence "
            f"and 1/{lay.cp} of its activations"
        )
    if lay.zero:
        lines.append(
            f"ZeRO-{lay.zero} over d*cp = {lay.dp * lay.cp} ranks ({ZERO_LEVELS[lay.zero]}): "
            "a higher level only where it lets less recomputation fit"
        )
    if chosen:
        fastest = options[0]
        gain = pred.iteration_seconds / fastest.prediction.iteration_seconds - 1
        lines.append(
            f"{fastest.describe()} is predicted {100 * gain:.1f}% faster, within the model's "
            f"{100 * tolerance:.0f}% error on the paper's Table 1: the paper's takeaways "
            "(smallest t*p that fits, then tensor parallelism up to the node) decide"
        )
    return lines


PLAN_EPILOG = (
    " A searched key ({searched}) given on the command line fixes it: --parallel.tp 8 "
    "searches only t = 8 (0 = search); keys not given, and a TOML file's layout, are "
    "searched over. The old spellings stand for config keys: --tp 8 is --parallel.tp 8."
).format(searched=", ".join(SEARCHED))
"""`ptdp plan --help`: how searched keys and pins combine."""

OLD_PLAN_FLAGS = {
    "--global-batch": "train.global_batch_size",
    "--vocab-size": "model.vocab_size",
    "--precision": "train.precision",
    "--tp": "parallel.tp",
    "--pp": "parallel.pp",
    "--vpp": "parallel.vpp",
    "--micro-batch": "train.micro_batch_size",
    "--recompute": "parallel.recompute",
    "--sequence-parallel": "parallel.sequence_parallel",
}
"""`ptdp plan`'s first options, kept as other spellings of config keys (README, BENCHMARKS)."""
