"""`ptdp calibrate` on this CPU: the file it writes loads, holds the monotone fit of its own
measurements, and moves `ptdp simulate`'s predictions; `scripts/gpu-check.sh` without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.config.enums import Precision
from ptdp.config.files import tomllib
from ptdp.perf.calibrate.fit import interpolate_log, monotone_curve
from ptdp.perf.cost.costs import Compute, Gemm
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.software import PTDP

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calibration") / "cpu.toml"
    assert main(["calibrate", "--quick", "--out", str(path)]) == 0
    return path


def test_the_file_loads_and_holds_what_was_measured(calibrated: Path) -> None:
    system = load_system(calibrated)
    raw = tomllib.loads(calibrated.read_text())
    dev = system.device
    assert dev.kind == "cpu" and system.gpus_per_node == 1
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # this machine's
    assert abs(system.host_memory_bytes - physical) <= 0.05 * 2**30  # written to 0.1 GiB
    assert raw["calibration"]["sweep"] == "quick"
    assert raw["calibration"]["threads"] == str(__import__("torch").get_num_threads())
    # The peak of a CPU is its best measured GEMM, so the curve tops out at 1.
    peak = dev.peak_flops("fp32")
    gemm = raw["calibration"]["gemm"]
    assert max(gemm["tflops"]) * 1e12 == pytest.approx(peak, rel=1e-6)
    flops = [2.0 * m * n * k for m, n, k in gemm["mnk"]]
    points = [(f, t * 1e12 / peak) for f, t in zip(flops, gemm["tflops"])]
    fitted = monotone_curve(points)
    for f in flops:  # the file's curve is the isotonic fit of its own measurements
        assert dev.gemm_efficiency_at(f) == pytest.approx(interpolate_log(fitted, f), rel=1e-6)
    values = [y for _, y in dev.gemm_curve]
    assert all(a <= b for a, b in zip(values, values[1:])) and 0 < values[0] <= values[-1] <= 1
    assert dev.gemm_efficiency == pytest.approx(values[-1])
    # The largest GEMM measured costs what the top of the curve says: flops / (peak * eff).
    m, n, k = max(gemm["mnk"], key=lambda mnk: mnk[0] * mnk[1] * mnk[2])
    c = Compute(system, Precision.FP32, PTDP)
    assert c.gemm(Gemm(m, n, k)) == pytest.approx(2 * m * n * k / (peak * values[-1]), rel=1e-6)
    assert len(flops) >= 10  # the two smallest hidden sizes at least, 5 shapes each
    # Relative to a measured peak, so not bounded by 1 on a machine this noisy.
    assert dev.attention_efficiency > 0 and dev.attention_backward_ratio > 0
    memory = raw["calibration"]["memory_gb_s"]
    forward = {"layer_norm", "rms_norm", "gelu", "silu", "softmax", "add", "adamw"}
    backward = {f"{k}_backward" for k in forward - {"add", "adamw"}}
    assert set(memory) == forward | backward
    assert all(v > 0 for v in memory.values())
    # Each kernel's curve over the sizes of the quick sweep (256 KiB and 2 MiB inputs), and
    # its last knot is the figure past the caches.
    curves = dict(dev.memory_kernels)
    assert set(curves) == set(memory)
    for name, curve in curves.items():
        assert len(curve) == 2 and curve[0][0] < curve[1][0]
        assert curve[-1][1] == pytest.approx(memory[name] * 1e9, rel=1e-6)
    assert dev.kernel_bandwidth("gelu", 1.0) == curves["gelu"][0][1]
    # Attention over the work per head: head sizes 16 and 32 at the quick sweep's shortest
    # sequence always (s = 512 is skipped when the GEMM rate predicts too long a call).
    knots = dev.attention_curve
    shapes = raw["calibration"]["attention"]["bhsd"]
    assert {x for x, _, _ in knots} == {2.0 * s * s * d for _, _, s, d in shapes}
    assert {(s, d) for _, _, s, d in shapes} >= {(128, 16), (128, 32)}
    for column in (1, 2):  # forward and backward efficiency, each non-decreasing
        values = [knot[column] for knot in knots]
        assert values == sorted(values) and values[0] > 0
    assert dev.memory_bandwidth * dev.memory_efficiency > 0 and dev.kernel_overhead > 0
    assert "not measured" in system.intra.name  # one process: no link was timed


def _a100_with(tmp_path: Path, line: str) -> Path:
    """The built-in a100-80gb file with `line` added to its [device.achieved], saved."""
    text = (ROOT / "ptdp/perf/cost/hardware/a100-80gb.toml").read_text()
    path = tmp_path / "achieved.toml"
    path.write_text(text.replace("[device.achieved]", f"[device.achieved]\n{line}"))
    return path


def _simulate(device: str, out: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    config = str(ROOT / "configs" / "demo.toml")
    argv = ["simulate", "--config", config, "--model.vocab_size", "4096", "--device", device]
    assert main([*argv, "--json", "--out", str(out)]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_file_changes_simulate_predictions(
    calibrated: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = _simulate(str(calibrated), tmp_path, capsys)
    a100 = _simulate("a100-80gb", tmp_path, capsys)
    # A 2-core CPU at ~0.1 TFLOP/s against an A100: the same step predicted far slower.
    assert mine["iteration_seconds"] > 20 * a100["iteration_seconds"]
    # The constants it fitted are what the prediction reads: twice the GEMM peak and the
    # same step is predicted faster, everything else equal.
    text = calibrated.read_text()
    peak = load_system(calibrated).device.peak_flops("fp32") / 1e12
    faster = tmp_path / "faster.toml"
    faster.write_text(text.replace(f"fp32 = {peak:.8g}", f"fp32 = {2 * peak:.8g}"))
    assert load_system(faster).device.peak_flops("fp32") == pytest.approx(2 * peak * 1e12)
    doubled = _simulate(str(faster), tmp_path, capsys)
    assert doubled["iteration_seconds"] < mine["iteration_seconds"]


def test_gpu_check_without_cuda_exits_0_and_says_what_it_skipped(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this test is the no-CUDA path; the GPU path is the script's whole run")
    out = tmp_path / "check"
    env = dict(os.environ, PTDP_GPU_CHECK_QUICK="1", PTDP_GPU_CHECK_OUT=str(out))
    env["PYTHON"] = sys.executable
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "no CUDA device here" in done.stdout, said
    assert "cuda-tests: skipped" in done.stdout and "test_fused_adamw_on_cuda" in done.stdout
    assert "skipped without CUDA" in done.stdout, said
    status = (out / "status.tsv").read_text()
    assert "calibrate\tok" in status and "mfu\tskipped" in status, said
    assert "small-speed\tskipped: no CUDA" in status and "split-backward\tskipped" in status
    load_system(out / "calibration.toml")
    table = (out / "BENCHMARKS-snippet.md").read_text()
    assert "| GEMM efficiency, smallest to largest |" in table and "| calibrate | ok" in table


def test_gpu_check_skips_what_its_time_budget_cannot_hold(tmp_path: Path) -> None:
    """A lent GPU's call is cut at ten minutes: the check keeps to its budget, names each
    part it had no time for, and still writes the report."""
    out = tmp_path / "check"
    env = dict(os.environ, PTDP_GPU_CHECK_OUT=str(out), PTDP_GPU_CHECK_BUDGET_S="20")
    env["PYTHON"] = sys.executable
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    status = dict(line.split("\t") for line in (out / "status.tsv").read_text().splitlines())
    assert status["calibrate"].startswith("skipped: out of time"), status
    assert status["demo"].startswith("skipped: out of time"), status
    assert not (out / "calibration.toml").exists()
    assert "| calibrate | skipped: out of time" in (out / "BENCHMARKS-snippet.md").read_text()


def test_framework_overhead_is_measured_and_enters_each_layer_pass(calibrated: Path) -> None:
    """A CPU file carries what Python and autograd cost per layer and per head (ptdp's own
    model timed at a negligible size); the model adds exactly that to every layer's F and B
    (twice F's under full recomputation) and to the head's, in place of its count of the
    layer's memory-bound kernel launches (which the measurement holds)."""
    from dataclasses import replace

    from ptdp.config.enums import Recompute
    from ptdp.config.sections import ModelConfig
    from ptdp.perf.cost.costs import head_seconds, layer_seconds

    system = load_system(calibrated)
    raw = tomllib.loads(calibrated.read_text())["device"]["achieved"]
    layer, head = system.device.layer_overhead, system.device.head_overhead
    assert layer == pytest.approx([v * 1e-6 for v in raw["layer_overhead_us"]])
    assert head == pytest.approx([v * 1e-6 for v in raw["head_overhead_us"]])
    assert min(layer + head) >= 0 and sum(layer) > 0 and sum(head) > 0
    launches = PTDP.elementwise_kernels * system.device.kernel_overhead
    bare = replace(
        system, device=replace(system.device, layer_overhead=(0, 0), head_overhead=(0, 0))
    )
    model = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_length=32, vocab_size=64)
    for recompute, redo in ((Recompute.NONE, 0), (Recompute.FULL, 1)):
        kw = dict(micro_batch=2, tp=1, sequence_parallel=False, recompute=recompute)
        got = layer_seconds(model, c=Compute(system, Precision.FP32, PTDP), **kw)
        without = layer_seconds(model, c=Compute(bare, Precision.FP32, PTDP), **kw)
        f = layer[0] - launches
        b = layer[1] - PTDP.backward_traffic_ratio * launches
        assert got.f - without.f == pytest.approx(f)
        assert got.b - without.b == pytest.approx(b + redo * f)
        assert got.w == pytest.approx(without.w)
    kw = dict(micro_batch=2, tp=1)
    got = head_seconds(model, c=Compute(system, Precision.FP32, PTDP), **kw)
    without = head_seconds(model, c=Compute(bare, Precision.FP32, PTDP), **kw)
    assert (got.f - without.f, got.b - without.b) == pytest.approx(head)


