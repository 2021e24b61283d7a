"""Under torchrun: a launch into a run directory a live run holds is refused by its rank 0
(the ranks of one launch share rank 0's lock), the directory is left as it was, and
ptdp's line stays what the user reads last: torchrun's failure summary shows it as the
root cause's `traceback` (TORCHELASTIC_ERROR_FILE), not a pointer to its docs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ptdp.train.run_dir import hold_run_dir
from tests.unit.test_run_dir import LAUNCH_VARS, ROOT, _cli, snapshot

pytestmark = pytest.mark.dist


def test_a_refused_launch_ends_with_ptdp_line(tiny_data: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2"]
    lock = hold_run_dir(run, 0)  # this process stands for the live run
    try:
        before = snapshot(run)
        done = subprocess.run(
            [*torchrun, "-m", "ptdp", *_cli(tiny_data, run, "--resume")],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert snapshot(run) == before
    finally:
        lock.release()
    err = done.stderr
    line = (
        f"ptdp train: error: rank 0: train.run_dir {run} is in use by another training "
        f"(process {os.getpid()} on "
    )
    assert done.returncode != 0 and line in err, err[-3000:]
    assert "rank 1: train.run_dir" not in err  # the other rank shares rank 0's lock
    root_cause = err[err.index("Root Cause") :]
    assert f"traceback : {line}" in root_cause, root_cause
    assert "To enable traceback" not in root_cause
