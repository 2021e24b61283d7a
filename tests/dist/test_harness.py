"""The multi-process harness itself: collectives work, errors and hangs name the rank."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import RankError, run_ranks

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
