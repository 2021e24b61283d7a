"""A calibrated device prices a layer's memory-bound kernels one by one, each at its own
bandwidth for the bytes a call moves, and its fused attention on the measured curve over the
work per sequence and head; files without those tables (the built-in GPUs) keep the single
terms (ptdp/perf/cost/kernels.py, Device.attention_at)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ptdp.config.enums import Activation, Normalization, Precision, Recompute
from ptdp.config.sections import ModelConfig
from ptdp.errors import ConfigError
from ptdp.perf.cost.costs import Compute, attention_core, layer_seconds
from ptdp.perf.cost.hardware import GB
from ptdp.perf.cost.hardware_file import BUILTIN_DIR, load_system
from ptdp.perf.cost.kernels import layer_calls, layer_traffic
from ptdp.perf.cost.layer_bytes import layer_activation_bytes
from ptdp.perf.cost.software import PTDP

MODEL = ModelConfig(num_layers=2, hidden_size=128, num_heads=4, seq_length=128, vocab_size=256)
KERNELS = """
[device.achieved.memory_kernels]
layer_norm = [[1e5, 20.0], [1e7, 20.0], [1e8, 2.0]]
layer_norm_backward = [[1e5, 10.0]]
gelu = [[1e5, 4.0]]
gelu_backward = [[1e5, 5.0]]
add = [[1e5, 80.0]]
"""


def _file(tmp_path: Path, extra: str, achieved: str = "") -> Path:
    text = (BUILTIN_DIR / "a100-80gb.toml").read_text()
    marker = "[device.achieved]\n"
    path = tmp_path / "calibrated.toml"
    path.write_text(text.replace(marker, marker + achieved) + extra)
    return path


def _bytes(calls: list, kernel: str) -> float:
    return sum(c.count * c.nbytes for c in calls if c.kernel == kernel)


def test_the_calls_of_a_gelu_layer_move_what_the_runtime_moves() -> None:
    e, n, h, f = 4, 4 * 128, 128, 512
    forward, backward = layer_calls(MODEL, micro_batch=4, tp=1, sequence_parallel=False, e=e)
    x = n * h * e
    assert _bytes(forward, "layer_norm") == 2 * 2 * x  # two norms, a read and a write
    assert _bytes(forward, "gelu") == 2 * n * f * e
    # residual adds (2 x 3), bias adds (2 x 2), the copies to heads and back (2 x 2), and
    # addmm's bias broadcast into the QKV and MLP-in outputs (written once)
    assert _bytes(forward, "add") == (6 + 4 + 4) * x + 3 * x + n * f * e
    assert _bytes(backward, "layer_norm_backward") == 2 * 3 * x
    assert _bytes(backward, "gelu_backward") == 3 * n * f * e
    qkv = 3 * x
    bias = qkv + 2 * x + n * f * e
    assert _bytes(backward, "add") == 6 * x + 4 * x + (3 + 2 + 6) * qkv + bias


def test_tensor_and_sequence_parallelism_split_what_each_rank_moves() -> None:
    one = layer_calls(MODEL, micro_batch=4, tp=1, sequence_parallel=False, e=2)
    tp = layer_calls(MODEL, micro_batch=4, tp=2, sequence_parallel=False, e=2)
    sp = layer_calls(MODEL, micro_batch=4, tp=2, sequence_parallel=True, e=2)
    assert _bytes(tp[0], "gelu") == _bytes(one[0], "gelu") / 2  # the MLP is split
    assert _bytes(tp[0], "layer_norm") == _bytes(one[0], "layer_norm")  # norms replicated
    assert _bytes(sp[0], "layer_norm") == _bytes(one[0], "layer_norm") / 2  # ... or not


def test_swiglu_rmsnorm_and_dropout_layers_run_their_own_kernels() -> None:
    llama = replace(
        MODEL, activation=Activation.SWIGLU, normalization=Normalization.RMSNORM, bias=False
    )
    forward, backward = layer_calls(llama, micro_batch=1, tp=1, sequence_parallel=False, e=2)
    names = {c.kernel for c in forward + backward}
    assert names == {"rms_norm", "rms_norm_backward", "silu", "silu_backward", "add"}
    f = 128 * llama.ffn_size * 2
    assert _bytes(forward, "silu") == 2 * f and _bytes(backward, "silu_backward") == 3 * f
    dropped = layer_calls(
        replace(MODEL, dropout=0.1), micro_batch=1, tp=1, sequence_parallel=False, e=2
    )
    plain = layer_calls(MODEL, micro_batch=1, tp=1, sequence_parallel=False, e=2)
    x = 128 * 128 * 2
    assert _bytes(dropped[0], "add") - _bytes(plain[0], "add") == 2 * (2 * x + x / 2)


def test_each_kernel_is_priced_at_its_own_bandwidth_for_its_size(tmp_path: Path) -> None:
    device = load_system(_file(tmp_path, KERNELS)).device
    # log-linear between knots, flat outside them
    assert device.kernel_bandwidth("layer_norm", 1e3) == pytest.approx(20 * GB)
    assert device.kernel_bandwidth("layer_norm", 10**7.5) == pytest.approx(11 * GB)
    assert device.kernel_bandwidth("layer_norm", 1e9) == pytest.approx(2 * GB)
    # a kernel the file does not hold: what streaming kernels reach
    assert device.kernel_bandwidth("silu", 1e6) == device.memory_bandwidth * 0.85
    forward, backward = layer_calls(MODEL, micro_batch=4, tp=1, sequence_parallel=False, e=4)
    f, b = layer_traffic(
        MODEL, micro_batch=4, tp=1, sequence_parallel=False, e=4, device=device
    )  # every call of this layer is under 1e7 bytes: the flat start of each curve
    rates = {"layer_norm": 20, "gelu": 4, "add": 80, "layer_norm_backward": 10}
    rates["gelu_backward"] = 5
    assert f == pytest.approx(sum(_bytes(forward, k) / (r * GB) for k, r in rates.items()))
    assert b == pytest.approx(sum(_bytes(backward, k) / (r * GB) for k, r in rates.items()))


def test_a_calibrated_layer_uses_the_kernels_and_a_built_in_one_keeps_its_term(
    tmp_path: Path,
) -> None:
    kw = dict(micro_batch=4, tp=1, sequence_parallel=False, recompute=Recompute.NONE)
    calibrated = Compute(load_system(_file(tmp_path, KERNELS)), Precision.FP32, PTDP)
    built_in = Compute(load_system("a100-80gb"), Precision.FP32, PTDP)
    priced = layer_seconds(MODEL, c=calibrated, **kw)
    old = layer_seconds(MODEL, c=built_in, **kw)
    f, b = layer_traffic(
        MODEL, micro_batch=4, tp=1, sequence_parallel=False, e=4, device=calibrated.system.device
    )
    launches, ratio = PTDP.elementwise_kernels, PTDP.backward_traffic_ratio
    stored = layer_activation_bytes(MODEL, micro_batch=4, precision=Precision.FP32)
    term = stored * PTDP.elementwise_traffic / built_in.bandwidth
    # the same GEMMs and attention on the same A100 file, only the memory-bound term differs
    # (each with the launches it does not hide: `Compute.launched`)
    assert priced.f - calibrated.launched(f, launches) == pytest.approx(
        old.f - built_in.launched(term, launches)
    )
    assert priced.b - calibrated.launched(b, ratio * launches) == pytest.approx(
        old.b - built_in.launched(ratio * term, ratio * launches)
    )
    assert priced.w == old.w


def _attention_file(tmp_path: Path) -> Path:
    curve = (
        "attention_efficiency = 0.6\nattention_backward_ratio = 2.0\n"
        "attention_curve_flops = [1e6, 1e8]\n"
        "attention_curve_efficiency = [0.2, 0.6]\n"
        "attention_curve_backward_efficiency = [0.1, 0.6]\n"
    )
    return _file(tmp_path, "", curve)


def test_attention_runs_on_the_measured_curve_of_work_per_head(tmp_path: Path) -> None:
    device = load_system(_attention_file(tmp_path)).device
    # backward / forward time = 2.5 x forward efficiency / backward efficiency
    assert device.attention_at(1e5) == pytest.approx((0.2, 5.0))
    assert device.attention_at(1e7) == pytest.approx((0.4, 2.5 * 0.4 / 0.35))
    assert device.attention_at(1e9) == pytest.approx((0.6, 2.5))
    c = Compute(load_system(_attention_file(tmp_path)), Precision.BF16, PTDP)
    for seq in (64, 512, 4096):
        model = replace(MODEL, seq_length=seq)
        core = attention_core(model, 2, 1, c)
        per_head = 2.0 * seq * seq * model.head_dim  # causal QK^T and PV per head
        eff, ratio = device.attention_at(per_head)
        flops = per_head * 2 * model.num_heads
        assert core.f == pytest.approx(max(flops / (312e12 * eff), device.kernel_overhead))
        assert core.b == pytest.approx(ratio * core.f)
    short, long = (attention_core(replace(MODEL, seq_length=s), 1, 1, c) for s in (64, 4096))
    # per FLOP, a short sequence runs slower than a long one
    assert short.f / 64**2 > long.f / 4096**2


@pytest.mark.parametrize(
    "extra,achieved,match",
    [
        ("\n[device.achieved.memory_kernels]\nadd = [[1e6, 5.0], [1e5, 6.0]]\n", "", "add"),
        ("\n[device.achieved.memory_kernels]\nadd = [[1e6, 0.0]]\n", "", "add"),
        ("\n[device.achieved.memory_kernels]\nadd = []\n", "", "add"),
        (
            "",
            "attention_curve_flops = [1e6, 1e8]\nattention_curve_efficiency = [0.2]\n"
            "attention_curve_backward_efficiency = [0.2, 0.2]\n",
            "attention_curve",
        ),
        (
            "",
            "attention_curve_flops = [1e6, 1e8]\nattention_curve_efficiency = [0.6, 0.2]\n"
            "attention_curve_backward_efficiency = [0.2, 0.2]\n",
            "attention curve",
        ),
    ],
)
def test_a_broken_kernel_or_attention_table_is_refused(
    tmp_path: Path, extra: str, achieved: str, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        load_system(_file(tmp_path, extra, achieved))


def test_each_microbatch_adds_its_gradients_into_the_buffers_in_a_pass_of_its_own(
    tmp_path: Path,
) -> None:
    """ptdp's gradient buffers take each microbatch's gradients in a pass of their own
    (`GradBuffers._on_grad`: the gradient read, the fp32 buffer read and written), the 2021
    code's into 16-bit buffers; Megatron-Core's weight-gradient GEMMs accumulate in place.
    Each stage's W pays it once a microbatch, one `add` call a parameter tensor at the
    stage's mean tensor size, so a step pays it m times per rank."""
    from ptdp.config.files import apply_updates
    from ptdp.config.sections import RunConfig
    from ptdp.perf.cost.costs import accumulation_seconds
    from ptdp.perf.cost.kernels import Call
    from ptdp.perf.cost.parameters import parameters_per_stage, tensors_per_stage
    from ptdp.perf.cost.software import MEGATRON_2021, MEGATRON_CORE
    from ptdp.perf.simulate.pipeline_costs import accumulation, pipeline_costs, stage_costs
    from ptdp.perf.simulate.simulator import simulate
    from ptdp.rules.layout import validate

    system = load_system(_file(tmp_path, KERNELS, "split_backward_ratio = 1.5\n"))
    assert system.device.split_backward_ratio == 1.5
    cfg = apply_updates(
        RunConfig(),
        {
            "model": {"num_layers": 4, "hidden_size": 128, "num_heads": 4, "seq_length": 128,
                      "vocab_size": 256},
            "parallel": {"pp": 2},
            "train": {"micro_batch_size": 2, "global_batch_size": 8, "precision": "bf16"},
        },
        "test",
    )  # fmt: skip
    layout = validate(cfg, 2)
    params, tensors = parameters_per_stage(cfg.model, 1, 2), tensors_per_stage(cfg.model, 2)
    ptdp = Compute(system, Precision.BF16, PTDP)
    for stage in (0, 1):  # bf16 gradient read, fp32 buffer read and written: 10 bytes
        want = Call("add", params[stage] * 10 / tensors[stage], tensors[stage])
        assert accumulation_seconds(params[stage], tensors[stage], ptdp) == pytest.approx(
            want.seconds(system.device)
        )
    megatron = Compute(system, Precision.BF16, MEGATRON_2021)  # 16-bit buffer: 6 bytes
    assert accumulation_seconds(1000, 10, megatron) == pytest.approx(
        Call("add", 600, 10).seconds(system.device)
    )
    assert accumulation_seconds(1000, 10, Compute(system, Precision.BF16, MEGATRON_CORE)) == 0
    # in each stage's W, not its F or B; under a split backward not scaled by its extra
    fused = replace(PTDP, accumulation_bytes=0)
    unfused = Compute(system, Precision.BF16, fused)
    for schedule in ("1f1b", "zb-h1"):
        split = apply_updates(cfg, {"parallel": {"schedule": schedule}}, "test")
        lay = validate(split, 2)
        got, without = pipeline_costs(split, lay, ptdp), pipeline_costs(split, lay, unfused)
        assert (got.forward, got.backward_input) == (without.forward, without.backward_input)
        for stage, (a, b) in enumerate(zip(got.backward_weight, without.backward_weight)):
            want = accumulation_seconds(params[stage], tensors[stage], ptdp)
            assert a - b == pytest.approx(want), schedule
        assert [p.w for p in stage_costs(split, lay, ptdp)] == pytest.approx(
            [
                p.w + a
                for p, a in zip(stage_costs(split, lay, unfused), accumulation(split, lay, ptdp))
            ]
        )
    # and a step pays it on every microbatch (1F1B, m = 4 a rank; the last stage's is larger)
    step = simulate(cfg, system, 2, layout=layout).iteration_seconds
    step_fused = simulate(cfg, system, 2, layout=layout, software=fused).iteration_seconds
    added = max(accumulation_seconds(n, k, ptdp) for n, k in zip(params, tensors))
    assert (
        4 * added * 0.99
        <= step - step_fused
        <= 4 * sum(accumulation_seconds(n, k, ptdp) for n, k in zip(params, tensors))
    )
