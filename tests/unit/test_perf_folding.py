"""The performance model of folded experts (`ptdp.perf.cost.folding`): where the experts live,
what the tokens travel and over which links, what each rank keeps, the all-to-all overlap,
DeepEP's deduplicating dispatch, the H800 file; values worked by hand."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest

from ptdp.config.enums import Activation, Normalization, PositionEmbedding, Precision, Recompute
from ptdp.config.files import apply_updates
from ptdp.config.sections import ModelConfig, ParallelConfig, RunConfig
from ptdp.perf.cost.collectives import all_to_all_seconds
from ptdp.perf.cost.costs import Compute, Passes, layer_gemms
from ptdp.perf.cost.experts import (
    alltoall_link,
    alltoall_seconds,
    dedup_seconds,
    node_hit,
    overlapped,
    reduction_groups,
)
from ptdp.perf.cost.flops import device_kind
from ptdp.perf.cost.folding import Experts
from ptdp.perf.cost.hardware_file import load_system, system_for_device_name
from ptdp.perf.cost.layer_bytes import layer_activation_bytes
from ptdp.perf.cost.memory import estimate_memory
from ptdp.perf.cost.moe import expert_bytes, permute_bytes
from ptdp.perf.cost.parameters import routed_parameters
from ptdp.perf.cost.software import MEGATRON_CORE, PTDP

H100 = load_system("h100-sxm")
GB = 1e9

TINY = ModelConfig(
    num_layers=2,
    hidden_size=16,
    num_heads=2,
    num_query_groups=2,
    ffn_hidden_size=40,
    vocab_size=64,
    seq_length=8,
    activation=Activation.SWIGLU,
    position_embedding=PositionEmbedding.ROPE,
    normalization=Normalization.RMSNORM,
    bias=False,
    tie_embeddings=False,
    num_experts=4,
    moe_top_k=2,
    moe_ffn_hidden_size=12,
)
"""Two MoE layers of 4 experts of width 12, top-2, h = 16, 8 tokens a sequence."""


def test_the_expert_split_of_a_stage() -> None:
    # t = 2, d cp = 4: 8 ranks; ep = 4, etp = 1: edp = 2, ep ranks 1 apart, edp ranks 4.
    folded = Experts.of(tp=2, dp_cp=4, ep=4, etp=1)
    assert (folded.edp, folded.ep_stride, folded.edp_stride) == (2, 1, 4)
    assert folded.routed_tokens(4096) == 2048  # its s/t shard, no etp gather
    # etp = None: the layout before folding (etp = t, ep over d cp): the whole microbatch.
    before = Experts.of(tp=2, dp_cp=4, ep=2)
    assert (before.etp, before.edp, before.ep_stride) == (2, 2, 2)
    assert before.routed_tokens(4096) == 4096
    assert Experts.of(tp=4, dp_cp=2, ep=2, etp=2).routed_tokens(4096) == 2048  # gathered over 2


def test_routed_experts_are_split_over_etp_not_tp() -> None:
    expert = 3 * 16 * 12  # SwiGLU: gate, up and down, h x 12
    assert routed_parameters(TINY, tp=2, ep=2, etp=1) == 2 * expert  # whole experts
    assert routed_parameters(TINY, tp=2, ep=2, etp=2) == 2 * expert // 2
    assert routed_parameters(TINY, tp=2, ep=2) == 2 * expert // 2  # etp = t (before folding)


def test_gradients_and_zero_shards_go_over_edp() -> None:
    assert reduction_groups(100, 40, tp=2, dp_cp=4, ep=4, etp=1) == [(60, 4, 2), (40, 2, 4)]
    assert reduction_groups(100, 40, tp=2, dp_cp=4, ep=1) == [(100, 4, 2)]  # like the dense
    # ep = 1, etp = 1 at t = 2: every rank of the stage holds every whole expert.
    assert reduction_groups(100, 40, tp=2, dp_cp=4, ep=1, etp=1) == [(60, 4, 2), (40, 8, 1)]
    assert reduction_groups(100, 0, tp=2, dp_cp=4, ep=1, etp=1) == [(100, 4, 2)]  # dense


def test_the_all_to_all_sends_the_rows_of_the_rank_s_shard_once() -> None:
    model = replace(TINY, seq_length=4096, hidden_size=4096, moe_top_k=8, num_experts=128)
    c = Compute(H100, Precision.BF16, MEGATRON_CORE)
    # t = 4, etp = 1: 1024 tokens, 8 rows each of 4096 bf16, 3/4 of them to the 3 peers,
    # in one node (ep = 4 ranks 1 apart).
    sent = 1024 * 8 * 4096 * 2 * 3 / 4
    got = alltoall_seconds(model, micro_batch=1, tp=4, ep=4, etp=1, c=c)
    assert got == pytest.approx(all_to_all_seconds(sent, 4, H100.intra))
    # Before folding (etp = t = 4): every tensor rank ships the whole microbatch, 4x the rows.
    old = alltoall_seconds(model, micro_batch=1, tp=4, ep=4, c=c)
    assert old == pytest.approx(all_to_all_seconds(4 * sent, 4, alltoall_link(H100, 4, 4)))
    # The ep group is inside the node while ep * etp fits in it.
    assert alltoall_link(H100, 8, 1) == H100.intra and alltoall_link(H100, 4, 2) == H100.intra
    assert alltoall_link(H100, 8, 2) != H100.intra and alltoall_link(H100, 16, 1) != H100.intra


def test_deduplicated_dispatch_crosses_the_network_once_a_node() -> None:
    # ep = 32 over 4 nodes of 8: 32 of the 128 experts a node; top-8 hits a node with
    # probability 1 - C(96, 8) / C(128, 8), so a token crosses to 3 x 0.907 nodes, not 6 rows.
    hit = 1 - math.comb(96, 8) / math.comb(128, 8)
    assert hit == pytest.approx(0.907, abs=1e-3)
    token = 2048 * 4096 * 2.0  # a rank's routed tokens' bytes
    got = dedup_seconds(H100, rows=8 * token, tokens=token, experts=128, top_k=8, ep=32, stride=1)
    latency, inter = H100.inter.collective("all_to_all")
    _, intra = H100.intra.collective("all_to_all")
    wire = max(3 * hit * token / inter, 8 * token * 31 / 32 / intra)
    assert got == pytest.approx(latency + 31 * H100.inter.step_latency + wire)
    assert dedup_seconds(H100, rows=1.0, tokens=1.0, experts=8, top_k=2, ep=8, stride=1) is None


def test_group_limited_routing_bounds_the_nodes_a_token_reaches() -> None:
    # DeepSeek-V3 on ep = 64 over 8 nodes: a node's 32 experts are one of its 8 groups, and
    # a token's 8 experts come from its best 4 groups, so a node is hit when its group is
    # among the 4: 1 - C(7, 4) / C(8, 4) = 1/2, against 1 - C(224, 8) / C(256, 8) at random.
    assert node_hit(256, 8, 32, groups=8, group_top_k=4) == pytest.approx(0.5)
    assert node_hit(256, 8, 32) == pytest.approx(1 - math.comb(224, 8) / math.comb(256, 8))
    assert node_hit(256, 8, 32) > 0.65
    # Two groups a node: hit when either is among the 4 of 8.
    assert node_hit(256, 8, 64, groups=8, group_top_k=4) == pytest.approx(1 - 15 / 70)
    # A group over two nodes of 16 experts: the group chosen (4/8), then 2 of its 32
    # experts, either on this node: 1 - C(16, 2) / C(32, 2).
    inside = 1 - math.comb(16, 2) / math.comb(32, 2)
    assert node_hit(256, 8, 16, groups=8, group_top_k=4) == pytest.approx(0.5 * inside)
    token = 4096 * 7168 * 2.0
    kw = dict(rows=8 * token, tokens=token, experts=256, top_k=8, ep=64, stride=1)
    latency, inter = H100.inter.collective("all_to_all")
    _, intra = H100.intra.collective("all_to_all")
    wire = max(7 * 0.5 * token / inter, 8 * token * 63 / 64 / intra)
    want = latency + 63 * H100.inter.step_latency + wire
    assert dedup_seconds(H100, groups=8, group_top_k=4, **kw) == pytest.approx(want)
    assert dedup_seconds(H100, **kw) > want  # no groups: more nodes a token


def test_the_overlap_hides_the_all_to_alls_behind_the_paired_pass() -> None:
    # F's behind 0.2 of B + W (1.0 hidden), B's behind 0.2 of F (0.6).
    got = overlapped(Passes(2.0, 2.0, 0.0), Passes(3.0, 4.0, 1.0), 0.2)
    assert got == Passes(1.0, pytest.approx(1.4), 0.0)
    assert overlapped(Passes(2.0, 2.0, 0.0), Passes(3.0, 4.0, 1.0), 1.0) == Passes(0.0, 0.0, 0.0)


def test_expert_activations_per_rank_by_hand() -> None:
    # t = 2, etp = 1: a rank routes 4 of the 8 tokens, 8 rows: the permuted rows and the
    # combine's outputs [8, 16], gate, up and product [8, 3 x 12] (fused), fp32 weights [8];
    # the router's two fp32 [4, 4] scores.
    kw = dict(micro_batch=1, recompute=Recompute.NONE, e=2, tp=2)
    rows = 8
    by_hand = rows * (2 * 16 * 2 + 3 * 12 * 2 + 4) + 2 * 4 * 4 * 4
    assert expert_bytes(TINY, etp=1, fused_swiglu=True, **kw) == by_hand
    # etp = 2 (gathered over 2): 16 rows, each at half the width.
    gathered = 16 * (2 * 16 * 2 + 3 * 6 * 2 + 4) + 2 * 4 * 8 * 4
    assert expert_bytes(TINY, etp=2, fused_swiglu=True, **kw) == gathered
    # Megatron's output-discarding recomputation drops the product [8, 12].
    kept = expert_bytes(TINY, etp=1, fused_swiglu=True, discards_outputs=True, **kw)
    assert by_hand - kept == rows * 12 * 2
    assert expert_bytes(TINY, etp=1, **(kw | {"recompute": Recompute.FULL})) == 0.0
    # The permutation: the 8 rows read and written into place, and back.
    assert permute_bytes(TINY, 1, 2, 1, 1.0, 2) == 4 * 8 * 16 * 2
    # And the layer: its attention as a dense layer's without an MLP, plus the experts'.
    layer = layer_activation_bytes(TINY, micro_batch=1, tp=2, moe=True, etp=1)
    attention = layer_activation_bytes(replace(TINY, num_experts=0), micro_batch=1, tp=2)
    mlp = 2 * 8 * 40 * 2 * 2 // 2  # the dense MLP's gate/up and output, split over t
    assert layer - (attention - mlp) == expert_bytes(TINY, etp=1, **kw)


def _run(tp: int, dp: int, ep: int, etp: int, zero: int = 1) -> RunConfig:
    keys = {f.name: getattr(TINY, f.name) for f in fields(TINY)}
    keys = {k: getattr(v, "value", v) for k, v in keys.items()}
    parallel = {"tp": tp, "dp": dp, "ep": ep, "etp": etp, "zero": zero}
    parallel["sequence_parallel"] = tp > 1
    train = {"global_batch_size": dp, "micro_batch_size": 1, "precision": "bf16"}
    sections = {"model": keys | {"make_vocab_size_divisible_by": 1}, "parallel": parallel}
    return apply_updates(RunConfig(), sections | {"train": train}, "test")


def test_expert_state_is_sharded_over_edp() -> None:
    # t = 2, d = 2: 4 ranks; ep = 2, etp = 1: 2 whole experts a rank, edp = 2.
    (rank,) = estimate_memory(_run(2, 2, 2, 1), 4)
    (alone,) = estimate_memory(_run(2, 2, 1, 1), 4)  # every whole expert, edp = 4
    routed = 2 * routed_parameters(TINY, tp=2, ep=2, etp=1)  # two MoE layers
    everything = 2 * routed_parameters(TINY, tp=2, ep=1, etp=1)
    assert alone.params - rank.params == 2 * (everything - routed)  # bf16 weights
    assert alone.optimizer - rank.optimizer == pytest.approx(12 * (everything / 4 - routed / 2))


def test_fp8_prices_the_expert_gemms_as_the_dense_fp8_linears() -> None:
    model = replace(TINY, seq_length=4096, hidden_size=4096, moe_ffn_hidden_size=1536)
    gemms = layer_gemms(model, 1, 1, moe=True, ep=4, etp=1)
    bf16 = Compute(H100, Precision.BF16, PTDP).linears(gemms[3:5])
    fp8 = Compute(H100, Precision.FP8, PTDP).linears(gemms[3:5])
    assert fp8.f < bf16.f and fp8.b < bf16.b


def test_the_h800_is_an_h100_with_a_narrower_nvlink() -> None:
    h800 = load_system("h800")
    assert h800.device.peak_tflops == H100.device.peak_tflops
    assert h800.device.memory_bytes == H100.device.memory_bytes
    assert h800.intra.bandwidth == 200 * GB and H100.intra.bandwidth == 450 * GB
    assert h800.intra.achieved == pytest.approx(160 * GB)  # DeepSeek-V3's measured NVLink
    assert h800.inter == H100.inter
    assert system_for_device_name("NVIDIA H800").name == "h800"
    assert device_kind("NVIDIA H800") == "h100-sxm"  # the training log's MFU peak


@pytest.mark.skipif(
    "moe_overlap" not in {f.name for f in fields(ParallelConfig)},
    reason="parallel.moe_overlap is not in this checkout's config yet",
)
def test_the_planner_tries_the_overlap_where_the_schedule_pairs() -> None:
    from ptdp.perf.plan.planner import plan

    cfg = _run(1, 8, 4, 1)
    cfg = replace(cfg, train=replace(cfg.train, global_batch_size=64))
    result = plan(cfg, gpus=8, system=H100, pp=1, tp=1, ep=4, top=20, prune=False)
    overlaps = {getattr(o.config.parallel, "moe_overlap", False) for o in result.options}
    assert overlaps == {False, True}


def test_the_planner_searches_etp_and_the_train_command_sets_it() -> None:
    from ptdp.perf.plan.planner import plan
    from ptdp.perf.report import overrides

    cfg = _run(2, 4, 2, 1)
    cfg = replace(cfg, train=replace(cfg.train, global_batch_size=32))
    result = plan(cfg, gpus=8, system=H100, tp=2, pp=1, top=50, prune=False)
    pairs = {(o.prediction.layout.ep, o.prediction.layout.etp) for o in result.options}
    assert {(2, 1), (2, 2), (4, 1)} <= pairs  # ep over tensor ranks (etp 1), or etp = t
    split = next(o for o in result.options if o.prediction.layout.etp == 2)
    assert "--parallel.etp 2 " in overrides(split)  # the runtime's default is 1
    whole = next(o for o in result.options if o.prediction.layout.etp == 1)
    assert "--parallel.etp" not in overrides(whole)
