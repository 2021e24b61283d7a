"""Weighted blends of datasets: which dataset, and which of its samples, global sample k reads.

``data.paths`` names the datasets in Megatron-LM's spelling, weights and prefixes alternating
(``["0.7", "a/prefix", "0.3", "b/prefix"]``). The weights are normalised and made integer
shares q_i of a period Q = sum(q_i) (exact for weights that are ratios of small integers, such
as 0.7 : 0.3 -> 7 : 3; otherwise to 1/65536). Within a period, sample r goes to the dataset
furthest below its target count, ``argmax_i q_i (r + 1) / Q - c_i`` (Megatron's greedy by
error, in exact integers; ties to the first dataset), so after any number of samples each
dataset's count is within one sample of its share. Periods repeat, so sample k is found in
O(1) from k alone: the blend depends on the weights and k, never on the run's length, the
data-parallel layout or the microbatching, and a resumed run needs only the samples consumed.
Each dataset keeps its own epochs and per-epoch shuffle (``GPTDataset``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from ptdp.data.dataset import stack_samples
from ptdp.errors import ConfigError

RESOLUTION = 1 << 16
"""Period used when the weights are no ratio of integers up to ``MAX_EXACT``."""
MAX_EXACT = 1000
EXAMPLE = '["0.7", "a/prefix", "0.3", "b/prefix"]'


def parse_blend(paths: Sequence[str]) -> list[tuple[float, str]]:
    """``data.paths`` as (normalised weight, prefix) pairs; one prefix alone has weight 1."""
    if len(paths) == 1:
        return [(1.0, paths[0])]
    if len(paths) % 2:
        raise ConfigError(
            f"data.paths has {len(paths)} entries; it alternates weights and prefixes, e.g. "
            f"{EXAMPLE}"
        )
    pairs = []
    for i in range(0, len(paths), 2):
        text, prefix = paths[i], paths[i + 1]
        try:
            weight = float(text)
        except ValueError:
            raise ConfigError(
                f"data.paths[{i}] = {text!r} is not a weight; data.paths alternates weights and "
                f"prefixes, e.g. {EXAMPLE}"
            ) from None
        if not (math.isfinite(weight) and weight > 0):
            raise ConfigError(
                f"data.paths[{i}] = {text!r}: the weight of '{prefix}' must be a positive "
                f"number; drop the dataset instead of giving it weight 0"
            )
        pairs.append((weight, prefix))
    prefixes = [p for _, p in pairs]
    repeated = sorted({p for p in prefixes if prefixes.count(p) > 1})
    if repeated:
        raise ConfigError(
            f"data.paths names '{repeated[0]}' more than once; give each dataset once, with "
            f"the sum of its weights"
        )
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def integer_shares(weights: Sequence[float]) -> list[int]:
    """Integer shares proportional to ``weights``: the smallest exact ones when the weights
    are ratios of integers up to ``MAX_EXACT``, else shares of ``RESOLUTION`` (largest
    remainders), divided by their common divisor."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    for period in range(1, MAX_EXACT + 1):
        scaled = w * period
        if np.all(np.abs(scaled - np.round(scaled)) < 1e-9 * period) and np.all(scaled >= 0.5):
            shares = [int(x) for x in np.round(scaled)]
            break
    else:
        scaled = w * RESOLUTION
        shares = [int(x) for x in np.floor(scaled)]
        for i in np.argsort(-(scaled - np.floor(scaled)), kind="stable")[
            : RESOLUTION - sum(shares)
        ]:
            shares[int(i)] += 1
    if min(shares) == 0:
        i = shares.index(0)
        raise ConfigError(
            f"data.paths: weight {weights[i]} is below 1/{RESOLUTION} of the total; raise it "
            "or drop that dataset"
        )
    gcd = math.gcd(*shares)
    return [s // gcd for s in shares]


class BlendSchedule:
    """Global sample index <-> (dataset, sample within it), periodic with period ``sum(shares)``."""

    def __init__(self, weights: Sequence[float]) -> None:
        self.shares = integer_shares(weights)
        self.period = period = sum(self.shares)
        counts = [0] * len(self.shares)
        dataset = np.empty(period, dtype=np.int32)
        rank = np.empty(period, dtype=np.int64)
        for r in range(period):
            # Error of dataset i after r + 1 samples, times the period: exact integers.
            i = max(range(len(counts)), key=lambda i: self.shares[i] * (r + 1) - counts[i] * period)
            dataset[r], rank[r] = i, counts[i]
            counts[i] += 1
        assert counts == self.shares, "greedy blend drifted from its shares"
        self._dataset, self._rank = dataset, rank
        # Where in the period dataset i's j-th sample of the period falls.
        self._position = [np.flatnonzero(dataset == i) for i in range(len(self.shares))]

    def locate(self, k: int) -> tuple[int, int]:
        """(dataset, index of its sample) that global sample ``k`` reads."""
        if k < 0:
            raise IndexError(f"sample index {k} is negative")
        p, r = divmod(k, self.period)
        i = int(self._dataset[r])
        return i, p * self.shares[i] + int(self._rank[r])

    def position(self, i: int, n: int) -> int:
        """Global sample index at which dataset ``i``'s sample ``n`` is read."""
        p, j = divmod(n, self.shares[i])
        return p * self.period + int(self._position[i][j])


class Samples(Protocol):
    """What a blend needs of each dataset (``GPTDataset`` is one)."""

    seq_length: int

    def __len__(self) -> int: ...

    def sample(self, k: int) -> np.ndarray: ...

    def documents(self, k: int) -> np.ndarray: ...


class BlendedDataset:
    """Samples of several datasets in proportion to their weights (see the module docstring).

    Its length is the number of samples before any dataset starts a second epoch; past it the
    blend goes on, each dataset reshuffled for its next epoch.
    """

    def __init__(self, datasets: Sequence[Samples], weights: Sequence[float]) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.schedule = BlendSchedule(weights)
        self.seq_length = datasets[0].seq_length
        self.num_samples = min(self.schedule.position(i, len(d)) for i, d in enumerate(datasets))

    def __len__(self) -> int:
        return self.num_samples

    def source(self, k: int) -> tuple[int, int]:
        """(dataset, index of its sample) that global sample ``k`` reads."""
        return self.schedule.locate(k)

    def sample(self, k: int) -> np.ndarray:
        """Global sample ``k`` as int64[s + 1]."""
        i, n = self.schedule.locate(k)
        return self.datasets[i].sample(n)

    def documents(self, k: int) -> np.ndarray:
        """int64[s]: the document of each input token of global sample ``k``."""
        i, n = self.schedule.locate(k)
        return self.datasets[i].documents(n)

    def batch(self, start: int, count: int) -> torch.Tensor:
        """Samples ``start .. start + count - 1`` as a LongTensor [count, s + 1]."""
        return stack_samples(self.sample, start, count, self.seq_length + 1)

    def document_batch(self, start: int, count: int) -> torch.Tensor:
        """Their ``documents`` as a LongTensor [count, s]."""
        return stack_samples(self.documents, start, count, self.seq_length)
