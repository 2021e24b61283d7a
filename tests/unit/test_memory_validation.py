"""The CPU peak-memory benchmark at its tiny sizes: its counter, and the memory model
against it (benchmarks/memory/memory_validation.py; the full table is in BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.memory import memory_validation as bench  # spawned ranks import the worker by name


def test_live_bytes_counts_new_storages_until_freed() -> None:
    a = torch.ones(1000)
    with bench.LiveBytes() as meter:
        b = a * 2  # 4000 bytes
        c = b.view(10, 100)  # a view allocates nothing
        a.add_(1)  # in place: nothing; a existed before and is never counted
        d = c + 1  # 4000 more: the peak
        del b, c, d
    assert (meter.peak, meter.live) == (8000, 0)


def test_tiny_cases_within_five_percent(tmp_path: Path) -> None:
    # One process and two pipeline ranks (interleaved): each rank's measured step peak
    # against the model's activations + working + stash, gloo's held sends included.
    rows = bench.run(list(bench.TINY), str(tmp_path))
    assert [len(r["ranks"]) for r in rows] == [1, 2]
    for row in rows:
        for rank in row["ranks"]:
            assert rank["measured_mib"] > 0
        assert abs(bench.error(row)) < 0.05, row
