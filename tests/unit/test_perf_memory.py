"""Memory per device: model state conventions, Korthikanti's activations, in-flight counts,
and the whole estimate against what single-process CPU runs really hold."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ptdp.config.enums import Precision, Recompute
from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.model.gpt import GPT
from ptdp.parallel.comm import Group
from ptdp.perf.cost.layer_bytes import (
    head_activation_bytes,
    head_backward_bytes,
    layer_activation_bytes,
    layer_backward_bytes,
)
from ptdp.perf.cost.memory import estimate_memory, in_flight, stage_in_flight
from ptdp.perf.cost.parameters import (
    bytes_per_parameter,
    parameters_per_rank,
    tensors_per_rank,
    tensors_per_stage,
)
from ptdp.perf.cost.stash import split_peak, stage_stash_bytes, stash_bytes_per_layer
from ptdp.perf.validate.paper import preset
from ptdp.perf.validate.validation import measure_cpu_memory
from ptdp.pipeline.partition import layer_ranges
from ptdp.pipeline.placement import StageMap
from ptdp.pipeline.plan import build_plan
from ptdp.pipeline.verify import verify
from tests.helpers import LLAMA


def config(**sections: dict) -> RunConfig:
    return apply_updates(RunConfig(), sections, "test")


def test_model_state_bytes_per_parameter() -> None:
    mixed = bytes_per_parameter(Precision.BF16)
    assert (mixed.params, mixed.grads, mixed.optimizer) == (2, 4, 12)  # 18 B in all
    sharded = bytes_per_parameter(Precision.BF16, zero=1, dp=8)
    assert sharded.params + sharded.grads + sharded.optimizer == 6 + 12 / 8
    full = bytes_per_parameter(Precision.FP32, zero=1, dp=4)
    assert (full.params, full.grads, full.optimizer) == (4, 4, 2)
    zero2 = bytes_per_parameter(Precision.BF16, zero=2, dp=8)  # 2 + 16 / d (ZeRO paper)
    assert (zero2.params, zero2.grads, zero2.optimizer) == (2, 0.5, 1.5)
    zero3 = bytes_per_parameter(Precision.BF16, zero=3, dp=8)  # every part / d
    assert (zero3.params, zero3.grads, zero3.optimizer) == (0.25, 0.5, 1.5)
    assert bytes_per_parameter(Precision.FP32, zero=2, dp=1) == bytes_per_parameter(Precision.FP32)


@pytest.mark.parametrize("options", [{}, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize(("tp", "pp", "vpp"), [(1, 1, 1), (1, 2, 2), (2, 1, 1), (4, 2, 1)])
def test_parameters_per_rank_match_the_model_chunks(options, tp, pp, vpp) -> None:
    model = config(
        model={"num_layers": 4, "hidden_size": 32, "num_heads": 4, "vocab_size": 50, **options}
    ).model
    ranges, held = layer_ranges(4, pp, vpp), [0] * pp
    for stage, layers in enumerate(ranges):
        chunk = GPT(
            model,
            layers=layers,
            has_embedding=stage == 0,
            has_head=stage == len(ranges) - 1,
            tp=Group(None, tp, 0) if tp > 1 else None,  # shapes only: no collective runs
        )
        held[StageMap(pp, vpp).rank(stage)] += sum(p.numel() for p in chunk.parameters())
    assert parameters_per_rank(model, tp, pp, vpp) == held


def test_activations_reduce_to_korthikanti_table() -> None:
    # 16-bit with dropout masks, f = 4h, no fused attention: the paper's table exactly.
    m = preset("gpt3-175b")
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    kw = dict(micro_batch=b, tp=t, precision=Precision.BF16, fused_attention=False)
    sbh = s * b * h
    assert layer_activation_bytes(m, **kw) == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t))
    )
    assert layer_activation_bytes(m, sequence_parallel=True, **kw) == pytest.approx(
        sbh * (34 / t + 5 * a * s / (h * t))
    )
    sel = layer_activation_bytes(m, recompute=Recompute.SELECTIVE, **kw)
    assert sel == pytest.approx(sbh * (10 + 24 / t))
    assert layer_activation_bytes(m, recompute=Recompute.FULL, **kw) == 2 * sbh
    # Fused attention keeps no s x s tensor: what selective recomputation keeps.
    fused = {**kw, "fused_attention": True}
    assert layer_activation_bytes(m, **fused) == sel
    # Korthikanti et al.: selective recomputation saves 70% for GPT-3 (5as/h = 80 against 34).
    sp = {**kw, "sequence_parallel": True}
    saved = 1 - layer_activation_bytes(m, recompute=Recompute.SELECTIVE, **sp) / (
        layer_activation_bytes(m, **sp)
    )
    assert saved == pytest.approx(0.70, abs=0.005)


def test_interleaved_first_stage_holds_korthikanti_factor() -> None:
    # First stage under interleaving: 1F1B's activations x (1 + (p-1)/(p v)).
    for pp, vpp, m in [(4, 2, 8), (8, 2, 16), (4, 4, 8)]:
        one = in_flight(build_plan("1f1b", pp, m))[0] * 1  # layers/rank = vpp
        inter = in_flight(build_plan("interleaved", pp, m, vpp))[0] / vpp
        assert inter / one == pytest.approx(1 + (pp - 1) / (pp * vpp))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved", "zb-v"])
def test_in_flight_is_what_the_verifier_counts(name: str) -> None:
    # Both count a microbatch from its F until its BW, or its W when the backward is split.
    # tests/dist/test_pipeline_memory.py measures the same peaks on the runtime.
    for pp in (1, 2, 3, 4, 8):
        vpp = 2 if name in ("interleaved", "zb-v") else 1
        for m in {pp, 2 * pp, 4 * pp} | ({1, pp + 1} if vpp == 1 else set()):
            plan = build_plan(name, pp, m, vpp)
            peaks = verify(plan.compute, plan.stages, m).peak_in_flight
            assert in_flight(plan) == peaks
            if vpp == 1:  # one stage per rank: the last stage's count is the last rank's
                assert stage_in_flight(plan, pp - 1) == peaks[-1]


def test_split_backward_holds_until_w() -> None:
    # ZB-H1 on the last rank of pp = 2, m = 3: "1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1W2" holds
    # microbatches 0 and 1 (B run, W not) when F2 runs: 2, not 1F1B's 1.
    plan = build_plan("zb-h1", 2, 3)
    assert stage_in_flight(plan, 1) == 2 and in_flight(plan) == (2, 2)
    assert in_flight(build_plan("1f1b", 2, 3)) == (2, 1)
    assert in_flight(build_plan("zb-h2", 2, 3)) == (3, 3)


def test_estimate_scales_with_layout() -> None:
    base = config(
        model=preset("gpt3-175b").__dict__,
        parallel={"tp": 8, "pp": 16, "recompute": "full"},
        train={"precision": "bf16", "micro_batch_size": 1, "global_batch_size": 1536},
    )
    ranks = estimate_memory(base, 1024)
    assert len(ranks) == 16
    first = ranks[0]
    assert first.in_flight == 16  # 1F1B on rank 0: p microbatches
    params = parameters_per_rank(base.model, 8, 16)[0]
    assert (first.params, first.grads, first.optimizer) == (2 * params, 4 * params, 12 * params)
    # Full recompute: the inputs of 6 layers x 16 microbatches, 2 s b h bytes each.
    assert first.activations == 16 * 6 * 2 * 2048 * 12288
    dist = estimate_memory(apply_updates(base, {"optim": {"distributed": True}}, "t"), 1024)[0]
    assert dist.optimizer == pytest.approx(first.optimizer / 8)  # d = 8
    assert dist.grads == first.grads and dist.grad_buckets == first.grad_buckets == 0
    ranks2 = estimate_memory(apply_updates(base, {"parallel": {"zero": 2}}, "t"), 1024)
    zero2 = ranks2[0]
    assert (zero2.grads, zero2.optimizer) == (first.grads / 8, dist.optimizer)
    assert ranks2[1].grad_buckets == 2 * 25 * 2**20  # two 25 MiB buckets in flight
    embedding = 4 * 51200 // 8 * 12288  # the tied embedding's bucket, full over the step
    assert zero2.grad_buckets == 2 * 25 * 2**20 + embedding
    assert zero2.total < dist.total
    # A split backward leaves gradients in every bucket until W: the whole stage in flight.
    zb = apply_updates(base, {"parallel": {"zero": 2, "schedule": "zb-h1"}}, "t")
    assert estimate_memory(zb, 1024)[0].grad_buckets == 4 * params


@pytest.mark.parametrize("options", [{}, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize(("schedule", "m"), [("1f1b", 2), ("gpipe", 3)])
def test_estimate_within_15_percent_of_a_cpu_run(options, recompute, schedule, m) -> None:
    cfg = config(
        model={
            "num_layers": 2,
            "hidden_size": 64,
            "num_heads": 4,
            "seq_length": 32,
            "vocab_size": 64,
            **options,
        },
        parallel={"recompute": recompute, "schedule": schedule},
        train={"micro_batch_size": 4, "global_batch_size": 4 * m, "precision": "fp32"},
    )
    state, activations = measure_cpu_memory(cfg, schedule, m)
    est = estimate_memory(cfg, 1)[0]  # CPU SDPA without dropout is a fused kernel
    assert est.in_flight == (m if schedule == "gpipe" else 1)
    assert est.params + est.grads + est.optimizer == state  # fp32: 4 + 4 + 8 B exactly
    assert est.activations == pytest.approx(activations, rel=0.15)
    total = est.params + est.grads + est.optimizer + est.activations
    assert total == pytest.approx(state + activations, rel=0.15)
    assert activations > 0.05 * state  # the activations are a real part of the total


def test_uneven_stages_scale_parameters_and_activations() -> None:
    sections = {
        "model": {"num_layers": 6, "hidden_size": 32, "num_heads": 4, "vocab_size": 50},
        "parallel": {"pp": 2},
        "train": {"micro_batch_size": 2, "global_batch_size": 8},
    }
    model, split = config(**sections).model, (2, 4)
    ranges, held = layer_ranges(6, 2, 1, split), [0, 0]
    for stage, layers in enumerate(ranges):
        chunk = GPT(model, layers=layers, has_embedding=stage == 0, has_head=stage == 1)
        held[stage] = sum(p.numel() for p in chunk.parameters())
    assert parameters_per_rank(model, 1, 2, 1, split) == held
    even = estimate_memory(config(**sections), 2)
    sections["parallel"] = {"pp": 2, "pipeline_layers": [2, 4]}
    uneven = estimate_memory(config(**sections), 2)
    # Rank 0 keeps the even split's 3 layers' activations minus one, rank 1 one more.
    per_layer = even[0].activations / (even[0].in_flight * 3)
    assert uneven[0].activations == pytest.approx(even[0].activations * 2 / 3)
    assert uneven[1].activations - even[1].activations == pytest.approx(
        even[1].in_flight * per_layer
    )


@pytest.mark.parametrize("options", [{}, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_split_backward_stash_matches_what_b_keeps_for_w(options, recompute) -> None:
    # What a CPU B keeps for W (`WeightGradStore` pairs and the other parameters'
    # gradients) is exactly the stage's stash: every linear layer's X and dY (B frees the
    # layer's other activations), the output layer's, and the other parameters' gradients.
    import torch

    cfg = config(
        model={
            "num_layers": 2,
            "hidden_size": 64,
            "num_heads": 4,
            "seq_length": 32,
            "vocab_size": 128,
            **options,
        },
        parallel={"recompute": recompute, "schedule": "zb-h1"},
        train={"micro_batch_size": 4, "global_batch_size": 8, "precision": "fp32"},
    )
    model = GPT(cfg.model, recompute=cfg.parallel.recompute)
    tokens = torch.randint(0, 128, (4, 32))
    with model.wgrad.capture():
        loss = model(tokens, tokens)
    params = list(model.parameters())
    with model.wgrad.deferring(0):
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    kept = [t for k in model.wgrad._pending[0] for t in (k.x, k.dy)]
    kept += [g for g in grads if g is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    assert sum(storages.values()) == stage_stash_bytes(cfg, 1, 1, 1, 0)
    # One rank (F B W per microbatch): the peak is one microbatch's activations or its stash.
    est = estimate_memory(cfg, 1)[0]
    one_f_one_b = estimate_memory(apply_updates(cfg, {"parallel": {"schedule": "1f1b"}}, "t"), 1)
    stash = stage_stash_bytes(cfg, 1, 1, 1, 0)
    assert est.activations + est.stash == max(one_f_one_b[0].activations, stash)


def test_split_peak_walks_the_actions() -> None:
    # ZB-H1, 2 ranks, 3 microbatches, stored 10 and stash 1 per (stage, microbatch): rank 0
    # runs F0 F1 B0 F2 ... and holds two forwards (20) before its first B; rank 1 one.
    plan = build_plan("zb-h1", 2, 3)
    assert split_peak(plan, 0, [10.0, 10.0], [1.0, 1.0])[::2] == (20.0, 2)
    acts, kept, held = split_peak(plan, 1, [10.0, 10.0], [1.0, 1.0])
    assert (acts, held) == (10.0, 1) and kept <= 2.0


def test_stash_bytes_by_hand() -> None:
    # GPT, one layer, s b = 128 tokens, h = 64, f = 256, fp32: dY of QKV [n, 3h], proj
    # [n, h], fc1 [n, f], fc2 [n, h]; X of QKV, proj, fc1 [n, h] and fc2 [n, f]; biases
    # 3h + f + 2h and two LayerNorms 4h. B frees the rest, with or without recomputation.
    model = config(model={"hidden_size": 64, "num_heads": 4, "seq_length": 32}).model
    kw = dict(micro_batch=4, precision=Precision.FP32)
    dy, x = 128 * (3 * 64 + 256 + 2 * 64), 128 * (3 * 64 + 256)
    per_layer = dy + x + (3 * 64 + 256 + 2 * 64 + 4 * 64)
    assert stash_bytes_per_layer(model, **kw) == 4 * per_layer
    assert stash_bytes_per_layer(model, recompute=Recompute.FULL, **kw) == 4 * per_layer


def test_backward_transients_at_the_peak() -> None:
    """What is in flight at the peak besides what is stored: one layer's backward gradients
    (compiled: dY, dX [n, h] and the larger of the MLP's [n, f/t] + [n, f/t] and attention's
    dQ, dK, dV, dO [n, 4h/t]; eager: dY [n, h], fc2's input gradient [n, f/t] and its
    weight's [h, f/t]), and on the last stage the loss's fp32 logit gradient with its
    16-bit copy, [n, v/t] (4 + 2) bytes, when that is larger."""
    cfg = config(
        model={
            "num_layers": 4,
            "hidden_size": 64,
            "num_heads": 4,
            "vocab_size": 1000,
            "seq_length": 32,
        },
        parallel={"tp": 2, "pp": 2},
        train={"precision": "bf16", "micro_batch_size": 2, "global_batch_size": 4},
    )
    n, h, f, t = 64, 64, 256, 2
    compiled = 2 * n * (2 * h + max(2 * f // t, 4 * h // t))
    assert layer_backward_bytes(cfg.model, micro_batch=2, tp=2) == compiled
    layer = 2 * (n * (h + f // t) + h * f // t)
    assert layer_backward_bytes(cfg.model, micro_batch=2, tp=2, eager=True) == layer
    vocab = cfg.model.padded_vocab_size(t)
    head = n * vocab // t * 6
    assert head_backward_bytes(cfg.model, micro_batch=2, tp=2) == head
    first, last = estimate_memory(cfg, 4)
    assert first.working == layer  # no recomputation: nothing else is transient
    assert last.working == max(layer, head) == head
    assert last.total - last.working == pytest.approx(
        last.params + last.grads + last.optimizer + last.activations
    )


def _gpt2(**train: object) -> RunConfig:
    model = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "vocab_size": 1000}
    model["seq_length"] = 32
    train = {"precision": "bf16", "micro_batch_size": 2, "global_batch_size": 2, **train}
    return config(model=model, train=train)


def test_eager_16_bit_norms_keep_their_fp32_inputs() -> None:
    """CUDA autocast runs the norms in fp32: eager 16-bit training keeps each norm input's
    fp32 copy (2 more bytes per element of each, the final norm's too); compiled layers keep
    16-bit tensors, and Megatron's fused LayerNorm (its `Software`) keeps 16-bit inputs."""
    cfg = _gpt2()
    n, h, v, vp = 64, 64, 1000, cfg.model.padded_vocab_size(1)
    kw = dict(micro_batch=2, precision=Precision.BF16)
    plain = layer_activation_bytes(cfg.model, **kw)
    assert layer_activation_bytes(cfg.model, autocast_norms=True, **kw) == plain + 2 * 2 * n * h
    fp32 = dict(micro_batch=2, precision=Precision.FP32)
    assert layer_activation_bytes(cfg.model, autocast_norms=True, **fp32) == (
        layer_activation_bytes(cfg.model, **fp32)
    )
    assert (
        head_activation_bytes(cfg.model, autocast_norms=True, **kw) == (4 + 2) * n * h + 4 * n * v
    )
    assert head_activation_bytes(cfg.model, compiled=True, **kw) == 2 * 2 * n * h + 2 * n * vp
    eager = estimate_memory(cfg, 1)[0]
    compiled = estimate_memory(_gpt2(compile=True), 1)[0]
    megatron = estimate_memory(cfg, 1, autocast_norms=False)[0]
    norms = 2 * (2 * 2 * n * h) + 2 * n * h  # two layers' two norms, and the final norm
    assert eager.activations - megatron.activations == pytest.approx(norms)
    logits = 4 * n * v - 2 * n * vp  # fp32 log-probabilities against padded 16-bit logits
    assert eager.activations - compiled.activations == pytest.approx(norms + logits)


def test_the_loss_backward_holds_what_its_kernels_allocate() -> None:
    """tp = 1: eager, log_softmax's backward holds two fp32 [n, v] gradients (its input's
    and its output's), and in fp32 the padded copy beside the unpadded one is more; compiled,
    the logits' gradient reuses the saved logits' buffer and only the output weight's 16-bit
    gradient is new. The last stage's transient is the larger of that and a layer's backward
    less the head's stored tensors, freed by then."""
    cfg = _gpt2()
    n, h, v, vp = 64, 64, 1000, cfg.model.padded_vocab_size(1)
    assert vp > v
    kw = dict(micro_batch=2)
    assert head_backward_bytes(cfg.model, **kw) == 8 * n * v
    assert head_backward_bytes(cfg.model, precision=Precision.FP32, **kw) == 4 * n * (v + vp)
    assert head_backward_bytes(cfg.model, compiled=True, **kw) == 2 * vp * h
    compiled = _gpt2(compile=True)
    (est,) = estimate_memory(compiled, 1)
    layer = layer_backward_bytes(compiled.model, **kw)
    head = head_activation_bytes(compiled.model, compiled=True, **kw)
    assert est.working == max(2 * vp * h, layer - head)


def test_a_step_on_one_h100_is_counted_within_a_percent(tmp_path) -> None:
    """`benchmarks/memory/memory_phases.py` on one H100 (2026-11-27, BENCHMARKS.md): what a step
    adds beside the model state (peak minus allocated before it), GPT-2 125M and 1.3B eager
    and compiled and a 4B model with full recomputation, against the count for the same
    run; the model state itself within 0.1 GiB."""
    import json
    from pathlib import Path

    from ptdp.parallel.env import LaunchEnv
    from ptdp.train.run import prepare
    from tests.helpers import load_benchmark

    phases, mfu = load_benchmark("memory/memory_phases"), load_benchmark("speed/mfu")
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h100-2026-11-27"
    data = mfu.synthetic_tokens(tmp_path, 50257, 64 * 2049)
    seen = 0
    for name, compiled in (("mem-eager.json", False), ("mem-compiled.json", True)):
        for row in json.loads((results / name).read_text()):
            args = SimpleNamespace(
                vocab_size=50257, grad_accum=1, device="cpu", precision="bf16", compile=compiled
            )
            shape = phases.SHAPES[row["model"]]
            cfg = mfu.ptdp_config(args, shape, row["micro_batch"], data, row["recompute"])
            count = phases.predicted(prepare(cfg, LaunchEnv(0, 1, 0))[0])
            adds = row["steady"]["peak"] - row["steady"]["before"]
            assert count["activations"] + count["working"] == pytest.approx(adds, rel=0.01), row
            assert count["static"] == pytest.approx(row["step1"]["allocated"], abs=0.1), row
            seen += 1
    assert seen == 5


@pytest.mark.parametrize(
    "model",
    [
        {},
        {"bias": False},
        {"qkv_bias": True, "bias": False},
        {"tie_embeddings": False},
        {"position_embedding": "rope"},
        LLAMA,
    ],
    ids=["gpt2", "no-bias", "qkv-bias", "untied", "rope", "llama"],
)
def test_tensor_counts_are_the_models_parameters(model: dict) -> None:
    """What a per-tensor optimizer loop visits on each pipeline rank: the parameter tensors
    of ptdp's own GPT for that stage (built on the meta device)."""
    import torch

    cfg = config(
        model={"num_layers": 4, "hidden_size": 32, "num_heads": 4, "seq_length": 16,
               "vocab_size": 100, **model}
    ).model  # fmt: skip
    for pp in (1, 2, 4):
        n, held = 4 // pp, []
        for stage in range(pp):
            with torch.device("meta"):
                gpt = GPT(
                    cfg,
                    layers=range(stage * n, (stage + 1) * n),
                    has_embedding=stage == 0,
                    has_head=stage == pp - 1,
                )
            held.append(sum(1 for _ in gpt.parameters()))
        assert tensors_per_rank(cfg, pp) == held, (model, pp)
        assert tensors_per_stage(cfg, pp) == held, (model, pp)  # a stage a rank


def _small(**parallel: object) -> RunConfig:
    model = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "vocab_size": 128}
    model |= {"seq_length": 32, "dropout": 0.0}
    train = {"precision": "fp32", "micro_batch_size": 2, "global_batch_size": 4}
    return config(model=model, parallel=parallel, train=train)


def test_full_recompute_working_by_hand() -> None:
    # fp32, n = 64 tokens, h = 64, f = 256: the recomputed layer's 16 n h stored elements
    # (fused attention) less its input, which the checkpoint keeps and the activations
    # count; eager backward: dY [n, h], fc2's input gradient [n, f] and weight's [h, f].
    # One rank holds the head too: its stored (8 n h + 4 n v bytes) is freed by then.
    n, h, f, v = 64, 64, 256, 128
    (est,) = estimate_memory(_small(recompute="full"), 1)
    head = 8 * n * h + 4 * n * v
    assert est.working == 4 * (15 * n * h + n * (h + f) + h * f) - head
    assert est.activations == 4 * (4 * n * h) + head  # four checkpoint inputs, the head


def test_gloo_holds_sent_tensors_until_the_step_ends() -> None:
    # 1F1B, pp = 2, m = 2: rank 0 runs F0 F1 B0 B1, its peak after F1, with both outputs
    # [s, b, h] sent and (gloo) still held; rank 1 runs F0 B0 F1 B1, its peak at F1 with
    # B0's input gradient sent and held.
    cfg = _small(pp=2)
    nh = 4 * 64 * 64
    plain, held = estimate_memory(cfg, 2), estimate_memory(cfg, 2, gloo_sends=True)
    assert held[0].activations - plain[0].activations == 2 * nh
    assert held[1].activations - plain[1].activations == nh


def test_megatron_core_kernels_keep_less_by_hand() -> None:
    # Llama-style, bf16, h = 64 (4 heads of 16, 2 groups), f = 172 (SwiGLU), n = 64 tokens:
    # native GQA keeps K and V at 2 x 16 wide, not 64 (2 x 2 x 32 fewer elements per
    # token); a fused SwiGLU keeps gate and up, not silu's output too (f fewer).
    model = config(
        model={"hidden_size": 64, "num_heads": 4, "seq_length": 32, "vocab_size": 128, **LLAMA}
    ).model
    kw = dict(micro_batch=2, precision=Precision.BF16)
    plain = layer_activation_bytes(model, **kw)
    n, f = 64, model.ffn_size
    assert plain - layer_activation_bytes(model, native_gqa=True, **kw) == 2 * n * 2 * 32
    assert plain - layer_activation_bytes(model, fused_swiglu=True, **kw) == 2 * n * f
