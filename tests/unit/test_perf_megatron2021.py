"""Megatron-LM 2021's interleaved order of passes and exchanges
(`ptdp.perf.simulate.megatron2021`)."""

from __future__ import annotations

import pytest

from ptdp.config.enums import Precision
from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.perf.cost.costs import Compute
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.software import MEGATRON_2021
from ptdp.perf.simulate.megatron2021 import megatron_2021_interleaved
from ptdp.perf.simulate.pipeline_costs import pipeline_costs
from ptdp.perf.simulate.simulator import simulate
from ptdp.pipeline.actions import Kind
from ptdp.pipeline.dryrun import CommModel, PipelineCosts
from ptdp.pipeline.dryrun_engine import dry_run
from ptdp.pipeline.placement import StageMap
from ptdp.pipeline.plan import build_plan
from ptdp.rules.layout import validate
from tests.helpers import PERF_MODEL


def _costs(stages: int, f: float, b: float, transfer: float) -> PipelineCosts:
    return PipelineCosts(
        (f,) * stages, (b,) * stages, (0.0,) * stages, (transfer,) * stages, (transfer,) * stages
    )


@pytest.mark.parametrize(
    ("pp", "vpp", "m"), [(2, 2, 2), (2, 2, 6), (4, 2, 4), (4, 3, 8), (3, 4, 9)]
)
def test_free_transfers_give_the_interleaved_bubble(pp, vpp, m) -> None:
    """Every pass runs once, every message is received once, and with free transfers the
    bubble is the paper's (p - 1) / (v m) (including m = p, where the 2021 code runs all
    forwards first)."""
    stages = StageMap(pp, vpp)
    plan = megatron_2021_interleaved(stages, m)
    for actions in plan.values():
        computes = [a for a in actions if a.kind.is_compute]
        assert len(computes) == 2 * m * vpp and len(set(computes)) == len(computes)
        sends = {(a.kind, a.stage, a.mb) for a in actions if a.kind in (Kind.SEND_F, Kind.SEND_B)}
        assert len(sends) == sum(a.kind in (Kind.SEND_F, Kind.SEND_B) for a in actions)
    receives = sorted(
        (a.kind.value, a.stage, a.mb)
        for acts in plan.values()
        for a in acts
        if a.kind in (Kind.RECV_F, Kind.RECV_B)
    )
    expected = sorted(
        [("RECV_F", s, mb) for s in range(1, pp * vpp) for mb in range(m)]
        + [("RECV_B", s, mb) for s in range(pp * vpp - 1) for mb in range(m)]
    )
    assert receives == expected
    run = dry_run(plan, stages, _costs(pp * vpp, 1.0, 2.0, 0.0), comms=CommModel.BLOCKING)
    assert not run.stuck
    ideal = 3.0 * m * vpp
    assert run.makespan == pytest.approx(ideal * (1 + (pp - 1) / (vpp * m)))


def test_steady_state_exchanges_follow_both_passes() -> None:
    """In the steady state a forward's output leaves after the backward that follows it, and
    the receives of one exchange come after its sends, before the next forward."""
    plan = megatron_2021_interleaved(StageMap(4, 2), 8)
    actions = plan[1]
    text = [a.kind.value for a in actions]
    first_bw = text.index("BW")
    assert text[first_bw - 1] == "F"  # F then BW, no transfer between them
    assert text[first_bw + 1 : first_bw + 5] == ["SEND_F", "SEND_B", "RECV_F", "RECV_B"]
    sent = actions[first_bw + 1]
    assert (sent.stage, sent.mb) == (actions[first_bw - 1].stage, actions[first_bw - 1].mb)


def test_the_2021_order_exposes_more_of_each_transfer() -> None:
    """With transfers (a tenth of a pass), the 2021 order is slower than ptdp's, which sends
    each output as soon as it is made and waits for a gradient only before its backward;
    both replayed with blocking transfers (p = 4, v = 2, m = 8: 79.4 against 78.9)."""
    stages, costs = StageMap(4, 2), _costs(8, 1.0, 3.0, 0.1)
    ours = dry_run(
        build_plan("interleaved", 4, 8, 2).lowered, stages, costs, comms=CommModel.BLOCKING
    )
    theirs = dry_run(megatron_2021_interleaved(stages, 8), stages, costs, comms=CommModel.BLOCKING)
    assert ours.makespan == pytest.approx(78.9)
    assert theirs.makespan == pytest.approx(79.4)


def test_refuses_what_the_2021_code_refused() -> None:
    with pytest.raises(ValueError, match="multiple of pp"):
        megatron_2021_interleaved(StageMap(4, 2), 6)


def test_simulate_replays_the_2021_order_for_megatron_2021() -> None:
    """`simulate` under `--software megatron-2021` replays these lists (its pipeline time is
    their dry run's makespan with the model's costs), not ptdp's order."""
    cfg = apply_updates(
        RunConfig(),
        {
            "model": PERF_MODEL,
            "parallel": {
                "tp": 8,
                "pp": 4,
                "vpp": 2,
                "schedule": "interleaved",
                "recompute": "full",
                "sequence_parallel": False,
                "scatter_gather": False,
                "overlap_grad_reduce": False,
            },
            "train": {"precision": "bf16", "micro_batch_size": 1, "global_batch_size": 8},
        },
        "test",
    )
    system = load_system("a100-80gb")
    layout = validate(cfg, 32, gpus=True)
    costs = pipeline_costs(cfg, layout, Compute(system, Precision.BF16, MEGATRON_2021))
    theirs = dry_run(
        megatron_2021_interleaved(layout.stages, 8), layout.stages, costs, comms=CommModel.BLOCKING
    )
    ours = dry_run(layout.pipeline.lowered, layout.stages, costs, comms=CommModel.BLOCKING)
    assert theirs.makespan > ours.makespan
    for timeline in (True, False):
        p = simulate(cfg, system, 32, software=MEGATRON_2021, timeline=timeline)
        assert p.pipeline_seconds == pytest.approx(theirs.makespan, rel=1e-12)