def test_the_framework_overhead_holds_the_gradient_buffers_hooks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Training attaches `GradBuffers`, whose hook runs on every parameter tensor of every
    microbatch; the framework figure is timed with them attached: the backward of each
    timed model runs the hook of every one of its parameter tensors."""
    import torch

    from ptdp.parallel.data import GradBuffers
    from ptdp.perf.calibrate import microbench
    from ptdp.perf.calibrate.timing import Timing

    hooked: set[int] = set()
    on_grad = GradBuffers._on_grad
    monkeypatch.setattr(
        GradBuffers, "_on_grad", lambda self, p: (hooked.add(id(p)), on_grad(self, p))
    )
    built: list[torch.nn.Parameter] = []  # kept alive: their ids stay theirs
    tiny_gpt = microbench.tiny_gpt

    def recorded(*args: object, **kw: object) -> tuple:
        model, tokens = tiny_gpt(*args, **kw)
        built.extend(model.parameters())
        return model, tokens

    monkeypatch.setattr(microbench, "tiny_gpt", recorded)
    microbench.framework_overhead(torch.float32, torch.device("cpu"), Timing(0.0, 1))
    assert len(built) > 20 and hooked == {id(p) for p in built}


def test_the_optimizer_step_pays_its_measured_overhead_per_tensor(calibrated: Path) -> None:
    """A CPU file carries ptdp's optimizer step beyond its bytes, per step and per parameter
    tensor (foreach AdamW, the norm and clipping loop over tensors); the model adds exactly
    fixed + per tensor x the busiest rank's tensors (its shard's under ZeRO) to the step."""
    from dataclasses import replace

    from ptdp.config.files import apply_updates
    from ptdp.config.sections import RunConfig
    from ptdp.perf.cost.parameters import tensors_per_rank
    from ptdp.perf.simulate.optimizer_step import optimizer_seconds
    from ptdp.rules.layout import validate

    system = load_system(calibrated)
    raw = tomllib.loads(calibrated.read_text())["device"]["achieved"]
    fixed, per_tensor = system.device.optimizer_overhead
    assert [fixed, per_tensor] == pytest.approx([v * 1e-6 for v in raw["optimizer_overhead_us"]])
    assert fixed >= 0 and per_tensor > 0
    bare = replace(system, device=replace(system.device, optimizer_overhead=(0.0, 0.0)))
    model = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "seq_length": 32}
    for parallel, world, shard in (({}, 1, 1), ({"pp": 2}, 2, 1), ({"zero": 1}, 2, 2)):
        train = {"micro_batch_size": 2, "global_batch_size": 8, "precision": "fp32"}
        cfg = apply_updates(
            RunConfig(), {"model": {**model, "vocab_size": 64}, "parallel": parallel,
                          "train": train}, "test"
        )  # fmt: skip
        layout = validate(cfg, world)
        got = optimizer_seconds(cfg, layout, Compute(system, Precision.FP32, PTDP))
        without = optimizer_seconds(cfg, layout, Compute(bare, Precision.FP32, PTDP))
        tensors = max(tensors_per_rank(cfg.model, layout.pp))
        assert got - without == pytest.approx(fixed + per_tensor * -(-tensors // shard))


def test_cpu_kernels_are_timed_one_call_at_a_time_between_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`in_context_seconds` calls each kernel once per round, in turn (never twice in a
    row, as a step runs them), times every call on its own, and keeps each kernel's median
    call; rounds fill what batches would have spent. On CPU, attention and the memory-bound
    kernels are timed so; on CUDA in batches."""
    from types import SimpleNamespace

    import torch

    from ptdp.perf.calibrate import microbench as mb
    from ptdp.perf.calibrate import timing
    from ptdp.perf.calibrate.timing import Timing, in_context_seconds

    clock, order = [0.0], []
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    costs = {"a": iter([3e-3] * 100), "b": iter([1e-3, 1e-3, 9e-3] * 40)}

    def kernel(name: str):  # noqa: ANN202 - a fake kernel advancing the fake clock
        def call() -> None:
            order.append(name)
            clock[0] += next(costs[name])

        return call

    got = in_context_seconds([kernel("a"), kernel("b")], torch.device("cpu"), Timing(0.01, 3))
    assert got == pytest.approx([3e-3, 1e-3])  # b's slow third calls are not its median
    rounds = int(0.01 * 3 * 2 / 4e-3)  # the probe round took 3 + 1 ms: 15 rounds
    assert order == ["a", "b"] * (2 + rounds)  # warm-up, probe, then the timed rounds

    used = []
    monkeypatch.setattr(
        mb, "in_context_seconds", lambda fns, *_: used.append(len(fns)) or [1.0] * len(fns)
    )
    monkeypatch.setattr(mb, "interleaved_seconds", lambda fns, *_: [2.0] * len(fns))
    rows = mb.stream_seconds(
        [("add", 4096, False), ("gelu", 4096, True)],
        torch.float32,
        torch.device("cpu"),
        Timing(0.001, 1),
    )
    assert used == [2] and [seconds for _, seconds in rows] == [1.0, 1.0]
    assert mb._kernel_timer(torch.device("cuda")) is mb.interleaved_seconds


