"""The pipeline's rules of `validate`: `parallel.pipeline_layers` covers every layer once,
only the end stages may hold none, without it the split is even; the schedule gets the
microbatches it needs; `parallel.moe_overlap` only where something pairs."""

from __future__ import annotations

from ptdp.config.sections import RunConfig
from ptdp.pipeline.partition import empty_middle, near_even_split
from ptdp.pipeline.schedules import SCHEDULES


def schedule_rules(cfg: RunConfig, dp: int, microbatches: int, errors: list[str]) -> bool:
    """DualPipeV needs 2 pp microbatches per pipeline per step (its warm-up alone runs
    2 pp - 1 forwards on rank 0); `ptdp.pipeline.schedules.check_args` holds the rest.
    Returns whether it appended an error."""
    p = cfg.parallel
    least = SCHEDULES[p.schedule.value].min_microbatches(p.pp)
    if p.pp == 1 or not 0 < microbatches < least:
        return False
    fits = least * cfg.train.micro_batch_size * max(dp, 1)
    errors.append(
        f"parallel.schedule = {p.schedule.value} needs at least 2 * pp = {least} microbatches "
        f"per step with parallel.pp = {p.pp}, got {microbatches} (global_batch_size / "
        f"(micro_batch_size * dp)); e.g. --train.global_batch_size {fits}, or "
        "--parallel.schedule zb-v"
    )
    return True


def moe_overlap_rules(cfg: RunConfig, errors: list[str]) -> None:
    """`parallel.moe_overlap` pairs forwards with backwards for the MoE all-to-all: it needs
    MoE layers, and a schedule with a paired variant where there is a pipeline."""
    p = cfg.parallel
    if not p.moe_overlap:
        return
    if cfg.model.num_experts == 0:
        errors.append(
            "parallel.moe_overlap = true overlaps the expert-parallel all-to-all of a "
            "mixture-of-experts model, but model.num_experts = 0 (a dense model); set "
            "--parallel.moe_overlap false, or --model.num_experts 8 for an MoE model"
        )
    if p.pp > 1 and not SCHEDULES[p.schedule.value].can_pair:
        can = " or ".join(n for n, s in SCHEDULES.items() if s.can_pair)
        errors.append(
            f"parallel.moe_overlap = true pairs the schedule's forwards with backwards, which "
            f"parallel.schedule = {p.schedule.value} has no variant for; it is allowed with "
            f"parallel.pp = 1 or parallel.schedule {can}: set --parallel.schedule 1f1b or "
            "--parallel.moe_overlap false"
        )


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
