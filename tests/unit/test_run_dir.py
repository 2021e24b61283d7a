"""One run per run directory: a live run's lock refuses a second training into it, and a new
run never writes over a previous run's files; each refusal leaves every file of the
directory byte for byte as it was (ptdp/train/run_dir.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from ptdp import checkpoint as ckpt
from ptdp.cli import main
from ptdp.errors import CheckpointError, ConfigError, PtdpError
from ptdp.parallel.env import LaunchEnv
from ptdp.train.run import train
from ptdp.train.run_dir import LOCK_FILE
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[2]
ONE = LaunchEnv(rank=0, world_size=1, local_rank=0)
LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID")


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file and folder under `root` with its bytes (None for a folder)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def _cli(data: str, run: Path, *extra: str) -> list[str]:
    cfg = {
        "data.path": data, "data.valid_fraction": "0.1", "train.run_dir": str(run),
        "model.num_layers": "2", "model.hidden_size": "32", "model.num_heads": "4",
        "model.seq_length": "32", "train.micro_batch_size": "4", "train.global_batch_size": "8",
        "train.log_interval": "1", "train.eval_interval": "0", "train.progress": "false",
        "train.device": "cpu",
    }  # fmt: skip
    return ["train", *(t for k, v in cfg.items() for t in (f"--{k}", v)), *extra]


def _wait_for(path: Path, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 300  # a guard against a hang, not a measured time
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the first training ended ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} from the first training")
        time.sleep(0.2)


def test_a_live_run_holds_its_directory(
    tiny_data: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two concurrent trainings into one directory: every way the second could start (new,
    --resume, train.overwrite) is refused naming the first's process, and the first's files
    are byte-identical afterwards; once the first dies (SIGKILL) nothing stale is left."""
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [sys.executable, "-m", "ptdp", *_cli(tiny_data, run, "--train.steps", "1000000",
                                            "--train.save_interval", "2")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_for(run / "checkpoints" / ckpt.LATEST, first, "checkpoint")
        os.kill(first.pid, signal.SIGSTOP)  # its files hold still while the second tries
        before = snapshot(run)
        assert LOCK_FILE in before and "metrics.jsonl" in before
        attempts = {
            "new": lambda: train(tiny_config(tiny_data, run), env=ONE),
            "resume": lambda: train(tiny_config(tiny_data, run), resume=True, env=ONE),
            "overwrite": lambda: train(
                tiny_config(tiny_data, run, train={"overwrite": True}), env=ONE
            ),
        }
        for name, attempt in attempts.items():
            with pytest.raises(ConfigError) as info:
                attempt()
            text = str(info.value)
            assert f"process {first.pid} on " in text, (name, text)
            assert str(run / LOCK_FILE) in text and "--train.run_dir" in text, (name, text)
            assert snapshot(run) == before, name
        assert main(_cli(tiny_data, run, "--resume")) == 2
        err = capsys.readouterr().err
        assert err.startswith("ptdp train: error: train.run_dir") and f"{first.pid}" in err
        assert snapshot(run) == before and not dist.is_initialized()
    finally:
        os.kill(first.pid, signal.SIGKILL)  # a crash: the kernel drops its lock
        os.kill(first.pid, signal.SIGCONT)
        first.wait()
    assert (run / LOCK_FILE).exists()  # left by the crash, and harmless:
    latest = int((run / "checkpoints" / ckpt.LATEST).read_text().strip().removeprefix("step_"))
    cfg = tiny_config(tiny_data, run, train={"steps": latest + 1})
    result = train(cfg, resume=True, env=ONE)
    assert (result.start_step, result.final_step) == (latest, latest + 1)
    assert not (run / LOCK_FILE).exists()  # removed on a clean exit


def _previous_runs(saved: Path, tmp: Path) -> dict[str, Path]:
    """Run directories holding some of a previous run's files, with or without checkpoints."""
    dirs = {}
    for name, keep in {
        "config-only": ["config.toml"],
        "metrics-only": ["metrics.jsonl"],
        "events-only": ["events.jsonl"],
        "tensorboard-only": ["tensorboard"],
        "unpublished-save-only": ["checkpoints"],
        "whole-run": None,
    }.items():
        run = tmp / name
        shutil.copytree(saved, run)
        if keep is not None:
            for path in run.iterdir():
                if path.name not in keep:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        dirs[name] = run
    root = dirs["unpublished-save-only"] / "checkpoints"
    (root / ckpt.LATEST).unlink()
    for step_dir in root.iterdir():
        step_dir.rename(step_dir.with_name(step_dir.name + ".tmp"))
    (dirs["events-only"] / "events.jsonl").write_text('{"event": "failure", "rank": 0}\n')
    return dirs


@pytest.fixture(scope="module")
def saved_run(tiny_data: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("saved") / "run"
    train(tiny_config(tiny_data, run, train={"steps": 2, "tensorboard": True}), env=ONE)
    return run


def test_a_new_run_never_writes_over_a_previous_run(
    tiny_data: str, saved_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --resume, a directory with any of a previous run's files is refused with the
    three fixes and nothing changed; train.overwrite deletes them and starts afresh."""
    for name, run in _previous_runs(saved_run, tmp_path).items():
        before = snapshot(run)
        with pytest.raises(CheckpointError) as info:
            train(tiny_config(tiny_data, run), env=ONE)
        text = str(info.value)
        for fix in ("pass --resume", "another --train.run_dir", "--train.overwrite true"):
            assert fix in text, (name, text)
        assert snapshot(run) == before, name
        assert main(_cli(tiny_data, run)) == 2
        assert f"{run} already holds" in capsys.readouterr().err, name
        assert snapshot(run) == before and not dist.is_initialized(), name
    run = tmp_path / "whole-run"
    old_metrics = (run / "metrics.jsonl").read_bytes()
    init = tiny_config(tiny_data, run, train={"overwrite": True},
                       checkpoint={"init_from": str(run / "checkpoints")})  # fmt: skip
    with pytest.raises(ConfigError, match="which train.overwrite would delete"):
        train(init, env=ONE)
    result = train(tiny_config(tiny_data, run, train={"steps": 1, "overwrite": True}), env=ONE)
    assert (result.start_step, result.final_step) == (0, 1)
    assert "deleted the previous run's config.toml, metrics.jsonl" in capsys.readouterr().out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000001"]
    assert (run / "metrics.jsonl").read_bytes() != old_metrics
    assert not (run / "tensorboard").exists()


def test_resume_of_a_run_without_checkpoint_starts_again(
    tiny_data: str, saved_run: Path, tmp_path: Path
) -> None:
    run = _previous_runs(saved_run, tmp_path)["metrics-only"]
    result = train(tiny_config(tiny_data, run, train={"steps": 1}), resume=True, env=ONE)
    assert (result.start_step, result.final_step) == (0, 1)


def test_other_ranks_share_rank_zero_lock(tiny_data: str, tmp_path: Path) -> None:
    """Rank 0 alone takes the lock: a rank > 0 of the same launch is never refused by it
    (tests/dist run real multi-process trainings into one directory)."""
    from ptdp.train.run_dir import hold_run_dir

    tmp_path.mkdir(exist_ok=True)
    lock = hold_run_dir(tmp_path, 0)
    try:
        assert hold_run_dir(tmp_path, 1) is None
        with pytest.raises(PtdpError, match=f"process {os.getpid()} on"):
            hold_run_dir(tmp_path, 0)
    finally:
        lock.release()
    hold_run_dir(tmp_path, 0).release()