def test_cpu_attention_backward_is_the_median_of_each_rounds_difference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CPU an attention backward is the median over rounds of (forward + backward) -
    forward within each round, which a busy spell slows alike; one that comes out no slower
    than its forward stops the calibration with an error that names the shape and the fix."""
    import torch

    from ptdp.errors import PtdpError
    from ptdp.perf.calibrate import microbench as mb
    from ptdp.perf.calibrate.timing import Timing

    shape = mb.AttentionShape(1, 2, 16, 8)
    cpu, timing = torch.device("cpu"), Timing(0.001, 3)
    # rounds: forward 1, 9 (a busy round), 1; forward + backward 3, 12, 4
    monkeypatch.setattr(mb, "in_context_rounds", lambda *_: [[1.0, 9.0, 1.0], [3.0, 12.0, 4.0]])
    assert mb.attention_seconds([shape], torch.float32, cpu, timing) == [(1.0, 3.0)]
    monkeypatch.setattr(mb, "in_context_rounds", lambda *_: [[2.0, 2.0, 2.0], [2.0, 1.0, 3.0]])
    with pytest.raises(PtdpError, match="rerun on a quieter machine"):
        mb.attention_seconds([shape], torch.float32, cpu, timing)


def test_a_cpu_collective_is_priced_at_its_median_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU a collective's figure is its median batch (gloo's threads share the cores, so
    slow calls are part of a step); on CUDA the fastest batch."""
    import torch

    from ptdp.parallel import comm
    from ptdp.perf.calibrate import microbench as mb
    from ptdp.perf.calibrate.timing import Timing

    monkeypatch.setattr(mb, "_collective_call", lambda *_: lambda: None)
    for device, want in (("cpu", 3.0), ("cuda", 1.0)):
        batches = iter([5.0, 5.0, 9.0, 1.0, 3.0, 4.0, 2.0])  # two probes, then 5 timed
        monkeypatch.setattr(mb, "lockstep_batch", lambda *_, b=batches: next(b))
        pair = comm.Group(None, 2, 0)
        got = mb.collective_seconds(
            "all_reduce", 4096, pair, torch.float32, torch.device(device), Timing(1.0, 5)
        )
        assert got == want


