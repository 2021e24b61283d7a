"""The planner's uneven splits: lighter first and last stages, down to none, where they help.

An even split gives each of the p*v stages L/(p v) layers, so the first stage also carries
the embedding and the last one the final norm, output layer and loss. With a large
vocabulary or few layers per stage those two are the pipeline's slowest, and every other
stage waits for them. For each candidate of the search `lighter_ends` moves layers from the
first and the last stage to the others, down to none (the embedding alone, the loss alone,
as Megatron-Core's pipeline layouts allow): it models a stage's time as its layers times one
layer's, plus the first and the last stage's own work (what the even split's stage costs
hold beyond their layers), and keeps the split whose busiest pipeline rank is least busy.
The split joins the candidates, to be checked for memory and replayed like any other, only
where that rank is at least `MIN_GAIN` less busy than under the even split.
"""

from __future__ import annotations

from dataclasses import replace

from ptdp.config.sections import RunConfig
from ptdp.perf.cost.costs import Compute
from ptdp.perf.simulate.pipeline_costs import layer_costs, stage_costs
from ptdp.pipeline.partition import near_even_split
from ptdp.pipeline.placement import StageMap
from ptdp.rules.layout import validate

MIN_GAIN = 0.01
"""A lighter-ends split is tried where its busiest rank is this much less busy (modelled)."""


def lighter_ends(candidates: list[RunConfig], gpus: int, c: Compute) -> list[RunConfig]:
    """For each candidate with an even split over p > 1 (a given split is the user's), the
    same layout with lighter first and last stages, where the model says it helps."""
    out = []
    for cfg in candidates:
        split = best_ends(cfg, gpus, c)
        if split is not None:
            out.append(replace(cfg, parallel=replace(cfg.parallel, pipeline_layers=split)))
    return out


def best_ends(cfg: RunConfig, gpus: int, c: Compute) -> tuple[int, ...] | None:
    """The split of `cfg`'s layers with the first and the last stage at most as heavy as the
    even split's (any of them for two stages) whose busiest rank is least busy, fewest layers
    moved on a tie; None where none beats the even split by `MIN_GAIN`. Mixture-of-experts
    models are left even (their layers differ in cost, which this model does not hold)."""
    if cfg.parallel.pp == 1 or cfg.parallel.pipeline_layers or cfg.model.num_experts:
        return None
    layout = validate(cfg, gpus, gpus=True)
    stages, layers = layout.stages, cfg.model.num_layers
    n = layers // stages.stages
    costs = [p.f + p.b + p.w for p in stage_costs(cfg, layout, c)]
    if stages.stages > 2:  # a middle stage is its layers alone
        per_layer = sum(costs[1:-1]) / (len(costs) - 2) / n
    else:
        one = layer_costs(cfg, layout, c)
        per_layer = one.f + one.b + one.w
    first, last = costs[0] - n * per_layer, costs[-1] - n * per_layer  # the ends' own work
    reach = layers if stages.stages == 2 else n
    even = _busiest((n,) * stages.stages, stages, per_layer, first, last)
    best, best_key = None, (even * (1 - MIN_GAIN), 0)
    for a in range(reach + 1):
        for z in range(reach + 1):
            split = _with_ends(layers, stages.stages, a, z)
            if split is None:
                continue
            key = (_busiest(split, stages, per_layer, first, last), abs(n - a) + abs(n - z))
            if key < best_key:
                best, best_key = split, key
    return best


def _with_ends(layers: int, stages: int, a: int, z: int) -> tuple[int, ...] | None:
    """a layers on the first stage, z on the last, the rest near-evenly between them."""
    if stages == 2:
        return (a, z) if a + z == layers else None
    middle = near_even_split(layers - a - z, stages - 2) if layers - a - z >= stages - 2 else None
    return None if middle is None else (a, *middle, z)


def _busiest(
    split: tuple[int, ...], stages: StageMap, per_layer: float, first: float, last: float
) -> float:
    """Seconds of the busiest rank for one microbatch of every stage it holds (modelled)."""
    work = [0.0] * stages.pp
    for stage, count in enumerate(split):
        extra = first if stage == 0 else last if stage == stages.last else 0.0
        work[stages.rank(stage)] += count * per_layer + extra
    return max(work)
