"""The pipeline split's rules of `validate`: `parallel.pipeline_layers` covers every layer
once, only the end stages may hold none; without it the split is even."""

from __future__ import annotations

from ptdp.config.sections import RunConfig
from ptdp.pipeline.partition import empty_middle, near_even_split


def pipeline_layers_rules(cfg: RunConfig, errors: list[str]) -> None:
    """An explicit split must cover every layer exactly, and only the first and the last
    stage may hold none; without one the split is even."""
    p, layers, stages = cfg.parallel, cfg.model.num_layers, cfg.parallel.pp * cfg.parallel.vpp
    given = p.pipeline_layers
    if not given:
        if layers > 0 and layers % stages:
            errors.append(
                f"model.num_layers = {layers} is not divisible by pp*vpp = {p.pp}*{p.vpp}; "
                f"choose a layer count that is a multiple of {stages}, or "
                f"{_split_fix(layers, stages)}"
            )
        return
    split = ",".join(map(str, given))
    fix = _split_fix(layers, stages) if layers > 0 else ""
    if len(given) != stages:
        errors.append(
            f"parallel.pipeline_layers = {split} has {len(given)} entries but pp*vpp = "
            f"{p.pp}*{p.vpp} = {stages} stages need one each; {fix or 'give one per stage'}"
            + (", or leave it empty for an even split" if layers % stages == 0 else "")
        )
    empty = empty_middle(given) if len(given) == stages else []
    if min(given) < 0:
        errors.append(f"parallel.pipeline_layers = {split} has an entry below 0")
    elif empty:
        errors.append(
            f"parallel.pipeline_layers = {split} gives stage {', '.join(map(str, empty))} no "
            "layer; only the first stage (the embedding alone) and the last one (the final "
            "norm, output layer and loss alone) may hold 0 layers" + (f"; {fix}" if fix else "")
        )
    if layers > 0 and sum(given) != layers:
        errors.append(
            f"parallel.pipeline_layers = {split} sums to {sum(given)} but model.num_layers = "
            f"{layers}; the counts must add up to the layer count (no layer is dropped): {fix}"
        )


def _split_fix(layers: int, stages: int) -> str:
    """How to split `layers` over `stages`: a split that validates (`near_even_split`), or,
    where none exists, the most stages these layers fill; never a split that cannot be met."""
    split = near_even_split(layers, stages)
    if split is None:
        return (
            f"use fewer stages: at most pp*vpp = {layers + 2} for model.num_layers = {layers} "
            "(one layer each, the first and the last stage none)"
        )
    return f"give each stage's layers, e.g. --parallel.pipeline_layers {','.join(map(str, split))}"


def stage_layers(cfg: RunConfig) -> tuple[int, ...]:
    """The validated split: `parallel.pipeline_layers`, or the even one."""
    stages = cfg.parallel.pp * cfg.parallel.vpp
    return cfg.parallel.pipeline_layers or (cfg.model.num_layers // stages,) * stages
