"""The planner's lighter first and last stages (`ptdp.perf.plan.ends`): tried where the
embedding and the loss make the ends the slowest stages, down to stages of no layer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ptdp.config.enums import Precision
from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.perf.cost.costs import Compute
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.software import PTDP
from ptdp.perf.plan.ends import best_ends
from ptdp.perf.plan.planner import plan
from ptdp.perf.report import overrides
from ptdp.perf.simulate.simulator import simulate

A100 = load_system("a100-80gb")
C = Compute(A100, Precision.BF16, PTDP)


def run(vocab: int, **parallel) -> RunConfig:
    """8 layers of a ~6B shape on 16 GPUs (tp = 2): the vocabulary decides how heavy the
    output layer and the loss are against a stage's 2 layers."""
    model = {"num_layers": 8, "hidden_size": 4096, "num_heads": 32, "seq_length": 2048}
    return apply_updates(
        RunConfig(),
        {
            "model": {**model, "vocab_size": vocab},
            "parallel": {"tp": 2, "pp": 4, **parallel},
            "train": {"precision": "bf16", "micro_batch_size": 1, "global_batch_size": 64},
        },
        "test",
    )


def with_split(cfg: RunConfig, split: tuple[int, ...]) -> RunConfig:
    return replace(cfg, parallel=replace(cfg.parallel, pipeline_layers=split))


@pytest.mark.parametrize(
    "parallel,split",
    [
        ({}, (2, 3, 3, 0)),  # the loss alone on the last stage
        ({"pp": 2}, (6, 2)),
        ({"vpp": 2, "schedule": "interleaved"}, (1, 1, 2, 1, 1, 1, 1, 0)),
        ({"vpp": 2, "schedule": "zb-v"}, (0, 1, 2, 2, 1, 1, 1, 0)),  # both ends on rank 0
    ],
    ids=["1f1b", "pp2", "interleaved", "zb-v"],
)
def test_a_heavy_output_layer_empties_the_last_stage(parallel: dict, split: tuple) -> None:
    # A 256k vocabulary: the output layer and loss cost about five of these layers.
    cfg = run(256_000, **parallel)
    assert best_ends(cfg, 16, C) == split
    even, ends = simulate(cfg, A100, 16), simulate(with_split(cfg, split), A100, 16)
    assert ends.iteration_seconds < even.iteration_seconds


@pytest.mark.parametrize("vocab", [1024, 32_000])
def test_even_stages_stay_where_the_ends_are_not_the_slowest(vocab: int) -> None:
    assert best_ends(run(vocab), 16, C) is None
    assert best_ends(run(vocab, vpp=2, schedule="interleaved"), 16, C) is None


def test_a_given_split_one_stage_or_experts_are_left_alone() -> None:
    assert best_ends(with_split(run(256_000), (2, 2, 2, 2)), 16, C) is None  # the user's
    assert best_ends(run(256_000, pp=1), 16, C) is None
    moe = run(256_000)
    moe = replace(moe, model=replace(moe.model, num_experts=4, moe_top_k=2))
    assert best_ends(moe, 16, C) is None


def test_the_planner_recommends_the_lighter_ends_with_their_options() -> None:
    result = plan(run(256_000), gpus=16, system=A100, tp=2, pp=4, schedules=("1f1b",), vpp=1)
    best = result.best
    assert best is not None and best.config.parallel.pipeline_layers == (2, 3, 3, 0)
    assert "layers=2,3,3,0" in best.describe()
    assert "--parallel.pipeline_layers 2,3,3,0 " in overrides(best)
    assert "; stages of 2,3,3,0 layers" in "\n".join(result.explanation)
    even = [o for o in result.options if not o.config.parallel.pipeline_layers]
    assert even and all(
        o.prediction.iteration_seconds > best.prediction.iteration_seconds for o in even
    )
