"""Which exceptions are a lost peer (ptdp/train/faults/failures.py)."""

from __future__ import annotations

import torch.distributed as dist

from ptdp.train.faults.failures import is_communication_error

GLOO_ERROR = RuntimeError(
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:1234"
)


def test_communication_errors_are_told_apart() -> None:
    assert is_communication_error(GLOO_ERROR)
    assert is_communication_error(dist.DistBackendError("NCCL watchdog timeout"))
    assert not is_communication_error(RuntimeError("CUDA out of memory"))
    assert not is_communication_error(ValueError("Connection closed"))