def test_overheads_in_a_hardware_file_are_checked(tmp_path: Path) -> None:
    from ptdp.errors import ConfigError

    text = (ROOT / "ptdp/perf/cost/hardware/a100-80gb.toml").read_text()
    assert load_system("a100-80gb").device.layer_overhead == (0.0, 0.0)  # absent: none
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("[device.achieved]", "[device.achieved]\nlayer_overhead_us = [5]"))
    with pytest.raises(ConfigError, match=r"layer_overhead_us must be \[forward, backward\]"):
        load_system(bad)
    bad.write_text(
        text.replace("[device.achieved]", "[device.achieved]\noptimizer_overhead_us = [-1, 2]")
    )
    with pytest.raises(
        ConfigError, match=r"optimizer_overhead_us must be \[per step, per tensor\]"
    ):
        load_system(bad)
    assert load_system("a100-80gb").device.optimizer_overhead == (0.0, 0.0)


def test_collective_sync_is_loaded_checked_and_paid_per_blocking_call(tmp_path: Path) -> None:
    """`collective_sync_us` (what `ptdp calibrate` measures on CPUs under torchrun) loads,
    is refused when negative or not a number, and the model pays it once per blocking
    collective a rank waits on: 2 per tensor-parallel layer pass (4 with sequence
    parallelism: all-gather + reduce-scatter pairs), 1 in the embedding, 3 for the
    vocabulary-parallel loss and 1 for the head's input gradient, every key/value shift of
    a cp ring (1 forward, 3 backward at cp = 2) and ZeRO-3's per-layer gathers and
    reduce-scatters; nothing at tp = 1 or where the collectives overlap the GEMMs."""
    from dataclasses import replace

    from ptdp.config.enums import CpComm, Recompute
    from ptdp.config.sections import ModelConfig
    from ptdp.errors import ConfigError
    from ptdp.perf.cost.context_costs import cp_comm_seconds
    from ptdp.perf.cost.costs import embedding_seconds, head_seconds, layer_seconds
    from ptdp.perf.cost.software import MEGATRON_CORE

    assert load_system("a100-80gb").device.collective_sync == 0.0  # absent: none
    path = _a100_with(tmp_path, "collective_sync_us = 750")
    assert load_system(path).device.collective_sync == pytest.approx(750e-6)
    for value, why in (("-1", "must be >= 0"), ('"fast"', "is not a number")):
        with pytest.raises(ConfigError, match=f"collective_sync_us = .* {why}"):
            load_system(_a100_with(tmp_path, f"collective_sync_us = {value}"))

    sync = 1e-3
    base = load_system("a100-80gb")
    synced = replace(base, device=replace(base.device, collective_sync=sync))
    model = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_length=32, vocab_size=64)

    def diff(fn, software=PTDP, **kw):
        got = fn(model, c=Compute(synced, Precision.FP32, software), **kw)
        without = fn(model, c=Compute(base, Precision.FP32, software), **kw)
        return (got.f - without.f, got.b - without.b, got.w - without.w)

    layer = dict(micro_batch=2, recompute=Recompute.NONE)
    assert diff(layer_seconds, tp=1, sequence_parallel=False, **layer) == (0, 0, 0)
    assert diff(layer_seconds, tp=2, sequence_parallel=False, **layer) == pytest.approx(
        (2 * sync, 2 * sync, 0)
    )
    assert diff(layer_seconds, tp=2, sequence_parallel=True, **layer) == pytest.approx(
        (4 * sync, 4 * sync, 0)
    )
    assert diff(
        layer_seconds, MEGATRON_CORE, tp=2, sequence_parallel=True, **layer
    ) == pytest.approx((0, 0, 0))
    assert diff(embedding_seconds, micro_batch=2, tp=2) == pytest.approx((sync, 0, 0))
    assert diff(head_seconds, micro_batch=2, tp=2) == pytest.approx((3 * sync, sync, 0))
    assert diff(head_seconds, micro_batch=2, tp=2, sequence_parallel=True) == pytest.approx(
        (4 * sync, sync, 0)
    )
    assert diff(head_seconds, micro_batch=2, tp=1) == (0, 0, 0)

    def cp_exposed(system, comm):
        c = Compute(system, Precision.FP32, PTDP)
        return cp_comm_seconds(model, micro_batch=2, tp=1, cp=2, comm=comm, c=c)[1]

    for comm, waits in ((CpComm.RING, (1, 3)), (CpComm.ALLGATHER, (1, 1))):
        got, without = cp_exposed(synced, comm), cp_exposed(base, comm)
        assert (got.f - without.f, got.b - without.b) == pytest.approx(
            (waits[0] * sync, waits[1] * sync)
        )


