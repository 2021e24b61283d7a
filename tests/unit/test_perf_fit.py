"""Fits behind `ptdp calibrate`: the monotone GEMM curve, latency + bandwidth, and how a
cluster file's curve enters the cost model (and leaves the built-in files as they were)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from ptdp.config.enums import Precision
from ptdp.errors import ConfigError
from ptdp.perf.calibrate.fit import (
    collective_bytes,
    fit_latency_bandwidth,
    interpolate_log,
    monotone_curve,
)
from ptdp.perf.cost.costs import Compute, Gemm
from ptdp.perf.cost.hardware_file import BUILTIN_DIR, list_systems, load_system
from ptdp.perf.cost.software import PTDP


def test_monotone_curve_pools_violators_by_least_squares() -> None:
    pts = [(1.0, 0.1), (2.0, 0.3), (4.0, 0.2), (8.0, 0.5), (16.0, 0.4), (32.0, 0.45)]
    curve = monotone_curve(pts)
    assert [x for x, _ in curve] == [1, 2, 4, 8, 16, 32]
    assert [y for _, y in curve] == pytest.approx([0.1, 0.25, 0.25, 0.45, 0.45, 0.45])
    (x0, y0), (x1, y1) = monotone_curve([(3.0, 0.2), (1.0, 0.1), (3.0, 0.4)])
    assert (x0, y0, x1) == (1.0, 0.1, 3.0) and y1 == pytest.approx(0.3)  # repeats averaged
    increasing = [(2.0**i, i / 10) for i in range(8)]
    assert monotone_curve(increasing) == tuple(increasing)  # nothing to pool
    with pytest.raises(ValueError, match="no measurements"):
        monotone_curve([])


def test_monotone_curve_of_noisy_saturating_efficiency() -> None:
    # A saturating law eff = 0.8 x / (x + 1e9) with 10% multiplicative noise, five repeats.
    rng = random.Random(0)
    sizes = [10.0**e for e in (6, 6.5, 7, 7.5, 8, 8.5, 9, 9.5, 10, 10.5, 11, 12)]
    pts = [(x, 0.8 * x / (x + 1e9) * rng.uniform(0.9, 1.1)) for x in sizes for _ in range(5)]
    curve = monotone_curve(pts)
    values = [y for _, y in curve]
    assert [x for x, _ in curve] == sizes
    assert all(a <= b for a, b in zip(values, values[1:]))
    # The least-squares fit keeps the measurements' mean and stays close to the law.
    assert sum(values) * 5 == pytest.approx(sum(y for _, y in pts))
    for x, y in curve:
        assert y == pytest.approx(0.8 * x / (x + 1e9), rel=0.12)
    grid = [10.0 ** (6 + k / 20) for k in range(121)]
    read = [interpolate_log(curve, x) for x in grid]
    assert all(a <= b for a, b in zip(read, read[1:]))  # monotone between the knots too


def test_interpolation_is_log_linear_and_flat_outside() -> None:
    curve = ((1e6, 0.2), (1e8, 0.6))
    assert interpolate_log(curve, 1e6) == 0.2 and interpolate_log(curve, 1e8) == 0.6
    assert interpolate_log(curve, 1e7) == pytest.approx(0.4)  # halfway in log size
    assert interpolate_log(curve, 1e3) == 0.2 and interpolate_log(curve, 1e12) == 0.6


def test_latency_bandwidth_fit_recovers_the_law() -> None:
    rng = random.Random(1)
    latency, bandwidth = 20e-6, 5e9
    xs = [4096 * 4**i for i in range(8)]
    exact = fit_latency_bandwidth([(x, latency + x / bandwidth) for x in xs])
    assert exact.latency == pytest.approx(latency, rel=1e-9)
    assert exact.bandwidth == pytest.approx(bandwidth, rel=1e-9)
    assert exact.rms_relative_error == pytest.approx(0, abs=1e-12)
    noisy = fit_latency_bandwidth(
        [(x, (latency + x / bandwidth) * rng.uniform(0.95, 1.05)) for x in xs for _ in range(3)]
    )
    assert noisy.latency == pytest.approx(latency, rel=0.15)
    assert noisy.bandwidth == pytest.approx(bandwidth, rel=0.1)
    assert 0 < noisy.rms_relative_error < 0.05 and noisy.samples == 24


def test_latency_bandwidth_fit_clamps_and_refuses() -> None:
    # Times below a line through the origin at small sizes: no negative latency.
    fit = fit_latency_bandwidth([(1e3, 0.5e-6), (1e6, 1e-3), (1e7, 1e-2)])
    assert fit.latency == 0.0
    assert 1e9 < fit.bandwidth < 2e9  # between the points' own rates, x / t
    with pytest.raises(ValueError, match="do not grow"):
        fit_latency_bandwidth([(1e3, 2e-3), (1e6, 1e-3)])
    with pytest.raises(ValueError, match="two or more sizes"):
        fit_latency_bandwidth([(1e3, 2e-3), (1e3, 1e-3)])


def test_bytes_each_rank_moves() -> None:
    assert collective_bytes("all_reduce", 800, 4) == 1200  # 2 (n-1)/n N
    assert collective_bytes("all_gather", 800, 4) == collective_bytes("reduce_scatter", 800, 4)
    assert collective_bytes("reduce_scatter", 800, 4) == 600
    assert collective_bytes("p2p", 800, 2) == 800
    assert collective_bytes("all_to_all", 800, 4) == 600  # what a rank sends to the others
    with pytest.raises(ValueError, match="broadcast"):
        collective_bytes("broadcast", 1, 2)


def _with_curve(tmp_path: Path, flops: str, eff: str, extra: str = "") -> Path:
    text = (BUILTIN_DIR / "a100-80gb.toml").read_text()
    marker = "[device.achieved]\n"
    curve = f"gemm_curve_flops = {flops}\ngemm_curve_efficiency = {eff}\n{extra}"
    path = tmp_path / "curved.toml"
    path.write_text(text.replace(marker, marker + curve))
    return path


def test_a_curve_in_the_file_drives_gemm_and_attention_costs(tmp_path: Path) -> None:
    path = _with_curve(
        tmp_path,
        "[1e9, 1e12]",
        "[0.3, 0.9]",
        "attention_efficiency = 0.5\nattention_backward_ratio = 3.0\n",
    )
    system = load_system(path)
    c = Compute(system, Precision.BF16, PTDP)
    for g in (Gemm(1024, 1024, 64), Gemm(4096, 4096, 4096), Gemm(65536, 8192, 8192)):
        eff = min(0.9, max(0.3, 0.3 + 0.6 * math.log(g.flops / 1e9) / math.log(1e3)))
        assert c.gemm(g) == pytest.approx(g.flops / (312e12 * eff))
    from ptdp.perf.cost.costs import attention_core
    from ptdp.perf.validate.paper import preset

    model = preset("gpt-22b")
    base = attention_core(model, 1, 1, Compute(load_system("a100-80gb"), Precision.BF16, PTDP))
    mine = attention_core(model, 1, 1, c)
    flops = 4 * 2048 * 2048 * model.head_dim * model.num_heads * 0.5
    assert mine.f == pytest.approx(max(flops / (312e12 * 0.5), system.device.kernel_overhead))
    assert mine.b == pytest.approx(3.0 * mine.f) and base.b == pytest.approx(2.5 * base.f)


FITTED = ("h100-sxm", "h200", "h800")
"""Files whose GEMM curve is fitted to published runs (`ptdp.perf.validate.published`; the
H800 is an H100 SXM's compute)."""


@pytest.mark.parametrize("name", [n for n in list_systems() if n not in FITTED])
def test_built_in_files_keep_the_single_fraction(name: str) -> None:
    device = load_system(name).device
    assert device.gemm_curve == () and device.attention_efficiency == 0.0
    assert device.gemm_efficiency_at(1e6) == device.gemm_efficiency_at(1e15)
    assert device.gemm_efficiency_at(1e6) == device.gemm_efficiency


@pytest.mark.parametrize("name", FITTED)
def test_fitted_files_rise_with_the_gemm_size(name: str) -> None:
    device = load_system(name).device
    sizes = [1e8, 1e9, 1e10, 1e11, 1e12]
    effs = [device.gemm_efficiency_at(f) for f in sizes]
    assert effs == sorted(effs) and effs[0] < 0.5 * effs[-1] and 0.4 < effs[-1] < 0.6


@pytest.mark.parametrize(
    "flops,eff",
    [("[1e9, 1e12]", "[0.9, 0.3]"), ("[1e12, 1e9]", "[0.3, 0.9]"), ("[1e9]", "[0.3, 0.9]")],
)
def test_a_broken_curve_is_refused(tmp_path: Path, flops: str, eff: str) -> None:
    with pytest.raises(ConfigError, match="curve"):
        load_system(_with_curve(tmp_path, flops, eff))
