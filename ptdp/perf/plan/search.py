"""The planner's search space: the sizes, ZeRO levels, micro-batches and schedules it tries.

Steps 1-3 of `ptdp.perf.plan.planner`'s search, up to the candidates it replays: (t, cp, p) from
the GPUs per node, the sequence and the layers (`sizes`), and for a mixture of experts each
folded expert layout (ep, etp) over a stage's t d cp ranks (`expert_layouts`), each also
with the all-to-alls overlapped where the schedule pairs passes (`overlap_variants`); for
each, the least recomputation that fits at the ZeRO level whose best micro-batch equation (1)
finds fastest (`fitting_micro_batches`, `equation_1`); for that micro-batch, every schedule and
interleaving v that validates (`schedule_candidates`), each also with lighter first and last
stages where they help (`ptdp.perf.plan.ends`). What does not qualify is kept as a
`Rejected` with the reason and the constraint that binds (`ptdp.perf.plan.refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ptdp.config.enums import CpComm, Recompute, Schedule
from ptdp.config.sections import ParallelConfig, RunConfig
from ptdp.errors import ConfigError
from ptdp.perf.cost.context_costs import MIN_CP_TOKENS, best_comm
from ptdp.perf.cost.costs import Compute
from ptdp.perf.cost.hardware import GIB
from ptdp.perf.cost.reserve import fit
from ptdp.perf.plan.ends import lighter_ends
from ptdp.perf.plan.refusal import Constraint, Rejected, constraint_of
from ptdp.perf.simulate.pipeline_costs import stage_costs
from ptdp.perf.simulate.simulator import predicted_memory
from ptdp.pipeline.plan import PipelinePlan, build_plan
from ptdp.pipeline.schedules import SCHEDULES
from ptdp.rules.layout import Layout, validate


class Plans:
    """The pipeline plans of one search: each (schedule, pp, m, vpp) built once, for the
    memory model of every micro-batch and recomputation tried and the replays (DESIGN
    invariant 1 holds: a layout's plan is still `build_plan`'s)."""

    def __init__(self) -> None:
        self._built: dict[tuple[str, int, int, int, bool], PipelinePlan] = {}

    def __call__(
        self, schedule: str, pp: int, m: int, vpp: int, *, paired: bool = False
    ) -> PipelinePlan:
        key = (schedule, pp, m, vpp, paired)
        if key not in self._built:
            self._built[key] = build_plan(schedule, pp, m, vpp, paired=paired)
        return self._built[key]

    def layout(self, cfg: RunConfig, gpus: int) -> Layout:
        """`validate(cfg, gpus)` with its `pipeline` taken from here."""
        lay = validate(cfg, gpus, gpus=True)
        # Layout.pipeline is a cached_property: its cache is the instance's __dict__.
        plan = self(lay.schedule, lay.pp, lay.num_microbatches, lay.vpp, paired=lay.moe_overlap)
        lay.__dict__["pipeline"] = plan
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
    ep: int = 1,
    etp: int = 1,
) -> RunConfig:
    """`base` with a layout filled in (dp derived from the world size). A given split of
    layers (parallel.pipeline_layers) is kept where it has pp*vpp stages; every other layout
    gets the even split. zero and cp_comm default to `base`'s, cp, ep and etp to 1."""
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
        ep=ep,
        etp=etp if base.model.num_experts else 1,
        zero=level,
        cp_comm=cp_comm or base.parallel.cp_comm,
        # keeping gathered parameters is ZeRO-3's option; other levels are refused with it
        zero3_reshard_after_forward=base.parallel.zero3_reshard_after_forward or level != 3,
        # so is gathering float8 weights
        zero3_fp8_all_gather=base.parallel.zero3_fp8_all_gather and level == 3,
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


@dataclass(frozen=True)
class Space:
    """What one search varies: each size or choice given is fixed, each None searched."""

    tps: tuple[int, ...]
    """Tensor parallel sizes to try."""
    modes: tuple[Recompute, ...]
    """Recomputation modes, least first."""
    schedules: tuple[str, ...]
    """Schedules to try (those the software has)."""
    max_micro_batch: int
    cp: int | None = None
    pp: int | None = None
    cp_comm: CpComm | None = None
    ep: int | None = None
    zero: int | None = None
    vpp: int | None = None
    micro_batch: int | None = None
    sequence_parallel: bool | None = None
    etp: int | None = None
    moe_overlap: bool | None = None
    """None: each layout with and without (where the runtime has `parallel.moe_overlap`)."""


@dataclass(frozen=True)
class Candidates:
    """What `search` found: the layouts to replay, the rejected ones, and equation (1)."""

    configs: list[RunConfig]
    rejected: list[Rejected]
    eq1: dict[tuple[int, ...], list[tuple[int, float]]]
    """For each (t, cp, p, ep, etp, zero) chosen: equation (1)'s seconds for each b that
    fits."""