def test_a_wait_right_after_compute_pays_its_extra_and_one_after_a_wait_does_not(
    tmp_path: Path,
) -> None:
    """`wait_after_compute_us` loads and is checked like `collective_sync_us`, and the model
    adds it only to the waits that follow a layer's compute: both of a tensor-parallel
    pass's all-reduces, but only 2 of sequence parallelism's 4 collectives (its all-gathers
    follow a wait and a norm), the first of the loss's 3 all-reduces, the first wait of
    each cp ring step (1 forward and 2 of the 3 backward at cp = 2), the first of the
    step's back-to-back scalar all-reduces, and none when there are none."""
    from dataclasses import replace

    from ptdp.config.enums import CpComm, Recompute
    from ptdp.config.sections import ModelConfig
    from ptdp.errors import ConfigError
    from ptdp.perf.cost.context_costs import cp_comm_seconds
    from ptdp.perf.cost.costs import head_seconds, layer_seconds
    from ptdp.perf.simulate.optimizer_step import step_reductions
    from ptdp.rules.layout import Layout

    assert load_system("a100-80gb").device.wait_after_compute == 0.0  # absent: none
    path = _a100_with(tmp_path, "wait_after_compute_us = 600")
    assert load_system(path).device.wait_after_compute == pytest.approx(600e-6)
    with pytest.raises(ConfigError, match="wait_after_compute_us = .* must be >= 0"):
        load_system(_a100_with(tmp_path, "wait_after_compute_us = -1"))

    after = 1e-3
    base = load_system("a100-80gb")
    slow = replace(base, device=replace(base.device, wait_after_compute=after))
    model = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_length=32, vocab_size=64)

    def diff(fn, **kw):
        got = fn(model, c=Compute(slow, Precision.FP32, PTDP), **kw)
        without = fn(model, c=Compute(base, Precision.FP32, PTDP), **kw)
        return (got.f - without.f, got.b - without.b, got.w - without.w)

    layer = dict(micro_batch=2, recompute=Recompute.NONE)
    assert diff(layer_seconds, tp=1, sequence_parallel=False, **layer) == (0, 0, 0)
    for sp in (False, True):
        assert diff(layer_seconds, tp=2, sequence_parallel=sp, **layer) == pytest.approx(
            (2 * after, 2 * after, 0)
        )
    assert diff(head_seconds, micro_batch=2, tp=2) == pytest.approx((after, after, 0))

    def cp_exposed(system):
        c = Compute(system, Precision.FP32, PTDP)
        return cp_comm_seconds(model, micro_batch=2, tp=1, cp=2, comm=CpComm.RING, c=c)[1]

    got, without = cp_exposed(slow), cp_exposed(base)
    assert (got.f - without.f, got.b - without.b) == pytest.approx((after, 2 * after))

    def reductions(system, tp, dp):
        layout = Layout(world_size=tp * dp, tp=tp, pp=1, dp=dp, vpp=1, num_microbatches=1)
        return step_reductions(layout, Compute(system, Precision.FP32, PTDP))

    assert reductions(slow, 2, 2) - reductions(base, 2, 2) == pytest.approx(after)
    assert reductions(slow, 1, 1) == reductions(base, 1, 1)  # one process: none


def test_the_gradient_reduction_waits_on_each_bucket_the_first_right_after_compute() -> None:
    """`GradBuffers.finish` waits on each bucket of the data-parallel reduction, the first
    right after the backward's compute; the distributed optimizer's gather waits on each
    bucket after AdamW. Each wait pays `collective_sync_us`, the first also
    `wait_after_compute_us`; one rank has no reduction and pays nothing."""
    from dataclasses import replace

    from ptdp.config.files import apply_updates
    from ptdp.config.sections import RunConfig
    from ptdp.perf.cost.parameters import parameters_per_stage
    from ptdp.perf.simulate.optimizer_step import optimizer_seconds
    from ptdp.perf.simulate.reduction import stage_reductions
    from ptdp.rules.layout import validate

    sync, after = 1e-3, 5e-3
    base = load_system("a100-80gb")
    device = replace(base.device, collective_sync=sync, wait_after_compute=after)
    slow = replace(base, device=device)

    def config(dp: int, zero: int, bucket_mb: float):
        cfg = apply_updates(
            RunConfig(),
            {
                "model": {
                    "num_layers": 2,
                    "hidden_size": 64,
                    "num_heads": 4,
                    "seq_length": 32,
                    "vocab_size": 64,
                },  # fmt: skip
                "parallel": {"dp": dp, "zero": zero, "bucket_mb": bucket_mb},
                "train": {"micro_batch_size": 1, "global_batch_size": 2 * dp},
            },
            "test",
        )
        return cfg, validate(cfg, dp)

    def extra(fn, dp, zero, bucket_mb):
        cfg, layout = config(dp, zero, bucket_mb)
        got, without = (fn(cfg, layout, Compute(s, Precision.FP32, PTDP)) for s in (slow, base))
        return got, without

    reduce = lambda cfg, layout, c: stage_reductions(cfg, layout, c)[0][0]  # noqa: E731
    cfg, layout = config(2, 0, 25.0)
    (params,) = parameters_per_stage(cfg.model, 1, 1, 1, layout.stage_layers)
    for zero in (0, 1):
        got, without = extra(reduce, 2, zero, 25.0)  # one bucket
        assert got - without == pytest.approx(sync + after)
        got, without = extra(reduce, 2, zero, 4 * params / 2.5 / 2**20)  # 3 buckets
        assert got - without == pytest.approx(3 * sync + after)
    got, without = extra(optimizer_seconds, 2, 1, 25.0)  # ZeRO-1's gather
    assert got - without == pytest.approx(sync + after)
    got, without = extra(optimizer_seconds, 2, 0, 25.0)  # no gather
    assert got == without
    assert extra(reduce, 1, 0, 25.0) == (0.0, 0.0)  # one rank: no reduction


