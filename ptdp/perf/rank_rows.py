"""Which pipeline ranks the per-rank tables of `ptdp simulate` show (memory, host memory)."""

from __future__ import annotations


def shown_ranks(n: int, keep: int) -> list[int | None]:
    """The pipeline ranks a per-rank table shows: all of up to 8; of a longer pipeline the
    first three (most in flight), the last two and `keep` (the limiting one), with None
    where rows are left out."""
    shown = sorted({*range(3), n - 2, n - 1, keep}) if n > 8 else list(range(n))
    out: list[int | None] = []
    for before, r in zip([-1, *shown], shown):
        out += [None, r] if r > before + 1 else [r]
    return out
