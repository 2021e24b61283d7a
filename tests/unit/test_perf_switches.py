"""The performance model prices train.cuda_graphs and train.attention_backend as set: CUDA
graphs drop the per-kernel launches of the compiled regions for one launch per replay, and
math attention costs the unfused core's time and memory; values derived by hand from the
device file's figures. The --software profiles keep their figures, and what a profile or
device cannot run is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ptdp.config.files import apply_updates as _apply
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.software import MEGATRON_2021, PTDP, Software
from ptdp.perf.cost.switches import run_software
from ptdp.perf.plan.planner import plan
from ptdp.perf.simulate.simulator import simulate
from ptdp.perf.validate.paper import TABLE_1
from ptdp.perf.validate.validation import check_row

H100 = load_system("h100-sxm")
A100 = load_system("a100-80gb")
L, H, A, S, B, M, V = 2, 64, 4, 32, 2, 2, 128  # layers, hidden, heads, seq, micro-batch, m, vocab


def apply_updates(cfg: RunConfig, updates: dict) -> RunConfig:
    return _apply(cfg, updates, "a test")


def tiny(**train: object) -> RunConfig:
    model = {"num_layers": L, "hidden_size": H, "num_heads": A, "seq_length": S}
    return apply_updates(
        RunConfig(),
        {
            "model": {**model, "vocab_size": V, "dropout": 0.0},
            "train": {"micro_batch_size": B, "global_batch_size": B * M, "precision": "bf16"}
            | train,
        },
    )


def device(kernel_overhead: float):
    """The H100 file priced by its single figures (no GEMM curve), launches of `kernel_overhead`."""
    d = replace(H100.device, gemm_curve=(), kernel_overhead=kernel_overhead)
    return replace(H100, device=d)


def test_cuda_graphs_drop_exactly_the_per_kernel_launches() -> None:
    """At 1 ms a launch every kernel of the tiny model is launch-bound. Eager, a layer's forward
    launches 4 GEMMs, the fused attention and 8 memory-bound kernels (13); its backward 4
    GEMMs, the attention's at 2.5 forwards and 8 x 1.6 memory-bound (19.3); its W 4 GEMMs.
    Graphed, the forward is one replay and the backward one: 2 launches. The loss region
    launches 3 GEMMs eager, and streams its memory-bound bytes without a launch; graphed,
    2 replays, whose launches hide those bytes."""
    o, e = 1e-3, 2
    system = device(o)
    eager = simulate(tiny(compile=True), system, 1)
    graphed = simulate(tiny(compile=True, cuda_graphs=True), system, 1)
    n = B * S  # tokens
    head_bytes = 2 * e * n * H + n * e * V  # final norm and output inputs, the compiled logits
    stream = 1.6 * head_bytes / (H100.device.memory_bandwidth * H100.device.memory_efficiency)
    per_microbatch = L * (13 + 19.3 + 4 - 2) * o + (3 - 2) * o + (1 + 1.6) * stream
    dropped = eager.iteration_seconds - graphed.iteration_seconds
    assert dropped == pytest.approx(M * per_microbatch, rel=1e-9)
    assert eager.layer.f == pytest.approx(13 * o) and graphed.layer.f == pytest.approx(o)
    assert graphed.layer.b + graphed.layer.w == pytest.approx(o)


def test_cuda_graphs_change_nothing_without_launch_bound_kernels() -> None:
    """Without a launch cost the graphed step costs what the compiled one does."""
    system = device(0.0)
    eager = simulate(tiny(compile=True), system, 1)
    graphed = simulate(tiny(compile=True, cuda_graphs=True), system, 1)
    assert graphed.iteration_seconds == pytest.approx(eager.iteration_seconds, rel=1e-12)


def test_cuda_graphs_memory_adds_the_inputs_copied_into_the_pool() -> None:
    """The eager embedding's output [s, b, h] (bf16) and the int64 labels [b, s]."""
    eager = simulate(tiny(compile=True), H100, 1).memory[0]
    graphed = simulate(tiny(compile=True, cuda_graphs=True), H100, 1).memory[0]
    assert graphed.activations - eager.activations == 2 * S * B * H + 8 * S * B
    assert graphed.working == eager.working


