"""`srun ptdp train` without torchrun, on one machine: two processes started as srun starts
its tasks (only SLURM's variables set: no RANK, WORLD_SIZE, MASTER_ADDR or MASTER_PORT)
meet at the store rank 0 hosts on the node list's first host, at the port derived from the
job id, and train pp=2 to the same losses and weights as one process."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ptdp.parallel.slurm import port_for_job
from ptdp.train.run import train
from tests.helpers import assert_same_run, tiny_config

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
STEPS = {"micro_batch_size": 2, "global_batch_size": 8, "steps": 4}


def _free_job_id() -> int:
    """A job id whose derived port nothing on this machine holds now."""
    start = random.randrange(1, 1_000_000)
    for job in range(start, start + 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port_for_job(job)))
            except OSError:
                continue
            return job
    raise RuntimeError("no free port in 200 job ids")


def test_srun_alone_matches_one_process(tiny_data: str, tmp_path: Path) -> None:
    single = train(tiny_config(tiny_data, tmp_path / "single", optim={"eps": 1e-6}, train=STEPS))
    run_dir = tmp_path / "srun"
    args = [
        "--data.path", tiny_data, "--model.num_layers", "2", "--model.hidden_size", "32",
        "--model.num_heads", "4", "--model.seq_length", "32", "--data.valid_fraction", "0.1",
        "--optim.lr", "3e-3", "--optim.min_lr", "3e-4", "--optim.warmup_steps", "2",
        "--optim.eps", "1e-6", "--train.micro_batch_size", "2",
        "--train.global_batch_size", "8", "--train.steps", "4", "--train.log_interval", "1",
        "--train.eval_interval", "0", "--train.device", "cpu", "--train.progress", "false",
        "--train.run_dir", str(run_dir), "--parallel.pp", "2",
    ]  # fmt: skip
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "TORCHELASTIC"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        base.pop(name, None)
    base |= {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "PATH": os.path.dirname(sys.executable),
    }
    slurm = {  # what srun sets: the first host resolves here, the others need not exist
        "SLURM_NTASKS": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": str(_free_job_id()),
        "SLURM_JOB_NODELIST": "localhost,node[01-03]",
    }  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ptdp", "train", *args],
            env=base | slurm | {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    report = "\n".join(f"--- task {r}:\n{out}" for r, out in enumerate(outputs))
    assert [p.returncode for p in procs] == [0, 0], report
    assert "world=2 tp=1 pp=2 dp=1" in outputs[0], report
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4]
    assert_same_run(tmp_path / "single", run_dir, single.losses, losses)
