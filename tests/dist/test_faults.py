"""Two ranks agree: a SIGTERM seen by one rank, or a NaN gradient on one rank, leads both
to the same decision at the same step."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest

from ptdp import checkpoint as ckpt
from ptdp.errors import CheckpointError
from ptdp.parallel.env import LaunchEnv
from ptdp.train.run import train
from ptdp.train.step.trainer import Trainer
from tests.dist.harness import run_ranks
from tests.helpers import tiny_config

pytestmark = pytest.mark.dist


def _config(data: str, run_dir: Path, **train_):
    return tiny_config(
        data, run_dir, train={"micro_batch_size": 2, **train_}, optim={"decay_steps": 6}
    )


def _sigterm_on_rank1(rank: int, world: int, data: str, root: str) -> None:
    original = Trainer.forward_backward

    def forward_backward(self):
        if rank == 1 and self.step + 1 == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self)

    Trainer.forward_backward = forward_backward
    result = train(_config(data, Path(root) / "run"), env=LaunchEnv(rank, world, rank))
    Path(root, f"rank{rank}.json").write_text(
        json.dumps({"final": result.final_step, "signal": result.interrupted})
    )


def test_sigterm_on_one_rank_stops_both(tiny_data: str, tmp_path: Path) -> None:
    run_ranks(_sigterm_on_rank1, 2, tiny_data, str(tmp_path))
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {"final": 2, "signal": signal.SIGTERM}, rank
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002"]


def _nan_grad_on_rank1(rank: int, world: int, data: str, root: str) -> None:
    original = Trainer.forward_backward

    def forward_backward(self):
        loss = original(self)
        if rank == 1 and self.step + 1 == 3:  # after the reduction: rank 1's copy only
            self.optimizer.pieces[0].master.grad.view(-1)[0] = float("nan")
        return loss

    Trainer.forward_backward = forward_backward
    for zero in (0, 3):  # ZeRO-3: the NaN in rank 1's shard, its parameters gathered next
        cfg = _config(data, Path(root) / f"run{zero}", on_nan="skip")
        cfg = replace(cfg, parallel=replace(cfg.parallel, zero=zero))
        result = train(cfg, env=LaunchEnv(rank, world, rank))
        Path(root, f"rank{rank}-zero{zero}.json").write_text(
            json.dumps({"final": result.final_step, "skipped": result.nonfinite_skipped})
        )


def test_nan_on_one_rank_is_skipped_by_both(tiny_data: str, tmp_path: Path) -> None:
    run_ranks(_nan_grad_on_rank1, 2, tiny_data, str(tmp_path))
    for rank in (0, 1):
        for zero in (0, 3):
            seen = json.loads((tmp_path / f"rank{rank}-zero{zero}.json").read_text())
            assert seen == {"final": 6, "skipped": 1}, (rank, zero)
    for zero in (0, 3):
        step_dir = ckpt.find_checkpoint(tmp_path / f"run{zero}")
        assert step_dir.name == "step_00000006"


def _resume_from_different_dirs(rank: int, world: int, data: str, root: str) -> None:
    cfg = _config(data, Path(root) / f"run{rank}")  # as if each node had its own disk
    try:
        train(cfg, resume=True, env=LaunchEnv(rank, world, rank))
    except CheckpointError as exc:
        Path(root, f"rank{rank}.txt").write_text(str(exc))


def test_ranks_that_see_different_checkpoints_refuse_to_resume(
    tiny_data: str, tmp_path: Path
) -> None:
    """Rank 0's run_dir holds a checkpoint, rank 1's does not (no shared filesystem):
    both stop with an error saying which ranks see what, before anything is loaded."""
    train(_config(tiny_data, tmp_path / "run0", steps=2))
    run_ranks(_resume_from_different_dirs, 2, tiny_data, str(tmp_path))
    for rank in (0, 1):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert "do not see the same checkpoint" in text, text
        assert "rank 0 sees" in text and "step_00000002" in text
        assert "rank 1 sees no checkpoint" in text and "shares" in text