def test_math_attention_prices_the_unfused_core() -> None:
    """With no launch cost: the core's two batched GEMMs per pass at the GEMM efficiency and
    their operands through HBM, against the fused kernel's causal half at the attention
    efficiency; plus the soft-maxed scores streamed (1.6 bytes per byte stored forward,
    1.6 x that backward). Each backward GEMM moves and computes what its forward does."""
    system, e = device(0.0), 2
    d, heads = H // A, B * A  # head size; sequences x heads of one microbatch
    dev = H100.device
    peak, bw = dev.peak_flops("bf16"), dev.memory_bandwidth * dev.memory_efficiency
    unfused = 4 * S * S * d * heads / (peak * dev.gemm_efficiency)
    unfused += e * heads * (4 * S * d + 2 * S * S) / bw
    fused = 0.5 * 4 * S * S * d * heads / (peak * dev.attention_efficiency)
    scores = 1.6 * e * heads * S * S / bw
    fused_layer = simulate(tiny(), system, 1).layer
    math_layer = simulate(tiny(attention_backend="math"), system, 1).layer
    assert math_layer.f - fused_layer.f == pytest.approx(unfused - fused + scores, rel=1e-9)
    assert math_layer.b - fused_layer.b == pytest.approx(
        2 * unfused - 2.5 * fused + 1.6 * scores, rel=1e-9
    )
    assert math_layer.w == fused_layer.w
    unfused_software = simulate(tiny(), system, 1, software=replace(PTDP, fused_attention=False))
    assert math_layer == unfused_software.layer  # the unfused core's pricing, nothing else


def test_math_attention_on_a_calibrated_device_adds_the_cores_kernels() -> None:
    """Where each memory-bound kernel has its measured bandwidth, the unfused core adds its
    own calls on the S bytes of scores: the causal mask (S in and out) at the streaming rate
    and the softmax (S in and out) at its measured one forward; the softmax's backward
    (3 S) at its own."""
    rates = ((1.0, 100e9), (1e12, 100e9)), ((1.0, 40e9), (1e12, 40e9))
    kernels = (("softmax", rates[0]), ("softmax_backward", rates[1]))
    system = device(0.0)
    system = replace(system, device=replace(system.device, memory_kernels=kernels))
    e, d, heads = 2, H // A, B * A
    dev = H100.device
    peak, bw = dev.peak_flops("bf16"), dev.memory_bandwidth * dev.memory_efficiency
    unfused = 4 * S * S * d * heads / (peak * dev.gemm_efficiency)
    unfused += e * heads * (4 * S * d + 2 * S * S) / bw
    fused = 0.5 * 4 * S * S * d * heads / (peak * dev.attention_efficiency)
    scores = e * heads * S * S  # bytes of [b, a, s, s]
    fused_layer = simulate(tiny(), system, 1).layer
    math_layer = simulate(tiny(attention_backend="math"), system, 1).layer
    calls_f = 2 * scores / bw + 2 * scores / 100e9
    assert math_layer.f - fused_layer.f == pytest.approx(unfused - fused + calls_f, rel=1e-9)
    calls_b = 3 * scores / 40e9
    assert math_layer.b - fused_layer.b == pytest.approx(
        2 * unfused - 2.5 * fused + calls_b, rel=1e-9
    )


@pytest.mark.parametrize("compile_", [False, True])
def test_math_attention_memory_adds_the_scores(compile_: bool) -> None:
    """Per layer the soft-maxed scores [b, a, s, s] in bf16; eager PyTorch's math kernel also
    keeps q and k scaled (two [s, b, h] copies). Selective recomputation keeps neither."""
    fused = simulate(tiny(compile=compile_), H100, 1).memory[0]
    math = simulate(tiny(compile=compile_, attention_backend="math"), H100, 1).memory[0]
    extra = 2 * B * A * S * S + (0 if compile_ else 2 * 2 * S * B * H)
    assert math.activations - fused.activations == L * extra
    selective = {"recompute": "selective"}
    kept = [
        simulate(apply_updates(tiny(attention_backend=b), {"parallel": selective}), H100, 1)
        for b in ("auto", "math")
    ]
    assert kept[0].memory[0].activations == kept[1].memory[0].activations