def test_a_ring_shift_pays_its_own_measured_sync_else_the_collectives(tmp_path: Path) -> None:
    """`ring_sync_us` loads and is checked; the cp ring's 1 forward and 3 backward waits (cp
    = 2) pay it instead of `collective_sync_us`, which they pay when the file has none.
    The all-gather form, a collective, keeps `collective_sync_us`."""
    from dataclasses import replace

    from ptdp.config.enums import CpComm
    from ptdp.config.sections import ModelConfig
    from ptdp.errors import ConfigError
    from ptdp.perf.cost.context_costs import cp_comm_seconds

    assert load_system("a100-80gb").device.ring_sync is None  # absent: collective_sync's
    for value, why in (("-1", "must be >= 0"), ('"slow"', "is not a number")):
        with pytest.raises(ConfigError, match=f"ring_sync_us = .* {why}"):
            load_system(_a100_with(tmp_path, f"ring_sync_us = {value}"))
    path = _a100_with(tmp_path, "ring_sync_us = 900")
    assert load_system(path).device.shift_sync == pytest.approx(900e-6)

    base = load_system("a100-80gb")
    model = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_length=32, vocab_size=64)

    def waits(collective: float, ring: float | None, comm: CpComm) -> tuple[float, float]:
        device = replace(base.device, collective_sync=collective, ring_sync=ring)
        c = Compute(replace(base, device=device), Precision.FP32, PTDP)
        got = cp_comm_seconds(model, micro_batch=2, tp=1, cp=2, comm=comm, c=c)[1]
        without = cp_comm_seconds(
            model, micro_batch=2, tp=1, cp=2, comm=comm, c=Compute(base, Precision.FP32, PTDP)
        )[1]
        return got.f - without.f, got.b - without.b

    assert waits(1e-3, None, CpComm.RING) == pytest.approx((1e-3, 3e-3))
    assert waits(1e-3, 2e-3, CpComm.RING) == pytest.approx((2e-3, 6e-3))
    assert waits(1e-3, 2e-3, CpComm.ALLGATHER) == pytest.approx((1e-3, 1e-3))


def test_a_split_backward_pays_its_measured_cost_in_w_on_zero_bubble_schedules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`split_backward_ratio` loads and is checked; a zero-bubble schedule's W then carries
    (ratio - 1) of the fused backward (B + W), a schedule that does not split pays nothing,
    nor does a compiled model (its W only adds gradients in); the calibration's own
    measurement counts what the forward under capture costs more."""
    from dataclasses import replace

    import torch

    from ptdp.config.files import apply_updates
    from ptdp.config.sections import RunConfig
    from ptdp.errors import ConfigError
    from ptdp.perf.calibrate.timing import Timing
    from ptdp.perf.calibrate.wgrad_cost import split_backward_ratio
    from ptdp.perf.simulate.pipeline_costs import accumulation, pipeline_costs
    from ptdp.rules.layout import validate

    assert load_system("a100-80gb").device.split_backward_ratio == 1.0  # absent: free
    with pytest.raises(ConfigError, match="split_backward_ratio = .* must be > 0"):
        load_system(_a100_with(tmp_path, "split_backward_ratio = 0"))

    base = load_system("a100-80gb")
    slow = replace(base, device=replace(base.device, split_backward_ratio=1.25))

    def costs(system, schedule: str, compile: bool = False, accumulated: bool = False):
        cfg = apply_updates(
            RunConfig(),
            {
                "model": {
                    "num_layers": 4,
                    "hidden_size": 64,
                    "num_heads": 4,
                    "seq_length": 32,
                    "vocab_size": 64,
                },  # fmt: skip
                "parallel": {"pp": 2, "schedule": schedule},
                "train": {"micro_batch_size": 1, "global_batch_size": 4, "compile": compile},
            },
            "test",
        )
        layout, c = validate(cfg, 2), Compute(system, Precision.FP32, PTDP)
        return accumulation(cfg, layout, c) if accumulated else pipeline_costs(cfg, layout, c)

    fused, split = costs(base, "zb-h1"), costs(slow, "zb-h1")
    added = costs(base, "zb-h1", accumulated=True)
    assert split.forward == fused.forward and split.backward_input == fused.backward_input
    # (ratio - 1) of the fused backward's GEMMs and kernels; the gradients' accumulation
    # into the buffers, which W holds too, is the same pass split or fused
    for w0, w1, b, a in zip(
        fused.backward_weight, split.backward_weight, fused.backward_input, added
    ):
        assert a > 0
        assert w1 - w0 == pytest.approx(0.25 * (b + w0 - a))
    assert costs(slow, "1f1b") == costs(base, "1f1b")
    assert costs(slow, "zb-h1", compile=True) == costs(base, "zb-h1", compile=True)

    # Measured on this machine: positive and finite (its size depends on the load, so the
    # arithmetic is checked below on a fixed clock instead).
    ratio = split_backward_ratio(torch.float32, torch.device("cpu"), Timing(0.01, 3))
    assert 0 < ratio < float("inf")

    # The forward under capture counts: on a clock where each round takes forward 3, B 4,
    # W 2 (split), then forward 2.5, backward 5 (fused), the split costs (3 + 4 + 2 - 2.5)
    # / 5 = 1.3 of the fused backward, not (4 + 2) / 5.
    import types

    from ptdp.perf.calibrate import wgrad_cost

    def reads():
        now = 0.0
        while True:
            for took in (3.0, 4.0, 2.0, 2.5, 5.0):
                yield now
                now += took
                yield now

    clock = reads()
    monkeypatch.setattr(wgrad_cost, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    assert split_backward_ratio(
        torch.float32, torch.device("cpu"), Timing(0.01, 3)
    ) == pytest.approx(1.3)


def test_each_side_of_the_split_ratio_starts_without_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Training's buffers take each gradient and leave `.grad` empty, so a backward, split or
    fused, assigns its gradients; were one side's forward to find the other's `.grad`, its
    backward would pay an add the run does not (on the 2-vCPU Xeon, 1.20 instead of 1.24)."""
    import torch

    import ptdp.model.gpt as gpt
    from ptdp.perf.calibrate.timing import Timing
    from ptdp.perf.calibrate.wgrad_cost import split_backward_ratio

    seen: list[bool] = []

    class Watched(gpt.GPT):
        def forward(self, *args, **kwargs):
            seen.append(all(p.grad is None for p in self.parameters()))
            return super().forward(*args, **kwargs)

    monkeypatch.setattr(gpt, "GPT", Watched)
    split_backward_ratio(torch.float32, torch.device("cpu"), Timing(0.001, 2))
    assert len(seen) >= 2 * 10 and all(seen)  # both sides of every round, warm-up included


