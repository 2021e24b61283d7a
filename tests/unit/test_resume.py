"""Continuing a run in one process (issue 21): the resume decision under a launcher restart,
its record in events.jsonl, on_nan = stop saving the last good step, an unpublished save
taken when every rank recorded it, and a new world refused when it cannot hold tp*pp."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ptdp import checkpoint as ckpt
from ptdp.checkpoint.recover import (
    find_unpublished,
    incomplete,
    publish_unpublished,
    verify_unpublished,
)
from ptdp.config.enums import Resume
from ptdp.errors import CheckpointError, ConfigError
from ptdp.parallel.env import LaunchEnv
from ptdp.train.faults.events import previous_ending, read_events
from ptdp.train.faults.numerical import TrainingError
from ptdp.train.resume import wants_resume
from ptdp.train.run import train
from ptdp.train.step import optim
from ptdp.train.step.trainer import Trainer
from tests.helpers import tiny_config

ONE = LaunchEnv(rank=0, world_size=1, local_rank=0)


def _config(data: str, run_dir: Path, **train_):
    return tiny_config(
        data, run_dir, train={"save_interval": 2, **train_}, optim={"decay_steps": 6}
    )


def _raise_at(monkeypatch, step: int) -> None:
    original = Trainer.forward_backward

    def forward_backward(self):
        if self.step + 1 == step:
            raise RuntimeError(f"injected fault at step {step}")
        return original(self)

    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)


@pytest.mark.parametrize(
    ("mode", "explicit", "restart", "requeue", "resumes"),
    [
        (Resume.AUTO, False, 0, 0, False),  # a first launch: today's meaning
        (Resume.AUTO, True, 0, 0, True),  # --resume
        (Resume.AUTO, False, 1, 0, True),  # torchrun --max-restarts restarted it
        (Resume.AUTO, False, 0, 2, True),  # a SLURM requeue
        (Resume.ALWAYS, False, 0, 0, True),
        (Resume.NEVER, False, 1, 0, False),
        (Resume.NEVER, True, 0, 0, True),  # the command line wins
    ],
)
def test_resume_decision(mode, explicit, restart, requeue, resumes) -> None:
    env = LaunchEnv(0, 1, 0, restart=restart, requeue=requeue)
    assert wants_resume(mode, explicit, env) is resumes


def test_launch_env_reads_the_restart_counts(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    env = LaunchEnv.from_environ()
    assert (env.restart, env.requeue, env.is_restart) == (2, 1, True)
    assert env.restart_text() == "torchrun restart 2, SLURM requeue 1"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    assert not LaunchEnv.from_environ().is_restart


def test_the_previous_ending_is_the_last_after_the_last_resume() -> None:
    fail = {"event": "failure", "rank": 2}
    assert previous_ending([]) is None
    assert previous_ending([fail]) == fail
    assert previous_ending([{"event": "failure", "rank": 1}, fail]) == fail
    assert previous_ending([fail, {"event": "restart"}]) is None


def test_a_restarted_launch_resumes_by_itself_and_records_why(
    tiny_data: str, tmp_path: Path, monkeypatch, capsys
) -> None:
    """Step 4 raises (a checkpoint every 2 steps). The same command again is refused on a
    first launch, resumes from step 2 by itself when torchrun says it restarted it, and
    events.jsonl names the failure and the restart; the losses are those of an
    uninterrupted run, bit for bit."""
    cfg = _config(tiny_data, tmp_path / "run")
    full = train(_config(tiny_data, tmp_path / "full"))
    with monkeypatch.context() as m:
        _raise_at(m, 4)
        with pytest.raises(RuntimeError, match="injected"):
            train(cfg)
    failure = [e for e in read_events(tmp_path / "run") if e["event"] != "checkpoint"][-1]
    assert failure["event"] == "failure" and failure["rank"] == 0 and failure["step"] == 4
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        train(cfg, env=ONE)  # a first launch: today's meaning
    never = tiny_config(tiny_data, tmp_path / "run", train={"resume": "never"})
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        train(never, env=LaunchEnv(0, 1, 0, restart=1))
    capsys.readouterr()
    resumed = train(cfg, env=LaunchEnv(0, 1, 0, restart=1))
    assert resumed.start_step == 2
    assert {s: resumed.losses[s] for s in range(3, 7)} == {s: full.losses[s] for s in range(3, 7)}
    record = [e for e in read_events(tmp_path / "run") if e["event"] != "checkpoint"][-1]
    assert record["event"] == "restart" and record["launch"] == "torchrun restart 1"
    assert record["failed_rank"] == 0 and "RuntimeError: injected fault" in record["cause"]
    assert record["fault_step"] == 4 and record["step"] == 2 and record["steps_lost"] == 1
    assert 0 < record["detection_s"] + 0.001 and record["detection_s"] < 5
    assert record["fault_to_first_step_s"] > record["start_to_first_step_s"] > 0
    assert record["checkpoint"].endswith("step_00000002")
    out = capsys.readouterr().out
    assert "restart (torchrun restart 1): rank 0 failed (RuntimeError: injected" in out
    assert "1 completed step lost; first step" in out


@pytest.mark.parametrize("kernel", ["foreach", "fused"])
def test_nan_stop_saves_the_last_good_step(
    tiny_data: str, tmp_path: Path, monkeypatch, kernel: str
) -> None:
    """A NaN loss at step 4 with no checkpoint due: step 3 is saved (the bad update not
    applied), equal bit for bit to step 3 of a run without the fault, and --resume from it
    continues as that run."""
    monkeypatch.setattr(optim, "adamw_kernel", lambda params: {kernel: True})
    full = train(_config(tiny_data, tmp_path / "full", save_interval=3, keep_checkpoints=0))
    original = Trainer.forward_backward

    def forward_backward(self):
        loss = original(self)
        return loss * float("nan") if self.step + 1 == 4 else loss

    with monkeypatch.context() as m:
        m.setattr(Trainer, "forward_backward", forward_backward)
        with pytest.raises(TrainingError, match=r"at step 4.*saved the last good step 3"):
            train(_config(tiny_data, tmp_path / "run", save_interval=0))
    step_dir = ckpt.find_checkpoint(tmp_path / "run")
    assert step_dir.name == "step_00000003"
    saved = ckpt.load_checkpoint(step_dir)
    reference = ckpt.load_checkpoint(tmp_path / "full" / "checkpoints" / "step_00000003")
    assert saved["step"] == 3
    # The fused kernel's step sets the bad step's learning rate before it is dropped; every
    # update sets it again from the step number, so it is not state.
    for groups in (saved["optimizer"]["param_groups"], reference["optimizer"]["param_groups"]):
        for group in groups:
            group.pop("lr")
    for part in ("model", "optimizer"):
        _assert_equal(saved[part], reference[part], part)
    resumed = train(_config(tiny_data, tmp_path / "run", save_interval=0), resume=True)
    assert resumed.start_step == 3
    assert {s: resumed.losses[s] for s in (4, 5, 6)} == {s: full.losses[s] for s in (4, 5, 6)}


def _assert_equal(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}/{key}")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_an_unpublished_save_is_taken_only_when_whole(tiny_data: str, tmp_path: Path) -> None:
    """A save written but never published (its run failed before finish) is found from its
    records and sizes, checked against its checksums, and published as step_X."""
    cfg = tiny_config(tiny_data, tmp_path)
    state = {"model/w": torch.arange(12.0), "step": 5}
    ckpt.start_checkpoint(tmp_path, 5, state, cfg, None)  # never finished
    root = tmp_path / "checkpoints"
    tmp = root / "step_00000005.tmp"
    assert find_unpublished(tmp_path) == (tmp, []) and verify_unpublished(tmp) == []
    spare = tmp_path / "spare"
    shutil.copytree(tmp, spare)
    record = tmp / "written.rank0.json"
    kept = record.read_text()
    record.unlink()  # as if rank 0 had not finished writing it
    assert find_unpublished(tmp_path)[0] is None
    assert "lacks the record of rank 0" in incomplete(tmp)[0]
    record.write_text(kept.replace('"world": 1', '"world": 2'))  # a second rank never recorded
    assert "lacks the record of rank 1" in find_unpublished(tmp_path)[1][0]
    shutil.rmtree(tmp)
    shutil.copytree(spare, tmp)
    shard = next(tmp.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))  # same size: only the checksum tells
    assert find_unpublished(tmp_path)[0] == tmp
    assert "differs from the checksum" in verify_unpublished(tmp)[0]
    shutil.rmtree(tmp)
    shutil.copytree(spare, tmp)
    final = publish_unpublished(tmp)
    assert final == root / "step_00000005" and ckpt.find_checkpoint(tmp_path) == final
    assert not list(final.glob("written.*"))
    assert json.loads((final / "checksums.json").read_text()).keys() == {shard.name}
    assert ckpt.load_checkpoint(final)["step"] == 5


@pytest.mark.parametrize(
    ("parallel", "world", "message"),
    [
        ({"tp": 2}, 3, r"3 is not a multiple of 2; a restart may change"),
        ({"dp": 4}, 2, r"parallel.dp = 4 is fixed and needs 4; set --parallel.dp 0"),
        ({"cp": 2}, 3, r"tp\*cp\*pp = 1\*2\*1 = 2 processes .* change parallel.tp and par"),
        (
            {"ep": 4},
            2,
            r"parallel.ep \* parallel.etp = 4 \* 1 does not divide the 2 ranks .* "
            r"--parallel.ep 2 \(the",
        ),
    ],
)
def test_a_new_world_that_cannot_hold_the_layout_is_refused(
    tiny_data: str, tmp_path: Path, parallel: dict, world: int, message: str
) -> None:
    """Refused before any process group, naming the checkpoint and the fix."""
    train(tiny_config(tiny_data, tmp_path, train={"steps": 1}))
    cfg = tiny_config(tiny_data, tmp_path, train={"steps": 2}, parallel=parallel)
    with pytest.raises(ConfigError, match=message) as caught:
        train(cfg, resume=True, env=LaunchEnv(rank=0, world_size=world, local_rank=0))
    assert "cannot resume" in str(caught.value) and "step_00000001" in str(caught.value)


def test_a_requeue_after_sigterm_resumes_and_loses_nothing(
    tiny_data: str, tmp_path: Path, monkeypatch
) -> None:
    """A scheduler's SIGTERM in step 3: the step is saved and recorded as `interrupted`;
    the requeued job (SLURM_RESTART_COUNT = 1) resumes by itself with no step lost."""
    from tests.unit.test_faults import _signal_during

    cfg = _config(tiny_data, tmp_path / "run")
    with monkeypatch.context() as m:
        _signal_during(m, 3)
        assert train(cfg).interrupted
    stop = [e for e in read_events(tmp_path / "run") if e["event"] != "checkpoint"][-1]
    assert (stop["event"], stop["signal"], stop["step"]) == ("interrupted", "SIGTERM", 3)
    resumed = train(cfg, env=LaunchEnv(0, 1, 0, requeue=1))
    assert resumed.start_step == 3 and resumed.final_step == 6
    record = [e for e in read_events(tmp_path / "run") if e["event"] != "checkpoint"][-1]
    assert record["event"] == "restart" and record["launch"] == "SLURM requeue 1"
    assert record["cause"] == "interrupted by SIGTERM" and record["failed_rank"] is None
    assert record["steps_lost"] == 0


def test_a_restart_continues_from_the_checkpoint_before_a_damaged_latest(
    tiny_data: str, tmp_path: Path, monkeypatch, capsys
) -> None:
    """Step 5 raises after step 4's checkpoint, whose shard is then cut short: --resume
    refuses it naming the file, as before; a launcher restart (no person to choose)
    continues from step 2, says why and records the skipped checkpoint; its losses are
    those of an uninterrupted run, bit for bit."""
    cfg = _config(tiny_data, tmp_path / "run")
    full = train(_config(tiny_data, tmp_path / "full"))
    with monkeypatch.context() as m:
        _raise_at(m, 5)
        with pytest.raises(RuntimeError, match="injected"):
            train(cfg)
    shard = next((tmp_path / "run/checkpoints/step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{shard} is truncated"):
        train(cfg, resume=True)
    capsys.readouterr()
    resumed = train(cfg, env=LaunchEnv(0, 1, 0, restart=1))
    assert resumed.start_step == 2
    assert {s: resumed.losses[s] for s in range(3, 7)} == {s: full.losses[s] for s in range(3, 7)}
    out = capsys.readouterr().out
    assert "the latest checkpoint is damaged: continuing from step_00000002 instead" in out
    record = [e for e in read_events(tmp_path / "run") if e["event"] != "checkpoint"][-1]
    assert record["event"] == "restart" and record["step"] == 2 and record["steps_lost"] == 2
    assert f"{shard} is truncated (100 of" in record["skipped"][0]
