"""The doc tests' warm `ptdp` (tests/docs/warm.py) behaves as the installed one: the same
output and exit status, the caller's working directory and environment, and a signal sent
to it reaches the command."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.pages import ROOT, page_env

pytestmark = pytest.mark.skipif(
    os.environ.get("PTDP_DOC_TESTS_COLD") == "1", reason="PTDP_DOC_TESTS_COLD=1: no warm server"
)

BAD_TRAIN = ["train", "--config", "configs/demo.toml", "--parallel.tp", "3"]


def _ptdp(bin_dir: Path, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(bin_dir / "ptdp"), *args], cwd=cwd, env=page_env() | env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip


def test_warm_commands_print_and_exit_as_cold_ones(warm_bin: Path, tmp_path: Path) -> None:
    cold_bin = Path(sys.executable).parent
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    cases = [
        ["schedule", "--schedule", "zb-h1", "--pp", "2", "--microbatches", "4"],
        [*BAD_TRAIN, "--train.run_dir", "runs/bad"],
        ["--bogus"],
    ]
    codes = set()
    for args in cases:
        warm, cold = _ptdp(warm_bin, args, tmp_path), _ptdp(cold_bin, args, tmp_path)
        assert (warm.returncode, warm.stdout, warm.stderr) == (
            cold.returncode, cold.stdout, cold.stderr
        ), args  # fmt: skip
        codes.add(warm.returncode)
    assert codes == {0, 2}  # the cases hold a success and a refusal


def test_warm_command_takes_the_callers_cwd_and_environment(
    warm_bin: Path, tmp_path: Path, demo_files: Path
) -> None:
    # A config and data only the caller's cwd holds are found; a launch variable only the
    # caller set is seen (and refused as a launch that is not torchrun's), as by the
    # installed ptdp.
    shutil.copytree(demo_files, tmp_path, dirs_exist_ok=True)
    shutil.copy(ROOT / "configs/demo.toml", tmp_path / "mine.toml")
    args = ["train", "--config", "mine.toml", "--dry-run", "--model.seq_length", "64"]
    done = _ptdp(warm_bin, args, tmp_path)
    assert done.returncode == 0 and "world=1" in done.stdout, done.stderr
    launched = _ptdp(warm_bin, args, tmp_path, WORLD_SIZE="2")
    assert launched.returncode == 2 and "WORLD_SIZE=2 is set" in launched.stderr
    cold = _ptdp(Path(sys.executable).parent, args, tmp_path, WORLD_SIZE="2")
    assert (cold.returncode, cold.stderr) == (launched.returncode, launched.stderr)


def test_a_signal_to_the_client_reaches_the_command(
    warm_bin: Path,
    tmp_path: Path,
    demo_files: Path,
) -> None:
    """SIGTERM to the client is forwarded: the training saves and exits 143 as it would, and
    the client exits with it (without forwarding it would wait for 100,000 steps)."""
    shutil.copytree(demo_files, tmp_path, dirs_exist_ok=True)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    args = [
        "train", "--config", "configs/demo.toml", "--train.run_dir", "runs/sig",
        "--train.steps", "100000", "--train.log_interval", "1", "--train.eval_interval", "0",
        "--model.num_layers", "2", "--model.hidden_size", "64", "--model.seq_length", "64",
    ]  # fmt: skip
    proc = subprocess.Popen(
        [str(warm_bin / "ptdp"), *args], cwd=tmp_path, env=page_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step"):
            break
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=120) == 143, out
    assert "interrupted by SIGTERM" in out and (tmp_path / "runs/sig/checkpoints/latest").exists()
