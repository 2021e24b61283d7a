"""Fits of the performance model's constants to measurements (pure Python, no torch).

Two shapes of law, both read by `ptdp calibrate`:

- A GEMM efficiency curve over size: achieved / peak FLOP/s of each measured GEMM against
  its FLOPs. Larger GEMMs fill more of the machine (more tiles than streaming
  multiprocessors, launch and tail costs spread over more work), so the curve is fitted
  non-decreasing (isotonic least squares, pool-adjacent-violators) and read between its
  knots linearly in log FLOPs, flat beyond them: measurement noise and wave-quantisation
  dips cannot make a bigger GEMM predicted slower per FLOP than a smaller one.
- A message cost t = latency + x / bandwidth, with x the bytes each GPU moves (2 (n-1)/n N
  for an all-reduce of N bytes over n ranks, (n-1)/n N for all-gather and reduce-scatter,
  N for a point-to-point message), fitted by least squares on relative error so that small
  messages (latency) weigh as much as large ones (bandwidth).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def monotone_curve(points: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """The non-decreasing curve closest (least squares) to `points` = (size, value) pairs.

    Returns its knots (size, fitted value), sizes increasing, one knot per measured size
    (repeated sizes are averaged first). Pool-adjacent-violators: sweep left to right,
    merging any block whose mean falls below the previous block's into one mean.
    """
    if not points:
        raise ValueError("no measurements to fit a curve to")
    by_size: dict[float, list[float]] = {}
    for size, value in points:
        if not (size > 0 and math.isfinite(size) and math.isfinite(value)):
            raise ValueError(f"bad measurement (size {size}, value {value})")
        by_size.setdefault(float(size), []).append(float(value))
    sizes = sorted(by_size)
    blocks: list[list[float]] = []  # [sum, weight, first index, last index]
    for i, size in enumerate(sizes):
        values = by_size[size]
        blocks.append([sum(values), float(len(values)), i, i])
        while len(blocks) > 1 and _mean(blocks[-2]) > _mean(blocks[-1]):
            last = blocks.pop()
            blocks[-1][0] += last[0]
            blocks[-1][1] += last[1]
            blocks[-1][3] = last[3]
    fitted = [0.0] * len(sizes)
    for block in blocks:
        for i in range(int(block[2]), int(block[3]) + 1):
            fitted[i] = _mean(block)
    return tuple(zip(sizes, fitted))


def _mean(block: list[float]) -> float:
    return block[0] / block[1]


def interpolate_log(curve: Sequence[tuple[float, float]], size: float) -> float:
    """The curve's value at `size`: linear in log(size) between knots, flat outside them."""
    if size <= curve[0][0]:
        return curve[0][1]
    if size >= curve[-1][0]:
        return curve[-1][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if size <= x1:
            w = math.log(size / x0) / math.log(x1 / x0)
            return y0 + w * (y1 - y0)
    return curve[-1][1]  # pragma: no cover - the loop always returns


@dataclass(frozen=True)
class LinkFit:
    """t = latency + x / bandwidth, fitted to (x bytes, t seconds) samples."""

    latency: float
    """Seconds per call."""
    bandwidth: float
    """Bytes/s per GPU (bus bandwidth for collectives)."""
    rms_relative_error: float
    """Root mean square of (fit - measured) / measured over the samples."""
    samples: int

    def seconds(self, x: float) -> float:
        return self.latency + x / self.bandwidth


def fit_latency_bandwidth(samples: Sequence[tuple[float, float]]) -> LinkFit:
    """Least squares on relative error (weights 1/t^2) of t = a + b x; a >= 0, b > 0.

    A negative intercept (noise at small sizes) is clamped to zero and the slope refitted
    through the origin. Raises when the times do not grow with size (no bandwidth to fit).
    """
    pts = [(float(x), float(t)) for x, t in samples if t > 0]
    if len({x for x, _ in pts}) < 2:
        raise ValueError("a latency-bandwidth fit needs times at two or more sizes")
    w = [1.0 / (t * t) for _, t in pts]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, pts))
    sy = sum(wi * t for wi, (_, t) in zip(w, pts))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, pts))
    sxy = sum(wi * x * t for wi, (x, t) in zip(w, pts))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det
    intercept = (sy - slope * sx) / sw
    if intercept < 0:
        intercept, slope = 0.0, sxy / sxx
    if slope <= 0:
        raise ValueError(
            "measured times do not grow with message size; use larger messages "
            "(drop --quick) or a quieter machine"
        )
    errors = [(intercept + slope * x - t) / t for x, t in pts]
    rms = math.sqrt(sum(e * e for e in errors) / len(errors))
    return LinkFit(intercept, 1.0 / slope, rms, len(pts))


def collective_bytes(op: str, nbytes: float, ranks: int) -> float:
    """Bytes each GPU moves in `op` on a full tensor of `nbytes` (the model's count,
    ptdp/perf/cost/collectives.py; an all-to-all's is what it sends to the other ranks, as
    `ptdp.perf.cost.moe.alltoall_bytes` counts): what the latency-bandwidth fit divides by
    bandwidth."""
    share = (ranks - 1) / ranks
    factor = {"all_reduce": 2 * share, "all_gather": share, "reduce_scatter": share}
    factor |= {"all_to_all": share, "p2p": 1.0}  # all-to-all: the bytes sent to the others
    if op not in factor:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(factor)}")
    return factor[op] * nbytes
