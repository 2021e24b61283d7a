"""What `ptdp schedule` prints: a plan's step x rank table, the verifier's unit-cost verdict,
and, given each stage's layers, a replay with stage costs in layers (pure, no torch).

With `layers` (`parallel.pipeline_layers`, whose first and last entry may be 0) a stage's F,
B and W each cost its layers, plus the embedding on the first stage and the final norm,
output layer and loss on the last, both in layers (`ends`; Megatron-Core's pipeline split
counts one layer each). Transfers are free, as in the verifier's run.
"""

from __future__ import annotations

from ptdp.pipeline.dryrun import CommModel, PipelineCosts
from ptdp.pipeline.dryrun_engine import dry_run
from ptdp.pipeline.partition import split_problems
from ptdp.pipeline.plan import PipelinePlan, build_plan
from ptdp.pipeline.schedules import implied_vpp
from ptdp.pipeline.verify import format_table


def schedule_report(
    schedule: str,
    pp: int,
    num_microbatches: int,
    vpp: int | None = None,
    *,
    comms: bool = True,
    layers: str = "",
    ends: str = "1,1",
    paired: bool = False,
) -> str:
    """The table (with sends and receives unless not `comms`) and the verdict of `schedule`;
    vpp None: the schedule's own (`implied_vpp`), else 1. `layers` and `ends` as given on the
    command line ("0,4,4,0", "1,3"); `paired`: the variant `parallel.moe_overlap` runs, a
    paired action printed with a trailing `~`. Raises ValueError (`ScheduleError`) naming
    the fix."""
    vpp = vpp if vpp is not None else implied_vpp(schedule) or 1
    plan = build_plan(schedule, pp, num_microbatches, vpp, paired=paired)
    lines = [format_table(plan.lowered if comms else plan.compute), "", plan.check_line()]
    if layers:
        costs = _numbers("--end-costs", ends, float)
        if len(costs) != 2:
            raise ValueError(f"--end-costs takes two numbers E,H, got {ends!r}")
        lines.append(layer_weighted_line(plan, _numbers("--layers", layers, int), costs))
    return "\n".join(lines)


def layer_weighted_line(
    plan: PipelinePlan, layers: tuple[int, ...], ends: tuple[float, ...]
) -> str:
    """`plan` replayed with each stage costing its layers, the ends (embedding, output layer
    and loss) added on the first and the last stage (module doc); its makespan beside each
    rank's work."""
    stages = plan.stages.stages
    if problems := split_problems(layers, stages):
        raise ValueError(f"--layers {'; '.join(problems)} (pp*vpp = {stages})")
    weights = [float(n) for n in layers]
    weights[0] += ends[0]
    weights[-1] += ends[1]
    w = tuple(weights)
    costs = PipelineCosts(w, w, w, (0.0,) * stages, (0.0,) * stages)
    run = dry_run(plan.program, plan.stages, costs, comms=CommModel.RECV_BLOCKS, events=False)
    busiest, mean = max(run.busy), sum(run.busy) / len(run.busy)
    return (
        f"layers {','.join(map(str, layers))} | stage costs {','.join(f'{x:g}' for x in w)} "
        f"(layers; embedding {ends[0]:g}, output layer and loss {ends[1]:g}) | makespan "
        f"{run.makespan:g} | work per rank: busiest {busiest:g}, mean {mean:g}"
    )


def _numbers(flag: str, text: str, kind: type) -> tuple:
    try:
        return tuple(kind(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} {text}: give comma-separated numbers, e.g. 0,4,4,0") from None