def test_on_a_cpu_gloo_costs_what_nccl_hides_or_spares() -> None:
    """ptdp's reduce-scatter over gloo is an all-reduce of the whole tensor
    (`comm._reduce_scatter`), so on a CPU a sequence-parallel pass costs 2 all-reduces and
    2 all-gathers of the boundary; on GPUs (NCCL's reduce-scatter) the pairs cost as much
    as 2 all-reduces. Without sequence parallelism nothing changes. And the cp ring's
    transfers, hidden under attention on GPUs, are all exposed on a CPU, as is the
    data-parallel reduction that GPUs overlap with the backward."""
    from dataclasses import replace

    from ptdp.config.enums import Recompute
    from ptdp.config.sections import ModelConfig
    from ptdp.perf.cost.collectives import gather_seconds, group_link
    from ptdp.perf.cost.costs import layer_seconds

    gpu = load_system("a100-80gb")  # no launches: a CPU pays them where a GPU hides them
    gpu = replace(gpu, device=replace(gpu.device, kernel_overhead=0.0))
    cpu = replace(gpu, device=replace(gpu.device, kind="cpu"))
    model = ModelConfig(num_layers=2, hidden_size=256, num_heads=4, seq_length=128, vocab_size=64)
    boundary = 4 * 128 * 256 * 2  # b s h, bf16
    gathers = 2 * gather_seconds(boundary, 2, group_link(gpu, 2, 1))
    for sp, extra in ((True, gathers), (False, 0.0)):
        on = {
            name: layer_seconds(
                model,
                micro_batch=4,
                tp=2,
                sequence_parallel=sp,
                recompute=Recompute.NONE,
                c=Compute(system, Precision.BF16, PTDP),
            )  # fmt: skip
            for name, system in (("gpu", gpu), ("cpu", cpu))
        }
        assert on["cpu"].f - on["gpu"].f == pytest.approx(extra)
        assert on["cpu"].b - on["gpu"].b == pytest.approx(extra)
        assert on["cpu"].w == pytest.approx(on["gpu"].w)
    # gloo writes a ring shift's send in the thread that posts it: on a CPU the cp ring's
    # transfers are all exposed; on GPUs they hide under the attention blocks.
    from ptdp.config.enums import CpComm
    from ptdp.perf.cost.context_costs import cp_comm_seconds

    long = replace(model, seq_length=4096)
    for system, hidden in ((gpu, True), (cpu, False)):
        c = Compute(system, Precision.BF16, PTDP)
        wire, exposed = cp_comm_seconds(long, micro_batch=1, tp=1, cp=2, comm=CpComm.RING, c=c)
        assert (exposed.f < wire.f) is hidden and (exposed.b < wire.b) is hidden
        if not hidden:
            assert (exposed.f, exposed.b) == pytest.approx((wire.f, wire.b))

    # The data-parallel reduction overlaps the backward on GPUs; over gloo its threads
    # need the backward's cores, so an overlapped step costs what an unoverlapped one does.
    from ptdp.config.files import apply_updates
    from ptdp.config.sections import RunConfig
    from ptdp.perf.simulate.simulator import simulate

    def step(system, overlap: bool) -> float:
        cfg = apply_updates(
            RunConfig(),
            {
                "model": {
                    "num_layers": 4,
                    "hidden_size": 256,
                    "num_heads": 4,
                    "seq_length": 64,
                    "vocab_size": 64,
                },  # fmt: skip
                "parallel": {"overlap_grad_reduce": overlap, "bucket_mb": 0.25},
                "train": {"micro_batch_size": 1, "global_batch_size": 2},
            },
            "test",
        )
        return simulate(cfg, system, 2, timeline=False).iteration_seconds

    assert step(gpu, True) < step(gpu, False)
    assert step(cpu, True) == pytest.approx(step(cpu, False))


