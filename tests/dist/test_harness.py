"""The multi-process harness itself: collectives work, errors and hangs name the rank."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import MESH_FAILED, RankError, run_ranks

pytestmark = pytest.mark.dist


def _check_all_reduce(rank: int, world_size: int) -> None:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2
    assert torch.get_num_threads() == 1


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from the test")


def _hang_on_rank_0(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)


def test_collectives_and_errors() -> None:
    run_ranks(_check_all_reduce, 2)
    with pytest.raises(RankError, match=r"rank 1 failed(.|\n)*boom from the test"):
        run_ranks(_fail_on_rank_1, 2)


def test_hang_is_reported() -> None:
    # The error names the limit it enforced (the harness raises it at the deadline).
    with pytest.raises(RankError, match=r"ranks \[0(, 1)?\] still running after 8 s \(hang\?\)"):
        run_ranks(_hang_on_rank_0, 2, timeout_s=8)


def init_process_group(marker: str) -> None:
    """Stands in for torch's: the first spawn's group fails to connect, as gloo's can."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError(f"{MESH_FAILED} with [pair.cc:553] Connection closed by peer")


def _mesh_fails_once(rank: int, world_size: int, marker: str, log: str) -> None:
    if rank == 0:
        init_process_group(marker)
        with open(log, "a") as f:
            f.write("ran\n")


def _mesh_fails_later(rank: int, world_size: int) -> None:
    if rank == 0:
        raise RuntimeError(f"{MESH_FAILED}: a test's own group, not the harness's")


def test_a_group_that_did_not_connect_is_spawned_again(tmp_path) -> None:
    """Only a connect failure inside init_process_group is retried, once; the test's own
    code then runs once."""
    log = tmp_path / "log"
    run_ranks(_mesh_fails_once, 2, str(tmp_path / "marker"), str(log))
    assert log.read_text() == "ran\n"
    with pytest.raises(RankError, match="a test's own group"):
        run_ranks(_mesh_fails_later, 2)
