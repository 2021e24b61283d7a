"""Asynchronous saves write the same checkpoints as synchronous ones (a snapshot of the
state at the save), and a save interrupted by a dead rank never becomes the latest."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ptdp import checkpoint as ckpt
from ptdp.checkpoint.boxes import Boxes, TensorPlace, placed_boxes
from ptdp.parallel.env import LaunchEnv
from ptdp.train.run import train
from tests.dist.harness import RankError, run_ranks
from tests.helpers import tiny_config

pytestmark = pytest.mark.dist


def _config(data: str, run_dir: Path, steps: int, *, parallel=None, **train_):
    return tiny_config(
        data,
        run_dir,
        train={"steps": steps, "micro_batch_size": 2, "keep_checkpoints": 0, **train_},
        optim={"decay_steps": 6, "eps": 1e-6},
        parallel=parallel or {},
        model={"dropout": 0.1},
    )


def _assert_same(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), where
    for key in a:
        x, y = a[key], b[key]
        if key == "config":  # run_dir differs
            continue
        if isinstance(x, dict):
            _assert_same(x, y, f"{where}/{key}")
        elif torch.is_tensor(x):
            assert torch.equal(x, y), f"{where}/{key}"
        else:
            assert x == y, f"{where}/{key}"


def _steps(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


def test_async_save_is_a_snapshot(tmp_path: Path, monkeypatch) -> None:
    """The background write sees the state as it was at the call, even if the caller
    changes its tensors before the write starts; nothing is published before finish."""
    release = threading.Event()
    write = dcp.FileSystemWriter.write_data

    def held_write(self, plan, planner):
        assert release.wait(30)
        return write(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", held_write)
    weight = torch.arange(6.0).reshape(2, 3)
    place = TensorPlace((4,), (4,), (0,), (4,))  # an optimizer's boxes are staged too
    boxes = Boxes((4,), placed_boxes(place, torch.arange(4.0), 0))
    state = {"model/w": weight, "model/b": boxes, "step": 5}
    cfg = tiny_config("unused", tmp_path)
    pending = ckpt.start_checkpoint(tmp_path, 5, state, cfg, None, asynchronous=True)
    weight.fill_(-1.0)  # training goes on
    for _, data in boxes.boxes:
        data.fill_(-1.0)
    assert not pending.future.done()
    assert not (tmp_path / "checkpoints" / ckpt.LATEST).exists()
    release.set()
    step_dir = pending.finish()
    assert ckpt.find_checkpoint(tmp_path) == step_dir
    saved = ckpt.load_checkpoint(step_dir)
    assert torch.equal(saved["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(saved["model"]["b"], torch.arange(4.0))
    assert saved["step"] == 5


def test_async_save_matches_sync_and_resumes(tiny_data: str, tmp_path: Path) -> None:
    sync = train(_config(tiny_data, tmp_path / "sync", 4, save_interval=2))
    run = train(_config(tiny_data, tmp_path / "async", 4, save_interval=2, async_save=True))
    assert run.losses == sync.losses
    assert (
        _steps(tmp_path / "async")
        == _steps(tmp_path / "sync")
        == [
            "step_00000002",
            "step_00000004",
        ]
    )
    for name in _steps(tmp_path / "sync"):
        a = ckpt.load_checkpoint(tmp_path / "async" / "checkpoints" / name)
        s = ckpt.load_checkpoint(tmp_path / "sync" / "checkpoints" / name)
        _assert_same(a, s, name)
    # Stopped at step 2 and resumed (both asynchronous): bit for bit.
    split = tmp_path / "split"
    train(_config(tiny_data, split, 2, async_save=True))
    resumed = train(_config(tiny_data, split, 4, async_save=True), resume=True)
    assert sorted(resumed.losses) == [3, 4]
    for step in (3, 4):
        assert resumed.losses[step] == sync.losses[step], step


def _sync_and_async(rank: int, world: int, data: str, root: str) -> None:
    env = LaunchEnv(rank, world, rank)
    losses = {}
    for mode in ("sync", "async"):
        cfg = _config(
            data,
            Path(root) / mode,
            3,
            parallel={"tp": 2},
            save_interval=1,
            async_save=mode == "async",
        )
        losses[mode] = train(cfg, env=env).losses
    if rank == 0:
        (Path(root) / "losses.json").write_text(json.dumps(losses))


def test_async_save_two_ranks(tiny_data: str, tmp_path: Path) -> None:
    run_ranks(_sync_and_async, 2, tiny_data, str(tmp_path))
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert losses["sync"] == losses["async"]
    names = _steps(tmp_path / "sync")
    assert names == _steps(tmp_path / "async") and len(names) == 3
    for name in names:
        a = ckpt.load_checkpoint(tmp_path / "async" / "checkpoints" / name)
        s = ckpt.load_checkpoint(tmp_path / "sync" / "checkpoints" / name)
        _assert_same(a, s, name)


def _die_in_second_save(rank: int, world: int, data: str, root: str) -> None:
    """Rank 1 exits abruptly while writing its shards of the second checkpoint."""
    calls = []
    write = dcp.FileSystemWriter.write_data

    def dying_write(self, plan, planner):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            os._exit(1)
        return write(self, plan, planner)

    dcp.FileSystemWriter.write_data = dying_write
    cfg = _config(data, Path(root) / "run", 3, parallel={"tp": 2}, save_interval=1)
    train(cfg, env=LaunchEnv(rank, world, rank))


def test_interrupted_save_leaves_previous_latest(tiny_data: str, tmp_path: Path) -> None:
    with pytest.raises(RankError, match="rank 1 exited with code 1"):
        run_ranks(_die_in_second_save, 2, tiny_data, str(tmp_path), timeout_s=60)
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    assert (root / ckpt.LATEST).read_text().strip() == "step_00000001"
    assert (root / "step_00000002.tmp").is_dir()  # the partial save, left behind
    assert not (root / "step_00000002").exists()
    step_dir = ckpt.find_checkpoint(run_dir)
    assert step_dir == root / "step_00000001"
    assert ckpt.load_checkpoint(step_dir)["step"] == 1
    # Resume in one process (resharded from tp=2): continues from step 1.
    resumed = train(_config(tiny_data, run_dir, 3, save_interval=1), resume=True)
    assert resumed.start_step == 1 and sorted(resumed.losses) == [2, 3]
    assert _steps(run_dir) == ["step_00000001", "step_00000002", "step_00000003"]
    assert ckpt.find_checkpoint(run_dir) == root / "step_00000003"
