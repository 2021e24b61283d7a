"""checkpoint.init_from across layouts: a one-process run's weights, and a Hugging Face
Llama's and Mixtral's, loaded into tp=2, pp=2, dp=2 (distributed optimizer) and, for the
mixture of experts, ep=2 (each rank 2 of the 4 experts) hold exactly the source's weights,
and train with the losses of one process started from the same source."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ptdp import checkpoint as ckpt
from ptdp.convert.hf import from_hf_state, read_hf_weights
from ptdp.parallel.env import LaunchEnv
from ptdp.train.init_from import load_initial_weights, open_source
from ptdp.train.run import prepare, train
from ptdp.train.step.trainer import Trainer
from tests.dist.harness import run_ranks
from tests.helpers import LLAMA, assert_same_run, save_tiny_hf, tiny_config

pytestmark = pytest.mark.dist

LAYOUTS = {
    "tp2": ({"tp": 2}, {}),
    "pp2": ({"pp": 2}, {}),
    "dp2": ({}, {"distributed": True}),
    "ep2": ({"ep": 2}, {"distributed": True}),
}
LAYOUTS_OF = {"ptdp": ("tp2", "pp2", "dp2"), "hf": ("tp2", "pp2"), "mixtral": ("ep2",)}
"""The Hugging Face path shards the same way in every layout; experts split only with MoE."""
STEPS = {"steps": 3, "micro_batch_size": 2}


def _config(data: str, run_dir: Path, source: Path, parallel: dict, optim: dict, model: dict):
    return tiny_config(
        data,
        run_dir,
        parallel=parallel,
        optim={"eps": 1e-6, **optim},  # Adam's update of a near-zero gradient amplifies rounding
        model={"num_layers": 4, **model},
        train=STEPS,
        checkpoint={"init_from": str(source)},
    )


def _check_loaded(cfg, env: LaunchEnv, expected: dict[str, torch.Tensor]) -> None:
    """Right after the load, this rank holds its shards of the source's weights (gathered
    over tp: the full tensors of its stage), at step 0 with no optimizer state."""
    ready, layout, data = prepare(cfg, env)
    trainer = Trainer(ready, layout, env, data)
    load_initial_weights(trainer.checkpoints, open_source(cfg.checkpoint.init_from), ready.model)
    masters = trainer.optimizer.master_weights()
    for weights in (None, masters):  # the parameters, and the optimizer's fp32 masters
        loaded = ckpt.full_model_state(trainer.chunks, trainer.tp, weights, trainer.mesh.axis("ep"))
        assert loaded and loaded.keys() <= expected.keys()
        for name, value in loaded.items():
            assert torch.equal(value, expected[name]), name
    assert trainer.step == 0 and trainer.optimizer.moments() == ({}, 0)


def _init_in_layouts(rank: int, world: int, data: str, root: str, sources: dict) -> None:
    env, root_ = LaunchEnv(rank, world, rank), Path(root)
    for kind, (source, expected_file, model) in sources.items():
        expected = torch.load(expected_file, weights_only=True)
        for name in LAYOUTS_OF[kind]:
            parallel, optim = LAYOUTS[name]
            cfg = _config(data, root_ / f"{kind}-{name}", Path(source), parallel, optim, model)
            _check_loaded(cfg, env, expected)
            result = train(cfg, env=env)
            if rank == 0:
                (root_ / f"{kind}-{name}.json").write_text(json.dumps(result.losses))


def _source_weights(source: Path) -> dict[str, torch.Tensor]:
    """Full-shape weights of the source, read without the code under test's sharding."""
    if (source / "config.json").is_file():
        model = replace(open_source(str(source)).model, seq_length=32)
        return from_hf_state(model, read_hf_weights(source))
    return ckpt.load_checkpoint(ckpt.find_checkpoint(source))["model"]


def test_init_from_in_other_layouts(tiny_data: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="needs transformers (pip install .[hf])")
    # The ptdp source: trained in one process. The Hugging Face source: a random Llama.
    src = tmp_path / "src"
    train(tiny_config(tiny_data, src, model={"num_layers": 4}, train=STEPS))
    save_tiny_hf(tmp_path / "hf", "llama", positions=32)
    save_tiny_hf(tmp_path / "mixtral", "mixtral", positions=32)
    sources = {
        "ptdp": (src, {}),
        "hf": (tmp_path / "hf", LLAMA),
        "mixtral": (tmp_path / "mixtral", LLAMA),
    }
    refs, args = {}, {}
    for kind, (source, model) in sources.items():
        refs[kind] = train(_config(tiny_data, tmp_path / f"{kind}-one", source, {}, {}, model))
        torch.save(_source_weights(source), tmp_path / f"{kind}.pt")
        args[kind] = (str(source), str(tmp_path / f"{kind}.pt"), model)
    run_ranks(_init_in_layouts, 2, tiny_data, str(tmp_path), args, timeout_s=400)
    for kind in sources:
        for name in LAYOUTS_OF[kind]:
            losses = json.loads((tmp_path / f"{kind}-{name}.json").read_text())
            losses = {int(k): v for k, v in losses.items()}
            assert sorted(losses) == [1, 2, 3]
            assert_same_run(
                tmp_path / f"{kind}-one", tmp_path / f"{kind}-{name}", refs[kind].losses, losses
            )
