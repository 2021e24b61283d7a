"""Timed rounds of several trainers in the same processes, alternating (ABBA) so that
machine noise hits each alike: what the layout benchmarks on CPU ranks compare."""

from __future__ import annotations

import time

import torch.distributed as dist


def alternating_rounds(trainers: dict, steps: int, rounds: int) -> dict[str, list[float]]:
    """Tokens/s of each trainer (by name) per round of `steps` training steps, after one
    warm-up step each; in every other round the order is reversed, so none goes first
    every time. Collective: every rank calls it with the same trainers."""
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for trainer in trainers.values():  # warm-up
        trainer.train_step()
    for r in range(rounds):
        for name, trainer in list(trainers.items())[:: 1 if r % 2 == 0 else -1]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                trainer.train_step()
            dist.barrier()
            times[name].append((time.perf_counter() - start) / steps)
    return {k: [trainers[k].tokens_per_step / t for t in v] for k, v in times.items()}
