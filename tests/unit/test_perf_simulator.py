"""The simulator: replay of the schedules' own action lists, the cost model, a full step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ptdp.config.enums import Precision, Recompute
from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.perf.cost.collectives import all_reduce_seconds, group_link
from ptdp.perf.cost.costs import Compute, Gemm, layer_seconds
from ptdp.perf.cost.flops import flops_per_iteration
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.software import MEGATRON_2021, PTDP
from ptdp.perf.simulate.optimizer_step import step_reductions
from ptdp.perf.simulate.pipeline_costs import accumulation, pipeline_costs, stage_costs
from ptdp.perf.simulate.replay import PipelineCosts, replay
from ptdp.perf.simulate.simulator import simulate
from ptdp.perf.validate.paper import preset
from ptdp.pipeline.lowering import add_comms
from ptdp.pipeline.placement import StageMap
from ptdp.pipeline.schedules import SCHEDULES, build
from ptdp.pipeline.verify import verify
from ptdp.rules.layout import validate
from tests.helpers import PERF_MODEL

A100 = load_system("a100-80gb")
GRID = [
    (name, pp, vpp, m)
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v")
    for pp in range(1, 9)
    for vpp in {"interleaved": (2, 3), "zb-v": (2,)}.get(name, (1,))
    for m in (pp, 2 * pp, 4 * pp)
]


@pytest.mark.parametrize(("name", "pp", "vpp", "m"), GRID)
def test_unit_costs_reproduce_the_bubble_formulas(name, pp, vpp, m) -> None:
    plan = build(name, pp, m, vpp)
    report = verify(plan, SCHEDULES[name].stage_map(pp, vpp), m)
    formula = {
        "gpipe": (pp - 1) / m,
        "1f1b": (pp - 1) / m,
        "interleaved": (pp - 1) / (vpp * m),
        "zb-h1": report.bubble_fraction,  # (p-1)(F+B-W) / (m (F+B+W)) for m >= p
        "zb-h2": report.bubble_fraction,  # the last rank's (p-1) F wait: as zb-h1 here
        "zb-v": report.bubble_fraction,  # (p-1)/(6m) for m >= 2p
    }[name]
    if name in ("zb-h1", "zb-h2"):
        assert report.bubble_fraction == pytest.approx((pp - 1) / (3 * m))
    if name == "zb-v" and m >= 2 * pp:
        assert report.bubble_fraction == pytest.approx((pp - 1) / (6 * m))
    stages = SCHEDULES[name].stage_map(pp, vpp)
    for lowered in (plan, add_comms(plan, stages)):  # compute-only and with sends/receives
        run = replay(lowered, stages, PipelineCosts.unit(pp * vpp))
        assert run.bubble_fraction == pytest.approx(formula, abs=1e-12)
        assert run.makespan == report.makespan
        assert run.busy == report.busy


@pytest.mark.parametrize("f,b,w", [(1, 2, 0.5), (1, 1.5, 0.5), (2, 1, 1), (1, 0.8, 1), (1, 1, 1)])
def test_zero_bubble_overheads_beyond_unit_costs(f, b, w) -> None:
    # The papers' (p-1)(F+B-W) for ZB-H1 and (p-1)(F+B-2W) for ZB-H2, floored at the last
    # rank's wait of (p-1) F for its first input; ZB-H2's order is built at unit costs.
    for pp in (2, 4, 8):
        for m in (2 * pp, 4 * pp):
            costs = PipelineCosts((f,) * pp, (b,) * pp, (w,) * pp, (0.0,) * pp, (0.0,) * pp)
            for name, paper in (("zb-h1", f + b - w), ("zb-h2", f + b - 2 * w)):
                run = replay(build(name, pp, m), StageMap(pp), costs)
                overhead = run.makespan - m * (f + b + w)
                assert overhead == pytest.approx((pp - 1) * max(f, paper))


def test_replay_with_transfers_by_hand() -> None:
    # 1F1B, p = 2, m = 2; F = 1, BW = 2, every transfer 0.5. ptdp posts a receive right
    # before the compute that needs it, so a transfer starts only then (rendezvous):
    # rank 1 posts RECV_F1 after its BW0 at 4.5, F1 arrives at 5.0; the last gradient
    # leaves rank 1 at 8 and reaches rank 0 at 8.5, whose BW1 ends at 10.5.
    plan = add_comms(build("1f1b", 2, 2), StageMap(2))
    costs = PipelineCosts((1.0, 1.0), (2.0, 2.0), (0.0, 0.0), (0.5, 0.5), (0.5, 0.5))
    run = replay(plan, StageMap(2), costs)
    assert run.makespan == 10.5
    assert run.busy == (6.0, 6.0)
    starts = {(e.rank, e.kind, e.mb): e.start for e in run.events}
    assert starts[(1, "F", 1)] == 5.0 and starts[(0, "BW", 0)] == 5.0
    assert starts[(0, "SEND_F", 1)] == 4.5  # posted at 2, matched at 4.5
    # Blocking (Megatron-LM 2021): the sender carries the transfer, so F1 starts at 1.5.
    blocking = replay(plan, StageMap(2), costs, blocking=True)
    starts = {(e.rank, e.kind, e.mb): e.start for e in blocking.events}
    assert starts[(0, "F", 1)] == 1.5 and blocking.makespan == 10.5


def test_gemm_model_by_hand() -> None:
    c = Compute(A100, Precision.BF16, PTDP)
    g = Gemm(4096, 4096, 4096)
    dev = A100.device
    expected = g.flops / (312e12 * dev.gemm_efficiency) + 2 * 3 * 4096**2 / (
        dev.memory_bandwidth * dev.memory_efficiency
    )  # its launch hidden: the host queued it while earlier kernels ran
    assert c.gemm(g) == pytest.approx(expected)
    # Efficiency depends on size: a thin GEMM (inner size = head size) runs far slower.
    big, thin = Gemm(8192, 8192, 8192), Gemm(2048, 2048, 96, batch=64)
    assert big.flops / c.gemm(big) > 2 * thin.flops / c.gemm(thin)
    assert g.dgrad().flops == g.wgrad().flops == g.flops


def test_a_gpu_hides_launches_behind_longer_kernels_and_a_cpu_pays_them() -> None:
    """A GPU's host queues kernels ahead: the slower of the kernels and their launches sets
    the pace. A CPU runs each kernel in the thread that launched it: the two add."""
    launch = A100.device.kernel_overhead  # 5 us
    gpu = Compute(A100, Precision.BF16, MEGATRON_2021)
    cpu_system = replace(A100, device=replace(A100.device, kind="cpu"))
    cpu = Compute(cpu_system, Precision.BF16, MEGATRON_2021)
    assert gpu.launched(100e-6, 8) == 100e-6  # 8 launches (40 us) under 100 us of kernels
    assert gpu.launched(10e-6, 8) == pytest.approx(8 * launch)  # tiny kernels: launch-bound
    assert cpu.launched(100e-6, 8) == pytest.approx(100e-6 + 8 * launch)
    tiny = Gemm(16, 16, 16)
    assert gpu.gemm(tiny) == pytest.approx(launch)
    assert cpu.gemm(tiny) > launch
    # A 1.7B layer of the paper (h 2304, t 1, b 1): every kernel outlasts its launch, so the
    # memory-bound term is its bytes alone; on a CPU its 8 forward launches come on top,
    m = preset("gpt-1.7b")
    kw = dict(micro_batch=1, tp=1, sequence_parallel=False, recompute=Recompute.NONE)
    on_gpu, on_cpu = layer_seconds(m, c=gpu, **kw), layer_seconds(m, c=cpu, **kw)
    launches = MEGATRON_2021.elementwise_kernels * launch
    # and the 4 linear layers' and the 2 unfused score GEMMs' launches
    assert on_cpu.f - on_gpu.f == pytest.approx(launches + 6 * launch, rel=1e-6)


def test_layer_costs_follow_recomputation_and_tensor_parallelism() -> None:
    c = Compute(A100, Precision.BF16, MEGATRON_2021)
    m = preset("gpt-22b")
    kw = dict(micro_batch=4, tp=8, sequence_parallel=False)
    none = layer_seconds(m, recompute=Recompute.NONE, c=c, **kw)
    full = layer_seconds(m, recompute=Recompute.FULL, c=c, **kw)
    sel = layer_seconds(m, recompute=Recompute.SELECTIVE, c=c, **kw)
    assert full.b == pytest.approx(none.b + none.f) and full.w == none.w
    assert none.b < sel.b < full.b
    one = layer_seconds(
        m, recompute=Recompute.NONE, c=c, micro_batch=4, tp=1, sequence_parallel=False
    )
    assert 4 * none.f < one.f < 8 * none.f  # 8x the work on one GPU, no all-reduces
    sp = layer_seconds(
        m, recompute=Recompute.NONE, c=c, micro_batch=4, tp=8, sequence_parallel=True
    )
    assert sp.f < none.f  # norms and dropout on 1/t of the sequence


def test_calibration_on_korthikanti_table_4() -> None:
    # One 22B layer (h 6144, 64 heads, t = 8, b = 4) on A100s: 7.7 ms forward, 11.9 ms
    # backward, with the two backward all-reduces hidden behind weight gradients there.
    c = Compute(A100, Precision.BF16, MEGATRON_2021)
    layer = layer_seconds(
        preset("gpt-22b"),
        micro_batch=4,
        tp=8,
        sequence_parallel=False,
        recompute=Recompute.NONE,
        c=c,
    )
    hidden = 2 * all_reduce_seconds(4 * 2048 * 6144 * 2, 8, group_link(A100, 8, 1))
    assert layer.f * 1e3 == pytest.approx(7.7, rel=0.05)
    assert (layer.b + layer.w - hidden) * 1e3 == pytest.approx(11.9, rel=0.05)


def small_run(**parallel) -> RunConfig:
    return apply_updates(
        RunConfig(),
        {
            "model": PERF_MODEL,
            "parallel": {"tp": 2, "pp": 4, **parallel},
            "train": {"precision": "bf16", "micro_batch_size": 2, "global_batch_size": 64},
        },
        "test",
    )


def test_a_full_step() -> None:
    cfg = small_run(vpp=2, schedule="interleaved")
    p = simulate(cfg, A100, 16)
    lay = validate(cfg, 16)
    assert (lay.dp, lay.num_microbatches) == (2, 16)
    executed = flops_per_iteration(cfg.model, 64, Recompute.NONE)
    assert p.tflops_per_device == pytest.approx(executed / p.iteration_seconds / 16 / 1e12)
    assert p.iteration_seconds >= p.pipeline_seconds
    assert p.iteration_seconds == pytest.approx(max(p.busy) + min(p.idle))
    assert 0 < p.bubble_fraction < 1 and 0 < p.mfu <= p.hfu < 1
    kinds = {e.kind for e in p.events}
    assert {"F", "BW", "SEND_F", "SEND_B", "DP", "OPT"} <= kinds
    # The same pipeline without interleaving has the larger bubble.
    plain = simulate(small_run(), A100, 16)
    assert plain.bubble_fraction > p.bubble_fraction


def test_overlapped_gradient_reduction_is_faster() -> None:
    overlapped = simulate(small_run(), A100, 16)
    after = simulate(small_run(overlap_grad_reduce=False), A100, 16)
    assert after.dp_seconds == pytest.approx(overlapped.dp_seconds)
    assert after.iteration_seconds > overlapped.iteration_seconds


def test_zero_bubble_weight_pass_costs() -> None:
    cfg = small_run(schedule="zb-h1")
    c = Compute(A100, Precision.BF16, PTDP)
    lay = validate(cfg, 16)
    split = pipeline_costs(cfg, lay, c)
    passes = stage_costs(cfg, lay, c)
    # W runs only the stashed weight-gradient GEMMs: no second walk of the graph.
    assert split.backward_weight == tuple(p.w for p in passes)
    assert split.backward_input == tuple(p.b for p in passes)
    assert 0 < split.backward_weight[1] < split.backward_input[1] + split.backward_weight[1]
    # Compiled layers keep the fused linear backward: B does it all, W adds the gradients
    # into the buffers.
    compiled = replace(cfg, train=replace(cfg.train, compile=True))
    fused = pipeline_costs(compiled, lay, c)
    passes, added = stage_costs(compiled, lay, c), accumulation(compiled, lay, c)
    assert min(added) > 0
    assert fused.backward_input == pytest.approx([p.b + p.w - a for p, a in zip(passes, added)])
    assert fused.backward_weight == pytest.approx(added)


def test_uneven_stages_cost_in_proportion_to_their_layers() -> None:
    c = Compute(A100, Precision.BF16, PTDP)
    even_cfg, uneven_cfg = small_run(), small_run(pipeline_layers=[1, 3, 3, 1])
    even = stage_costs(even_cfg, validate(even_cfg, 16), c)
    uneven = stage_costs(uneven_cfg, validate(uneven_cfg, 16), c)
    layer = even[1].f / 2  # the middle stages hold only their 2 layers
    assert [p.f for p in uneven] == pytest.approx(
        [even[0].f - layer, 3 * layer, 3 * layer, even[3].f - layer]
    )
    assert uneven[1].b == pytest.approx(even[1].b * 3 / 2)
    assert simulate(uneven_cfg, A100, 16).iteration_seconds > 0


@pytest.mark.parametrize(
    "parallel",
    [{}, {"vpp": 2, "schedule": "interleaved"}, {"vpp": 2, "schedule": "zb-v"}],
    ids=["1f1b", "interleaved", "zb-v"],
)
def test_stages_without_layers_cost_the_embedding_or_the_loss_alone(parallel: dict) -> None:
    c = Compute(A100, Precision.BF16, PTDP)
    stages = 4 * parallel.get("vpp", 1)
    split = [0] + [8 // (stages - 2) + (i < 8 % (stages - 2)) for i in range(stages - 2)] + [0]
    even_cfg, ends_cfg = small_run(**parallel), small_run(**parallel, pipeline_layers=split)
    even = stage_costs(even_cfg, validate(even_cfg, 16), c)
    ends = stage_costs(ends_cfg, validate(ends_cfg, 16), c)
    layer = even[1].f / (8 // stages)
    # The first stage embeds only, the last runs the final norm, output layer and loss only.
    per = 8 // stages  # layers of an even stage
    assert ends[0].f == pytest.approx(even[0].f - per * layer)
    assert ends[-1].f == pytest.approx(even[-1].f - per * layer)
    assert [p.f for p in ends[1:-1]] == pytest.approx([n * layer for n in split[1:-1]])
    prediction = simulate(ends_cfg, A100, 16)
    assert prediction.iteration_seconds > 0 and "layers=0," in prediction.layout.describe()
    # A rank holding no layer (1F1B's first and last, ZB-V's first) stores no layer's
    # activations and needs no layer's transients: the loss's backward at most.
    placement = validate(ends_cfg, 16).stages
    for m in prediction.memory:
        held = placement.stages_of(m.rank)
        if any(split[s] for s in held):
            continue
        with_head = stages - 1 in held
        assert (m.working > 0) == with_head and (m.activations > 0) == with_head, m.rank


@pytest.mark.parametrize(
    "parallel,world,calls",
    [
        ({}, 1, 0),  # one process: nothing to reduce
        ({"tp": 2}, 2, 2),  # gradient norm over tp, fault flags over the world
        ({"pp": 2}, 2, 3),  # loss and norm over pp, flags
        ({"zero": 0}, 2, 2),  # loss over dp, flags (the norm needs no dp reduction)
        ({"zero": 1}, 2, 3),  # ... and the sharded optimizer's norm over dp
        ({"tp": 2, "pp": 2, "zero": 1}, 8, 6),  # every one of them
    ],
)
def test_the_steps_scalar_reductions_each_pay_a_latency_and_a_resync(
    parallel: dict, world: int, calls: int
) -> None:
    cfg = apply_updates(
        RunConfig(),
        {
            "model": {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "vocab_size": 256},
            "parallel": parallel,
            "train": {"micro_batch_size": 1, "global_batch_size": 8},
        },
        "test",
    )
    node = replace(A100.intra, latency=1e-3)
    device = replace(A100.device, collective_sync=2e-3)
    system = replace(A100, device=device, intra=node, inter=node)
    c = Compute(system, Precision.FP32, PTDP)
    assert step_reductions(validate(cfg, world), c) == pytest.approx(calls * 3e-3)
    # They lie between the last gradient and the update, in the step's time.
    quiet = replace(system, device=replace(device, collective_sync=0.0))
    pay = simulate(cfg, system, world).iteration_seconds
    assert pay - simulate(cfg, quiet, world).iteration_seconds >= calls * 2e-3 - 1e-12