def search(base: RunConfig, gpus: int, c: Compute, space: Space, plans: Plans) -> Candidates:
    """The layouts of `base.model` on `gpus` devices worth replaying (module doc)."""
    rejected: list[Rejected] = []
    candidates: list[RunConfig] = []
    eq1: dict[tuple[int, ...], list[tuple[int, float]]] = {}
    model, batch, software = base.model, base.train.global_batch_size, c.software
    sequence_parallel, zero = space.sequence_parallel, space.zero
    for t, k, p in sizes(model.num_layers, model.seq_length, gpus, space):
        where = f"t={t} cp={k} p={p}" if k > 1 else f"t={t} p={p}"
        if gpus % (t * k * p):
            reason = f"t*cp*p = {t * k * p} does not divide {gpus} GPUs"
            rejected.append(Rejected(where, reason, Constraint.WORLD, product=t * k * p))
            continue
        d = gpus // (t * k * p)
        if batch % d:
            reason = f"batch {batch} not divisible by d = {d}"
            rejected.append(Rejected(where, reason, Constraint.BATCH, dp=d))
            continue
        eps = expert_layouts(model.num_experts, t, d * k, space.ep, space.etp)
        if not eps:
            reason = (
                f"ep = {space.ep}, etp = {space.etp}: ep divides no {model.num_experts} experts "
                "with ep*etp dividing t*d*cp"
            )
            rejected.append(Rejected(where, f"{reason} = {t * d * k}", Constraint.EXPERTS))
        sp = (t > 1) if sequence_parallel is None else sequence_parallel
        lowest = 1 if base.optim.distributed else 0  # its old spelling of zero = 1
        top = software.max_zero if d * k > 1 else 0
        levels = [zero] if zero is not None else list(range(lowest, max(lowest, top) + 1))
        for ep, etp in eps:
            at = f"{where} ep={ep}" if ep > 1 else where
            at += f" etp={etp}" if etp > 1 else ""
            dims = (t, k, p, ep, etp)
            least, best = len(Recompute), None
            for level in levels:
                fitting, why = fitting_micro_batches(
                    base, gpus, (*dims, level), sp, space, c, plans
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
                eq1[(*dims, best[1])] = best[3]
                found = schedule_candidates(best[2], gpus, space, rejected)
                found += overlap_variants(found, gpus, space)
                candidates += found + lighter_ends(found, gpus, c)  # first and last stages lighter
            else:
                rejected.append(replace(why, layout=at))
    return Candidates(candidates, rejected, eq1)


def expert_layouts(
    experts: int, tp: int, dp_cp: int, ep: int | None = None, etp: int | None = None
) -> list[tuple[int, int]]:
    """(ep, etp) to search (`ptdp.perf.cost.folding`): etp among the divisors of t (or
    `etp` pinned), ep among the divisors of the routed experts with ep etp dividing the
    stage's t d cp ranks (`ptdp.rules.moe.expert_rules`; or `ep` pinned); [(1, 1)] for a
    dense model. Every one is a layout of its own: its memory, its all-to-alls' links."""
    if not experts:
        return [(1, 1)]
    etps = [etp] if etp else divisors(tp)
    eps = [ep] if ep else divisors(experts)
    ranks = tp * dp_cp
    return [(e, x) for x in etps for e in eps if experts % e == 0 and ranks % (e * x) == 0]


def overlap_variants(found: list[RunConfig], gpus: int, space: Space) -> list[RunConfig]:
    """The candidates with expert parallelism again with `parallel.moe_overlap` (the
    all-to-alls behind the paired microbatch's compute), where the runtime has the key, the
    search does not pin it off, and the schedule pairs passes (`validate` says which)."""
    if space.moe_overlap is False or "moe_overlap" not in _PARALLEL_KEYS:
        return []
    out = []
    for cfg in found:
        if cfg.parallel.ep <= 1 or getattr(cfg.parallel, "moe_overlap", False):
            continue
        paired = replace(cfg, parallel=replace(cfg.parallel, moe_overlap=True))
        try:
            validate(paired, gpus, gpus=True)
        except ConfigError:
            continue
        out.append(paired)
    return out


_PARALLEL_KEYS = {f.name for f in fields(ParallelConfig)}


def context_sizes(seq_length: int, most: int) -> list[int]:
    """cp sizes to search: 1, and the powers of 2 up to `most` that split a sequence into 2 cp
    equal chunks leaving each rank at least `MIN_CP_TOKENS` tokens."""
    found, k = [1], 2
    while k <= most and seq_length % (2 * k) == 0 and seq_length // k >= MIN_CP_TOKENS:
        found.append(k)
        k *= 2
    return found


def sizes(layers: int, seq_length: int, gpus: int, space: Space) -> list[tuple[int, int, int]]:
    """(t, cp, p) to search: cp (`context_sizes`) and p among the divisors of the layers."""
    out = []
    for t in space.tps:
        for k in [space.cp] if space.cp else context_sizes(seq_length, gpus // t):
            if space.pp:
                pps = [space.pp]
            else:
                pps = [p for p in divisors(layers) if gpus % (t * k * p) == 0]
            out += [(t, k, p) for p in pps]
    return out


def fitting_micro_batches(
    base: RunConfig,
    gpus: int,
    dims: tuple[int, ...],
    sp: bool,
    space: Space,
    c: Compute,
    plans: Plans,
) -> tuple[list[RunConfig], Rejected]:
    """1F1B configs of each micro-batch that fits, at the least recomputation that fits any,
    for (t, cp, p, ep, etp, zero) = `dims`; under cp > 1 each at the faster cp_comm that
    fits. Where none fits, why (its `layout` left for the caller to name)."""
    t, k, p, ep, etp, zero = dims
    d = gpus // (t * k * p)
    per_rank = base.train.global_batch_size // d
    micro_batch, cp_comm = space.micro_batch, space.cp_comm
    batches = (
        [micro_batch]
        if micro_batch
        else [b for b in divisors(per_rank) if b <= space.max_micro_batch]
    )
    why = Rejected("", "no micro-batch size divides the batch", Constraint.BATCH)
    for mode in space.modes:
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
                ep=ep,
                etp=etp,
            )
            comms = [cp_comm] if cp_comm or k == 1 else _comm_order(cfg, c)
            variants = [replace_comm(cfg, comm) for comm in comms]
            try:
                needs = [_need(x, gpus, c, plans) for x in variants]
            except ConfigError as exc:
                reason = str(exc).replace("invalid configuration:\n  - ", "").split("\n")[0]
                why = Rejected("", reason, constraint_of(reason))
                continue
            fits = [x for x, (need, room) in zip(variants, needs) if need <= room]
            need, room = min(needs, key=lambda n: n[0] - n[1])
            if fits:
                fitting.append(fits[0])
            elif b == batches[0]:
                reason = (
                    f"needs {need / GIB:.1f} GiB per GPU with recompute={mode.value} at b={b}, "
                    f"{room / GIB:.1f} GiB usable"
                )
                why = Rejected("", reason, Constraint.MEMORY, need=need, usable=room)
        if fitting:
            return fitting, why
    return [], why


def replace_comm(cfg: RunConfig, comm: CpComm | None) -> RunConfig:
    """`cfg` with parallel.cp_comm = `comm` (None: as it is)."""
    return cfg if comm is None else replace(cfg, parallel=replace(cfg.parallel, cp_comm=comm))


def _need(cfg: RunConfig, gpus: int, c: Compute, plans: Plans) -> tuple[float, float]:
    """(need, usable) per GPU of `cfg` at its rank nearest the limit (`reserve.fit`; raises
    ConfigError for an invalid layout)."""
    layout = plans.layout(cfg, gpus)
    memory = predicted_memory(cfg, layout, c.system, c.software, gpus)
    return fit(memory, c.system.device)


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


def schedule_candidates(
    cfg: RunConfig, gpus: int, space: Space, rejected: list[Rejected]
) -> list[RunConfig]:
    """`cfg` under each of the space's schedules that fits: each at every feasible v it takes
    (`ScheduleSpec.takes_chunks`: interleaved any v > 1, ZB-V v = 2, the others v = 1); with
    p = 1 only 1F1B (no pipeline, no bubble)."""
    vpp, schedules = space.vpp, space.schedules
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
                rejected.append(Rejected(where, reason, constraint_of(reason)))
                continue
            if name == "zb-v" and m > ZB_V_MAX * p:
                rejected.append(Rejected(where, _zb_v_skipped(p, m), Constraint.SCHEDULE))
                continue
            out.append(candidate)
    return out


ZB_V_MAX = 16
"""ZB-V is simulated up to this many microbatches per pipeline rank: its list schedule has no
steady state to replay in short (`ptdp.perf.simulate.replay.replay_steady`), and a full replay costs
m p; past it ZB-H1, replayed in short, is within 1% of it (its bubble is at most twice)."""


def _zb_v_skipped(p: int, m: int) -> str:
    bubble = (p - 1) / (6 * m)
    return (
        f"not simulated: m = {m} > {ZB_V_MAX} p microbatches, where zb-v's bubble (p-1)/(6m) = "
        f"{100 * bubble:.2f}% is within {100 * bubble:.2f}% of zb-h1's (p-1)/(3m)"
    )