def test_zero3_pays_the_sync_per_layer_gather_and_reduce_scatter() -> None:
    from dataclasses import replace

    from ptdp.config.files import apply_updates
    from ptdp.perf.cost.zero import sharded_passes
    from ptdp.perf.simulate.pipeline_costs import compute_costs
    from ptdp.perf.validate.paper import preset_config
    from ptdp.rules.layout import validate

    sync = 1e-3
    base = load_system("a100-80gb")
    synced = replace(base, device=replace(base.device, collective_sync=sync))
    train = {"precision": "bf16", "micro_batch_size": 1, "global_batch_size": 32}
    for zero, waits in ((3, (12, 24)), (2, (0, 1))):  # 12 layers a stage (pp = 2)
        cfg = apply_updates(
            preset_config("gpt-1.7b"), {"parallel": {"zero": zero, "pp": 2}, "train": train}, "t"
        )
        lay = validate(cfg, 16)
        got, without = (
            sharded_passes(cfg, lay, c, compute_costs(cfg, lay, c))[0]
            for c in (Compute(s, Precision.BF16, PTDP) for s in (synced, base))
        )
        for new, old in zip(got, without):
            assert new.f - old.f == pytest.approx(waits[0] * sync)
            assert (new.b + new.w) - (old.b + old.w) == pytest.approx(waits[1] * sync)

    # Over gloo no compute hides them: a step's passes carry all its bytes' seconds.
    cpu = replace(base, device=replace(base.device, kind="cpu"))
    c = Compute(cpu, Precision.BF16, PTDP)
    for zero in (2, 3):
        cfg = apply_updates(
            preset_config("gpt-1.7b"), {"parallel": {"zero": zero}, "train": train}, "t"
        )
        lay = validate(cfg, 8)
        plain = compute_costs(cfg, lay, c)
        sharded, wire = sharded_passes(cfg, lay, c, plain)
        exposed = sum(n.f + n.b + n.w - (o.f + o.b + o.w) for n, o in zip(sharded, plain))
        assert lay.num_microbatches * exposed == pytest.approx(wire)


def test_each_collective_may_carry_its_own_link_figures(tmp_path: Path) -> None:
    """`<op>_latency_us` / `<op>_bandwidth_gb_s` for all_reduce, all_gather and
    reduce_scatter in a link table (written by `ptdp calibrate` from each collective's own
    fit) price that collective; the others keep the link's figures; given alone or
    impossible, they are refused."""
    from ptdp.errors import ConfigError
    from ptdp.perf.cost.collectives import all_reduce_seconds, gather_seconds

    text = (ROOT / "ptdp/perf/cost/hardware/a100-80gb.toml").read_text()
    base = load_system("a100-80gb").intra
    assert base.ops == ()  # absent: every collective at the link's figures
    path = tmp_path / "ops.toml"
    keys = "[node]\nreduce_scatter_latency_us = 500\nreduce_scatter_bandwidth_gb_s = 0.5"
    path.write_text(text.replace("[node]", keys, 1))
    link = load_system(path).intra
    n = 8e6
    assert gather_seconds(n, 2, link, "reduce_scatter") == pytest.approx(
        500e-6 + link.step_latency + n / 2 / 0.5e9
    )
    assert gather_seconds(n, 2, link) == pytest.approx(gather_seconds(n, 2, base))
    assert all_reduce_seconds(n, 2, link) == pytest.approx(all_reduce_seconds(n, 2, base))
    for bad, why in (
        ("[node]\nall_gather_latency_us = 100", "go together"),
        ("[node]\nall_reduce_latency_us = 1\nall_reduce_bandwidth_gb_s = -1", "must be > 0"),
    ):
        path.write_text(text.replace("[node]", bad, 1))
        with pytest.raises(ConfigError, match=why):
            load_system(path)


def test_point_to_point_keys_price_transfers_apart(tmp_path: Path) -> None:
    """`p2p_latency_us` / `p2p_bandwidth_gb_s` in a link table (written by `ptdp calibrate`
    from its point-to-point fit) price pipeline transfers and cp ring shifts instead of the
    ring collectives' latency and bandwidth; given alone or impossible, they are refused;
    each pipeline hop also pays the sync of the wait on it."""
    from dataclasses import replace

    from ptdp.config.files import apply_updates
    from ptdp.errors import ConfigError
    from ptdp.perf.simulate.pipeline_costs import pipeline_costs
    from ptdp.perf.validate.paper import preset_config
    from ptdp.rules.layout import validate

    text = (ROOT / "ptdp/perf/cost/hardware/a100-80gb.toml").read_text()
    assert load_system("a100-80gb").intra.p2p is None  # absent: as the collectives
    path = tmp_path / "p2p.toml"
    keys = "[node]\np2p_latency_us = 100\np2p_bandwidth_gb_s = 4"
    path.write_text(text.replace("[node]", keys))
    link = load_system(path).intra
    assert link.p2p == pytest.approx((100e-6, 4e9))
    assert link.transfer_seconds(8e6) == pytest.approx(100e-6 + 8e6 / 4e9)
    for bad, why in (
        ("[node]\np2p_latency_us = 100", "go together"),
        ("[node]\np2p_latency_us = 100\np2p_bandwidth_gb_s = 0", "must be > 0"),
    ):
        path.write_text(text.replace("[node]", bad))
        with pytest.raises(ConfigError, match=why):
            load_system(path)

    base = load_system("a100-80gb")
    synced = replace(base, device=replace(base.device, collective_sync=1e-3))
    train = {"precision": "bf16", "micro_batch_size": 1, "global_batch_size": 8}
    cfg = apply_updates(preset_config("gpt-1.7b"), {"parallel": {"pp": 2}, "train": train}, "t")
    lay = validate(cfg, 2)
    got, without = (
        pipeline_costs(cfg, lay, Compute(s, Precision.BF16, PTDP)) for s in (synced, base)
    )
    sent = [a - b for a, b in zip(got.send_forward, without.send_forward)]
    assert sent == pytest.approx([1e-3, 1e-3])
