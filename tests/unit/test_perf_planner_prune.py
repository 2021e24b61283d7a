"""The planner with its replays pruned by the lower bound (`ptdp.perf.plan.ranking`) against the
planner replaying every layout: `ptdp plan`'s text and JSON, with and without `--compare`,
byte for byte, on small models, GPU counts and both software modes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.software import MEGATRON_2021, PTDP
from ptdp.perf.plan.compare import compare
from ptdp.perf.plan.planner import PlanResult, plan
from ptdp.perf.report import format_plan, plan_dict

A100 = load_system("a100-80gb")


def small(layers: int, hidden: int, batch: int) -> RunConfig:
    model = {"num_layers": layers, "hidden_size": hidden, "num_heads": 16, "seq_length": 512}
    sections = {
        "model": {**model, "vocab_size": 4096},
        "train": {"global_batch_size": batch, "precision": "bf16"},
    }
    return apply_updates(RunConfig(), sections, "test")


CASES = [  # (layers, hidden, batch, GPUs)
    (8, 512, 512, 16),
    (8, 1024, 512, 8),
    (12, 768, 256, 32),
    (16, 2048, 256, 32),
    (24, 4096, 512, 64),
]
SOFTWARE = {"ptdp": PTDP, "megatron-2021": MEGATRON_2021}
MINE = [  # layouts of one's own for --compare: fast, slow, deep in the ranking
    {"parallel": {"tp": 1, "pp": 2, "schedule": "1f1b"}, "train": {"micro_batch_size": 1}},
    {"parallel": {"tp": 8, "pp": 4, "schedule": "1f1b"}, "train": {"micro_batch_size": 1}},
    {"parallel": {"tp": 2, "pp": 2, "vpp": 2, "schedule": "interleaved"}},
]


def printed(result: PlanResult, top: int, base: RunConfig, gpus: int, software: str) -> list:
    """What `ptdp plan` prints for `result` (text and --json), alone and with each --compare."""
    out = [format_plan(result, A100, top), json.dumps(plan_dict(result, top))]
    for layout in MINE:
        mine = compare(
            result, apply_updates(base, layout, "mine"), "mine.toml", gpus, A100,
            SOFTWARE[software],
        )  # fmt: skip
        out += [format_plan(result, A100, top, mine), json.dumps(plan_dict(result, top, mine))]
    return out


@pytest.mark.parametrize("software", list(SOFTWARE))
@pytest.mark.parametrize(("layers", "hidden", "batch", "gpus"), CASES)
def test_pruning_prints_the_same(layers, hidden, batch, gpus, software) -> None:
    base = small(layers, hidden, batch)
    full = plan(base, gpus=gpus, system=A100, software=SOFTWARE[software], prune=False)
    assert not full.unranked
    for top in (1, 5, 12):
        pruned = plan(base, gpus=gpus, system=A100, software=SOFTWARE[software], top=top)
        assert printed(pruned, top, base, gpus, software) == printed(
            full, top, base, gpus, software
        )
        check_result(pruned, full, top)


def check_result(pruned: PlanResult, full: PlanResult, top: int) -> None:
    """`options` is the full ranking's head; every unranked layout fits and is slower than the
    last option: its bound says so where it was not replayed. No bound is above the step."""
    n = len(pruned.options)
    assert pruned.fitting == len(full.options)
    assert n >= min(top, pruned.fitting)
    assert [o.describe() for o in pruned.options] == [o.describe() for o in full.options[:n]]
    assert [o.prediction for o in pruned.options] == [o.prediction for o in full.options[:n]]
    assert pruned.recommended == full.recommended
    times = {o.describe(): o.prediction.iteration_seconds for o in full.options}
    last = pruned.options[-1].prediction.iteration_seconds
    for u in pruned.unranked:
        assert last < times[u.describe()] and u.bound <= times[u.describe()]
        if u.option is None:
            assert last < u.bound
        else:
            assert u.option.prediction.iteration_seconds == times[u.describe()]


def test_pruning_skips_most_replays() -> None:
    # The point of it: on these searches most layouts that fit are never replayed.
    base = small(24, 4096, 512)
    seen: list[str] = []
    result = plan(base, gpus=64, system=A100, progress=lambda i, n, what: seen.append(what))
    replays = sum(what.endswith("(replay)") for what in seen)
    assert replays == len(result.options) + sum(u.option is not None for u in result.unranked)
    assert result.unranked and replays < result.fitting


def test_planner_modules_import_no_torch() -> None:
    modules = "ptdp.perf.plan.planner, ptdp.perf.simulate.bound, ptdp.perf.plan.compare, "
    modules += "ptdp.perf.report"
    code = f"import sys, {modules}; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