@pytest.mark.parametrize("backend", ["auto", "flash", "cudnn", "efficient"])
def test_fused_kernels_are_priced_alike(backend: str) -> None:
    base = simulate(tiny(), H100, 1)
    chosen = simulate(tiny(attention_backend=backend), H100, 1)
    assert chosen.iteration_seconds == base.iteration_seconds
    assert chosen.memory == base.memory


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_megatron_2021_keeps_its_unfused_core_and_refuses_what_it_lacked(recompute: str) -> None:
    """Its own unfused core is not PyTorch's math kernel: math changes neither time nor memory."""
    cfg = apply_updates(tiny(), {"parallel": {"recompute": recompute}})
    base = simulate(cfg, A100, 1, software=MEGATRON_2021)
    math = simulate(apply_updates(cfg, {"train": {"attention_backend": "math"}}), A100, 1,
                    software=MEGATRON_2021)  # fmt: skip
    assert (math.iteration_seconds, math.memory) == (base.iteration_seconds, base.memory)
    with pytest.raises(ConfigError, match="attention_backend = flash is a fused kernel"):
        simulate(apply_updates(cfg, {"train": {"attention_backend": "flash"}}), A100, 1,
                 software=MEGATRON_2021)  # fmt: skip
    graphs = apply_updates(cfg, {"train": {"compile": True, "cuda_graphs": True}})
    with pytest.raises(ConfigError, match="set --train.cuda_graphs false or --software ptdp"):
        simulate(graphs, A100, 1, software=MEGATRON_2021)


def test_a_cpu_device_file_refuses_graphs_and_cuda_kernels() -> None:
    cpu = replace(H100, name="laptop", device=replace(H100.device, kind="cpu"))
    with pytest.raises(ConfigError, match="needs a CUDA device, and the device file laptop"):
        simulate(tiny(compile=True, cuda_graphs=True), cpu, 1)
    with pytest.raises(ConfigError, match="cudnn is a CUDA kernel, and the device file laptop"):
        simulate(tiny(attention_backend="cudnn"), cpu, 1)


def test_table_1_figures_are_unchanged() -> None:
    """megatron-2021 ran the unfused core without graphs: each row's planned config predicts
    the same step with `math` named, and the defaults price no graph replay."""
    for row in TABLE_1:
        option = check_row(row, A100).option
        assert not option.config.train.cuda_graphs
        math = apply_updates(option.config, {"train": {"attention_backend": "math"}})
        again = simulate(math, A100, row.gpus, software=MEGATRON_2021, timeline=False)
        assert again.tflops_per_device == pytest.approx(option.prediction.tflops_per_device)


def test_the_planner_keeps_the_users_switches() -> None:
    """It prices them as set and searches only layouts that can run them (pp = 1 for graphs)."""
    cfg = apply_updates(tiny(compile=True, cuda_graphs=True), {"train": {"global_batch_size": 8}})
    result = plan(cfg, gpus=2, system=H100, schedules=("1f1b",), top=3)
    assert result.options
    assert any("parallel.pp = 2 (a pipeline" in r.reason for r in result.rejected)
    for option in result.options:
        assert option.config.train.cuda_graphs and option.prediction.layout.pp == 1
        again = simulate(option.config, H100, 2).iteration_seconds
        assert option.prediction.iteration_seconds == pytest.approx(again, rel=1e-12)
    math = plan(tiny(attention_backend="math"), gpus=1, system=H100, top=1)
    assert all(o.config.train.attention_backend.value == "math" for o in math.options)


def test_run_software_is_the_profile_with_the_runs_switches() -> None:
    got = run_software(tiny(compile=True, cuda_graphs=True, attention_backend="math"), PTDP, H100)
    assert got == replace(PTDP, fused_attention=False, math_kernel=True, cuda_graphs=True)
    assert run_software(tiny(), PTDP, H100) == PTDP
    assert isinstance(got, Software)
