"""Joining a torchrun launch: read the environment torchrun sets, start the process group."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> LaunchEnv:
        """Rank and world size from torchrun's variables; one process when they are absent."""
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
        )


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        requested = f"cuda:{local_rank}"
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("train.device = cuda but no CUDA device is visible; use cpu")
        torch.cuda.set_device(device)
    return device


def init_process_group(env: LaunchEnv, device: torch.device, timeout_s: float = 300) -> bool:
    """Start the default group (NCCL on GPUs, gloo on CPUs) unless one process or a group
    already exists (a test harness, a notebook). Returns whether this call created it."""
    if env.world_size == 1 or dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return True


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
