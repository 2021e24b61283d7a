"""`ptdp calibrate` over two gloo ranks: every collective the runtime uses (expert
parallelism's all-to-all too), timed over message sizes and fitted to latency + bandwidth,
the in-node link written from them, and what each blocking collective costs beyond its
transfer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ptdp.config.files import tomllib
from ptdp.perf.calibrate import microbench as mb
from ptdp.perf.calibrate.fit import collective_bytes
from ptdp.perf.calibrate.measure import calibrate, write_calibration
from ptdp.perf.calibrate.sweep import SWEEPS
from ptdp.perf.calibrate.timing import Timing
from ptdp.perf.cost.collectives import all_reduce_seconds, all_to_all_seconds, gather_seconds
from ptdp.perf.cost.experts import alltoall_link
from ptdp.perf.cost.hardware_file import load_system
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

KIB = 1024


def _calibrate(rank: int, world_size: int, out: str) -> None:
    sweep = replace(
        SWEEPS[("cpu", True)],
        hidden=(32, 64),
        attention_seq=(32,),
        stream_bytes=(256 * KIB,),
        attention_dims=(),
        message_bytes=(4 * KIB, 256 * KIB, 4096 * KIB, 16384 * KIB),
        timing=Timing(0.01, 5),
    )
    cal = calibrate(torch.device("cpu"), sweep, progress=False)
    if rank == 0:
        write_calibration(cal, Path(out))


def test_two_rank_calibration_fits_every_collective(tmp_path: Path) -> None:
    out = tmp_path / "two.toml"
    run_ranks(_calibrate, 2, str(out))
    system = load_system(out)
    assert system.gpus_per_node == 2
    assert system.intra.name.startswith("measured: ")
    assert system.intra.latency > 0 and system.intra.achieved > 0
    raw = tomllib.loads(out.read_text())
    fits = {c["op"]: c for c in raw["calibration"]["collectives"]}
    assert set(fits) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    for c in fits.values():
        assert c["ranks"] == 2 and c["span"] == "node", c
        assert "not_fitted" not in c, c
        assert c["latency_us"] >= 0 and c["bandwidth_gb_s"] > 0, c
        assert len(c["seconds"]) == 4 and all(t > 0 for t in c["seconds"])
        assert 0 <= c["rms_relative_error"] < 10, c
    # The cost model prices each collective at its own fit, which the file writes into the
    # link (gloo's collectives differ threefold): latency plus the ring's bytes over bandwidth.
    for op, seconds in (("all_reduce", all_reduce_seconds), ("all_gather", gather_seconds)):
        nbytes = fits[op]["message_bytes"][-1]
        fit = fits[op]
        expected = fit["latency_us"] * 1e-6 + collective_bytes(op, nbytes, 2) / (
            fit["bandwidth_gb_s"] * 1e9
        )
        assert seconds(nbytes, 2, system.intra) == pytest.approx(expected)
    rs = fits["reduce_scatter"]
    nbytes = rs["message_bytes"][-1]
    expected = rs["latency_us"] * 1e-6 + collective_bytes("reduce_scatter", nbytes, 2) / (
        rs["bandwidth_gb_s"] * 1e9
    )
    assert gather_seconds(nbytes, 2, system.intra, "reduce_scatter") == pytest.approx(expected)
    # The all-to-all's own fit prices expert parallelism's dispatch and combine: latency plus
    # the bytes a rank sends to the other.
    a2a = fits["all_to_all"]
    nbytes = a2a["message_bytes"][-1]
    sent = collective_bytes("all_to_all", nbytes, 2)
    assert sent == nbytes / 2
    expected = a2a["latency_us"] * 1e-6 + sent / (a2a["bandwidth_gb_s"] * 1e9)
    assert alltoall_link(system, 2, 1) is system.intra
    assert all_to_all_seconds(sent, 2, system.intra) == pytest.approx(expected)
    # Point-to-point keeps its own fit in the link: pipeline transfers and cp shifts.
    p2p = fits["p2p"]
    assert system.intra.p2p == pytest.approx(
        (p2p["latency_us"] * 1e-6, p2p["bandwidth_gb_s"] * 1e9)
    )
    # Each blocking collective's resynchronisation, from ptdp's tiny model at tp = 2
    # against tp = 1 (CPUs under torchrun): written, loaded, and its raw figures kept.
    sync = raw["calibration"]["collective_sync"]
    assert sync["per_call_us"] >= 0 and sync["tp2_layer_us"] >= 0
    # What a wait costs more after a layer's compute: its own key, loaded.
    assert sync["wait_after_compute_us"] >= 0
    assert system.device.wait_after_compute == pytest.approx(sync["wait_after_compute_us"] * 1e-6)
    # Each ring attention shift's own figure, from ptdp's tiny model at cp = 2 against none.
    ring = raw["calibration"]["ring_sync"]
    assert ring["per_shift_us"] >= 0 and ring["cp2_layer_us"] >= 0
    assert system.device.ring_sync == pytest.approx(ring["per_shift_us"] * 1e-6)
    # And what ptdp's zero-bubble split of a backward costs against the fused one: written
    # and loaded (its size follows the machine's load: benchmarks/pipeline/split_backward.py).
    split = raw["device"]["achieved"]["split_backward_ratio"]
    assert 0 < split < float("inf") and system.device.split_backward_ratio == pytest.approx(split)
    assert raw["device"]["achieved"]["collective_sync_us"] == pytest.approx(sync["per_call_us"])
    assert system.device.collective_sync == pytest.approx(sync["per_call_us"] * 1e-6)
    # Timings on this shared machine swing several-fold, so the fit's accuracy is not
    # asserted here; BENCHMARKS.md records a calibration and its errors.


def _all_to_all(rank: int, world_size: int, out: str) -> None:
    """The calibration's all-to-all call: what it moves, and its time over three sizes."""
    group = mb.build_groups(world_size, 2, 1)
    cpu = torch.device("cpu")
    seconds = [
        mb.collective_seconds("all_to_all", n, group, torch.float32, cpu, Timing(0.005, 3))
        for n in (4 * KIB, 64 * KIB, 512 * KIB)
    ]
    # The call itself: rank r's i-th half reaches rank i's r-th half (dispatch's layout).
    mine = torch.arange(4, dtype=torch.float32) + 10 * rank
    got = torch.empty(4)
    torch.distributed.all_to_all_single(got, mine, group=group.group)
    assert got.tolist() == [0.0 + 2 * rank, 1.0 + 2 * rank, 10.0 + 2 * rank, 11.0 + 2 * rank]
    if rank == 0:
        Path(out).write_text(" ".join(map(str, seconds)))


def test_the_all_to_all_is_timed_over_two_gloo_ranks(tmp_path: Path) -> None:
    out = tmp_path / "a2a.txt"
    run_ranks(_all_to_all, 2, str(out))
    seconds = [float(x) for x in out.read_text().split()]
    assert len(seconds) == 3 and all(t > 0 for t in seconds)
