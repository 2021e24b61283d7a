"""`ptdp plan --compare`: the user's own layout placed in the planner's ranking."""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.perf.cost.hardware import GIB, System
from ptdp.perf.cost.reserve import fit
from ptdp.perf.cost.software import Software
from ptdp.perf.plan.planner import Option, PlanResult, Plans
from ptdp.perf.plan.ranking import faster_than
from ptdp.perf.simulate.simulator import simulate


@dataclass(frozen=True)
class Comparison:
    """The user's layout against the plan."""

    source: str
    """Where the layout came from (a TOML file, or the command line's config)."""
    option: Option | None
    """Its prediction; None where it cannot run on the GPUs."""
    problem: str
    """Why it is not ranked (invalid, or does not fit in memory); empty where it is."""
    rank: int
    """1-based place among the plan's layouts by step time (0: not ranked)."""
    total: int
    """Layouts ranked: the plan's, and this one where the plan does not hold it already."""
    gain: float
    """The recommended layout's throughput over this one's, minus 1 (0 where not ranked)."""


def compare(
    result: PlanResult,
    cfg: RunConfig,
    source: str,
    gpus: int,
    system: System,
    software: Software,
) -> Comparison:
    """Simulate `cfg`'s own layout on `gpus` GPUs and place it among the layouts that fit
    (`result.options`, and the unranked ones its bound cannot put behind it, replayed)."""
    best = result.best
    if best is not None:
        ours, planned = cfg.model, best.config.model
        if ours != planned or cfg.train.global_batch_size != best.config.train.global_batch_size:
            raise ConfigError(
                f"--compare {source}: its model or global batch differs from the planned one "
                f"({ours.num_layers} layers, hidden {ours.hidden_size}, batch "
                f"{cfg.train.global_batch_size} against {planned.num_layers}, "
                f"{planned.hidden_size}, {best.config.train.global_batch_size}); compare a "
                "layout of the same model and batch (the command line's keys apply to both)"
            )
    plans = Plans()
    try:
        layout = plans.layout(cfg, gpus)
        prediction = simulate(
            cfg, system, gpus, software=software, layout=layout, timeline=False, plans=plans
        )
    except ConfigError as exc:
        why = str(exc).replace("invalid configuration:\n  - ", "").replace("\n  - ", "; ")
        return Comparison(source, None, f"cannot run on {gpus} GPUs: {why}", 0, 0, 0.0)
    option = Option(cfg, prediction)
    need, usable = fit(prediction.memory, system.device)
    if need > usable:
        problem = (
            f"does not fit: needs {need / GIB:.1f} GiB per GPU, {usable / GIB:.1f} GiB usable on "
            f"{system.device.name}"
        )
        return Comparison(source, option, problem, 0, 0, 0.0)
    seconds = prediction.iteration_seconds
    faster = faster_than(seconds, result.options, result.unranked, gpus, system, software)
    gain = seconds / best.prediction.iteration_seconds - 1 if best is not None else 0.0
    mine = option.describe()
    held = any(o.describe() == mine for o in (*result.options, *result.unranked))
    return Comparison(source, option, "", faster + 1, result.fitting + (not held), gain)
