"""`ptdp generate`'s layout: tp = processes / pp, the layer split, and the refusals that
come before any process group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.sample import launch_generation, split_processes, stage_layers


def run_cfg(**model) -> RunConfig:
    base = {"num_layers": 3, "hidden_size": 32, "num_heads": 4, "seq_length": 16}
    return apply_updates(RunConfig(), {"model": {**base, **model}}, "test")


def test_tensor_size_is_processes_over_pp() -> None:
    assert [split_processes(4, pp) for pp in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(ConfigError, match="--pp 2 pipeline stages do not divide 3 process"):
        split_processes(3, 2)
    with pytest.raises(ConfigError, match="--pp 0"):
        split_processes(2, 0)


def test_layers_split_near_evenly_over_stages() -> None:
    assert stage_layers(run_cfg(), Path("ckpt"), 1, 1) == [range(3)]
    assert stage_layers(run_cfg(), Path("ckpt"), 1, 2) == [range(0, 2), range(2, 3)]
    assert stage_layers(run_cfg(num_layers=4), Path("c"), 2, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(run_cfg(), Path("ckpt"), 1, 3) == [range(i, i + 1) for i in range(3)]
    # More stages than layers: the last, then the first stage holds none (the head, the
    # embedding alone).
    ones = [range(i, i + 1) for i in range(3)]
    assert stage_layers(run_cfg(), Path("ckpt"), 1, 4) == [*ones, range(3, 3)]
    assert stage_layers(run_cfg(), Path("ckpt"), 1, 5) == [range(0, 0), *ones, range(3, 3)]
    assert stage_layers(run_cfg(num_layers=6), Path("c"), 1, 4) == [
        range(0, 1), range(1, 3), range(3, 5), range(5, 6)
    ]  # fmt: skip


def test_layouts_the_model_cannot_take_are_refused() -> None:
    with pytest.raises(ConfigError, match="3 layers, too few for --pp 6 stages.*--pp 5 or"):
        stage_layers(run_cfg(), Path("ckpt"), 1, 6)  # a middle stage would have no layer
    with pytest.raises(ConfigError, match=r"ckpt's model over tp=3 x pp=1(.|\n)*num_heads = 4"):
        stage_layers(run_cfg(), Path("ckpt"), 3, 1)


def test_one_process_with_pp_is_refused_before_any_process_group(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="nproc-per-node 2 -m ptdp generate"):
        launch_generation(Path("no/such/run"), "cpu", pp=2)  # refused before the checkpoint
    assert not dist.is_initialized()
    assert launch_generation(Path("no/such/run"), "cpu") == (None, "cpu")
