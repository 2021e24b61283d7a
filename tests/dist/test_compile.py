"""Compiled layers under tensor and pipeline parallelism match the eager single process.

One spawn of 2 ranks trains two layouts with train.compile = true, one after the other:
tp = 2 with sequence parallelism (the layer's all-gather / reduce-scatter pairs, and the
vocabulary-parallel loss's all-reduces, are traced inside the compiled graphs) and pp = 2
(the pipeline runtime drives compiled chunks). Both must give the eager single-process
losses and final weights within 1e-5 relative. Under a torch older than
`COMPILED_TP_TORCH` the tp layout is refused (its compiled backward is wrong there), so only
pp = 2 runs. A second spawn trains a compiled MoE model under ep = 2 and under a zero-bubble
pipeline (the routing's steps eager between the compiled graphs, `ptdp.model.compile`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from ptdp import checkpoint as ckpt
from ptdp.config.sections import RunConfig
from ptdp.parallel.env import LaunchEnv
from ptdp.rules import speed
from ptdp.rules.speed import COMPILED_TP_TORCH
from ptdp.train.run import train
from tests.dist.harness import run_ranks
from tests.helpers import assert_same_run, tiny_config

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(
        shutil.which("g++") is None and shutil.which("c++") is None,
        reason="torch.compile (Inductor) on CPU needs a C++ compiler (g++)",
    ),
]

LAYOUTS = {
    "tp2-sp": {"tp": 2, "sequence_parallel": True},
    "pp2": {"pp": 2},
}
if (speed.torch_version() or COMPILED_TP_TORCH) < COMPILED_TP_TORCH:
    del LAYOUTS["tp2-sp"]  # refused there (tests/unit/test_speed_switches.py): wrong gradients


def _config(data: str, run_dir: Path, parallel: dict, compile: bool) -> RunConfig:
    return tiny_config(
        data,
        run_dir,
        model={"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 16},
        parallel=parallel,
        optim={"eps": 1e-6},  # see tests/dist/test_tensor.py
        train={"micro_batch_size": 2, "global_batch_size": 8, "steps": 3, "compile": compile},
    )


def _check_compiled(rank: int, world_size: int, data: str, root: str) -> None:
    for name, parallel in LAYOUTS.items():
        counters.clear()
        run_dir = Path(root) / name
        result = train(
            _config(data, run_dir, parallel, True), env=LaunchEnv(rank, world_size, rank)
        )
        if rank == 0:
            graphs = {
                "graphs": counters["stats"]["unique_graphs"],
                "breaks": counters["graph_break"],
            }
            (run_dir / "losses.json").write_text(json.dumps(result.losses))
            (run_dir / "graphs.json").write_text(json.dumps(graphs))


def test_compiled_layouts_match_eager_single_process(tiny_data: str, tmp_path: Path) -> None:
    single = train(_config(tiny_data, tmp_path / "single", {}, False))
    run_ranks(_check_compiled, 2, tiny_data, str(tmp_path), timeout_s=240)
    for name in LAYOUTS:
        losses = json.loads((tmp_path / name / "losses.json").read_text())
        assert sorted(losses) == ["1", "2", "3"], name
        reference = {str(k): v for k, v in single.losses.items()}
        assert_same_run(tmp_path / "single", tmp_path / name, reference, losses)
    # tp = 2 + SP: the layer and the vocabulary-parallel loss (with their collectives) are
    # each one graph (a second pair for evaluation mode), with no breaks.
    if "tp2-sp" not in LAYOUTS:
        return
    graphs = json.loads((tmp_path / "tp2-sp" / "graphs.json").read_text())
    assert graphs["breaks"] == {} and 2 <= graphs["graphs"] <= 4, graphs


MOE = {"num_experts": 4, "moe_top_k": 2, "moe_aux_loss_coeff": 0.01, "moe_shared_experts": 1}
MOE_LAYOUTS = {
    "ep2-moe": {"dp": 2, "ep": 2},  # the all-to-alls run eager between the compiled graphs
    "pp2-zb-moe": {"pp": 2, "schedule": "zb-h1"},  # the experts' weight gradients at W
    "tp2-etp2-moe": {"tp": 2, "etp": 2, "sequence_parallel": True},  # the etp gathers traced
}


def _moe_config(data: str, run_dir: Path, parallel: dict, compile: bool) -> RunConfig:
    cfg = _config(data, run_dir, parallel, compile)
    return replace(cfg, model=replace(cfg.model, **MOE))


def _check_compiled_moe(rank: int, world_size: int, data: str, root: str) -> None:
    for name, parallel in MOE_LAYOUTS.items():
        run_dir = Path(root) / name
        cfg = _moe_config(data, run_dir, parallel, True)
        result = train(cfg, env=LaunchEnv(rank, world_size, rank))
        if rank == 0:
            (run_dir / "losses.json").write_text(json.dumps(result.losses))


@pytest.mark.timeout(900)  # three compiled layouts: over pytest's 300 s when loaded
def test_compiled_moe_layouts_match_eager_single_process(tiny_data: str, tmp_path: Path) -> None:
    """A compiled MoE model under expert parallelism (ep = 2 over dp = 2), under a
    zero-bubble pipeline (the eager expert products defer their weight gradients to W) and
    with its experts split over etp = tp = 2 (sequence parallelism):
    the eager single process's losses within 1e-5 relative and final weights within 1e-5
    absolute. (The compiled router's softmax rounds differently from eager's; Adam, at
    eps = 1e-6, turns that into ~1e-6 on a weight whose gradient is that small: seen on
    one expert element of 16,384 in the pipeline.)"""
    single = train(_moe_config(tiny_data, tmp_path / "single", {}, False))
    run_ranks(_check_compiled_moe, 2, tiny_data, str(tmp_path), timeout_s=800)
    reference = {str(k): v for k, v in single.losses.items()}
    a = ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path / "single"))["model"]
    for name in MOE_LAYOUTS:
        losses = json.loads((tmp_path / name / "losses.json").read_text())
        assert sorted(losses) == ["1", "2", "3"], name
        for step, loss in reference.items():
            assert losses[step] == pytest.approx(loss, rel=1e-5), (name, step)
        b = ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path / name))["model"]
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-5, msg=key)
