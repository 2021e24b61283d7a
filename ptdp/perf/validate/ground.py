"""Fit of a device's GEMM efficiency curve and fused-attention efficiency to published
training runs (`ptdp.perf.validate.published`), for GPUs that `ptdp calibrate` has not measured.

Three parameters for all rows, not one per row: the GEMM law
    efficiency(F) = e_max * F / (F + F_half)
(a GEMM of F FLOPs pays a fixed cost worth F_half FLOPs at the full rate: launch, tile
quantisation, the pipeline's fill and drain, so large GEMMs approach e_max), written into
the hardware file as the `gemm_curve_*` knots `ptdp calibrate` would measure, and the fused
attention kernel's efficiency. Links keep their datasheet bandwidths and NCCL's
efficiencies: the published runs overlap their communication, so their times say little
about it. The fit minimises the root mean square of the relative errors of the predicted
model TFLOP/s per GPU, by a pattern search (no scipy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ptdp.perf.cost.hardware import System
from ptdp.perf.validate.published import McoreRow, row_error

KNOT_EXPONENTS: tuple[float, ...] = tuple(8 + 0.5 * i for i in range(11))
"""log10 FLOPs of the curve's knots: 1e8 to 1e13."""


@dataclass(frozen=True)
class GemmLaw:
    """efficiency(F) = e_max F / (F + F_half), and the fused attention's efficiency."""

    e_max: float
    f_half: float
    attention: float

    def efficiency(self, flops: float) -> float:
        return self.e_max * flops / (flops + self.f_half)

    def knots(self) -> tuple[tuple[float, float], ...]:
        """(FLOPs, efficiency) at `KNOT_EXPONENTS`, as a hardware file stores the curve."""
        sizes = [float(f"{10.0**x:.3g}") for x in KNOT_EXPONENTS]  # as the file prints them
        return tuple((size, round(self.efficiency(size), 4)) for size in sizes)

    def apply(self, system: System) -> System:
        """`system` with this curve and attention efficiency in place of its constants."""
        device = replace(
            system.device,
            gemm_curve=self.knots(),
            gemm_efficiency=self.e_max,
            attention_efficiency=self.attention,
        )
        return replace(system, device=device)


@dataclass(frozen=True)
class GroundFit:
    law: GemmLaw
    errors: tuple[float, ...]
    """Per row: predicted / published - 1."""
    evaluations: int

    @property
    def rms(self) -> float:
        return math.sqrt(sum(e * e for e in self.errors) / len(self.errors))


def row_errors(law: GemmLaw, rows: Sequence[McoreRow], system: System) -> tuple[float, ...]:
    fitted = law.apply(system)
    return tuple(row_error(row, fitted) for row in rows)


def fit_gemm_law(
    rows: Sequence[McoreRow],
    system: System,
    start: GemmLaw = GemmLaw(0.65, 3e10, 0.3),
    progress: Callable[[GemmLaw, float], None] | None = None,
    tolerance: float = 4e-3,
) -> GroundFit:
    """Pattern search over (e_max, log10 F_half, attention), halving the steps when no
    move lowers the RMS relative error, until each step is below `tolerance` of its
    parameter's upper bound."""
    point = [start.e_max, math.log10(start.f_half), start.attention]
    steps = [0.05, 0.5, 0.1]
    bounds = [(0.3, 1.0), (6.0, 12.0), (0.1, 1.0)]
    count = 0

    def cost(p: list[float]) -> float:
        nonlocal count
        count += 1
        law = GemmLaw(p[0], 10.0 ** p[1], p[2])
        errors = row_errors(law, rows, system)
        value = math.sqrt(sum(e * e for e in errors) / len(errors))
        if progress:
            progress(law, value)
        return value

    best = cost(point)
    while max(s / b[1] for s, b in zip(steps, bounds)) > tolerance:
        moved = False
        for i in range(3):
            for sign in (1, -1):
                trial = list(point)
                lo, hi = bounds[i]
                trial[i] = min(hi, max(lo, point[i] + sign * steps[i]))
                if trial[i] == point[i]:
                    continue
                value = cost(trial)
                if value < best:
                    point, best, moved = trial, value, True
                    break
        if not moved:
            steps = [s / 2 for s in steps]
    law = GemmLaw(round(point[0], 4), float(f"{10.0 ** point[1]:.3g}"), round(point[2], 4))
    return GroundFit(law, row_errors(law, rows, system), count)
