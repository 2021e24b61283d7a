"""Expert parallelism in the performance model: the all-to-all bytes by hand, what `ptdp
simulate` prices for them and for the experts' memory and gradients, the planner's search
over ep, and the attention width of Qwen3's heads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.config.enums import Recompute
from ptdp.config.files import apply_updates
from ptdp.config.presets import MODEL_PRESETS, model_preset
from ptdp.config.sections import RunConfig
from ptdp.perf.cost.collectives import all_reduce_seconds, all_to_all_seconds, group_link
from ptdp.perf.cost.costs import Compute, Gemm, layer_gemms
from ptdp.perf.cost.experts import alltoall_link, ep_comm_seconds
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.moe import alltoall_bytes
from ptdp.perf.cost.parameters import (
    expert_parameters_per_stage,
    mlp_parameters,
    parameters_per_stage,
)
from ptdp.perf.cost.reserve import communicators
from ptdp.perf.cost.software import PTDP
from ptdp.perf.plan.planner import Plans, plan
from ptdp.perf.plan.search import Space, expert_layouts, search
from ptdp.perf.simulate.reduction import stage_reductions
from ptdp.perf.simulate.simulator import simulate
from ptdp.rules.layout import validate

H100 = load_system("h100-sxm")


def test_alltoall_bytes_by_hand() -> None:
    # Qwen3-30B-A3B at b = 1, s = 4096: 4096 tokens x 8 choices x 2048 x 2 bytes = 128 MiB
    # of rows, of which ep - 1 of ep parts leave the rank.
    assert alltoall_bytes(4096, 8, 2048, 1, 2) == 0
    assert alltoall_bytes(4096, 8, 2048, 2, 2) == 64 * 2**20
    assert alltoall_bytes(4096, 8, 2048, 8, 2) == 7 * 16 * 2**20
    assert alltoall_bytes(10, 3, 5, 4, 4) == 10 * 3 * 5 * 4 * 3 / 4 == 450


def _mixtral(ep: int, gpus: int = 64, **parallel: object) -> RunConfig:
    """Mixtral at 4096 tokens on tp = 4, pp = 4 (d = gpus / 16), its experts over ep ranks."""
    sections = {
        "model": MODEL_PRESETS["mixtral-8x7b"] | {"seq_length": 4096},
        # etp = tp: the experts split like the dense layers, ep over dp * cp (before folding)
        "parallel": {"tp": 4, "etp": 4, "pp": 4, "sequence_parallel": True, "ep": ep} | parallel,
        "train": {"global_batch_size": 64, "micro_batch_size": 1, "precision": "bf16"},
    }
    return apply_updates(RunConfig(), sections, "test")


def test_simulate_prices_the_all_to_alls_only_under_expert_parallelism() -> None:
    one = simulate(_mixtral(1), H100, 64, timeline=False)
    assert one.ep_seconds == 0.0
    for ep in (2, 4):
        got = simulate(_mixtral(ep), H100, 64, timeline=False)
        # 4 all-to-alls per MoE layer and microbatch, each 4096 x 2 x 4096 x 2 x (ep-1)/ep
        # bytes, on the ep group's link: 4 ranks apart, in one node at ep = 2, over two at 4.
        sent = 4096 * 2 * 4096 * 2 * (ep - 1) / ep
        link = alltoall_link(H100, ep, 4)
        assert (link == H100.intra) == (ep == 2)  # equal: the cache may hold another copy
        assert got.ep_seconds == pytest.approx(4 * all_to_all_seconds(sent, ep, link))
        # The experts' rows per rank are t k whatever ep (one GEMM's worth of work on the
        # calibrated curve): the layer differs by its all-to-alls alone.
        layer = got.layer
        assert layer.f - one.layer.f == pytest.approx(got.ep_seconds / 2, rel=1e-6)
        assert layer.b - one.layer.b == pytest.approx(got.ep_seconds / 2, rel=1e-6)
        assert layer.w == pytest.approx(one.layer.w, rel=1e-9)
        assert got.iteration_seconds != one.iteration_seconds
    # Across nodes each GPU's bytes for the two peers on the other node use its own card,
    # the one for its node's peer NVLink, at once.
    inter, intra = H100.inter.bandwidth * H100.inter.efficiency, H100.intra.achieved
    assert alltoall_link(H100, 4, 4).achieved == pytest.approx(
        1 / max(2 / 3 / inter, 1 / 3 / intra)
    )


def test_expert_memory_is_split_over_ep_and_its_state_over_edp() -> None:
    # d = 8 (128 GPUs): Mixtral's 8 experts of 3 x 4096 x 14336 per layer, split over t = 4
    # and then over ep; ZeRO-1 shards the experts' optimizer state over d / ep.
    expert = 8 * mlp_parameters(model_preset("mixtral-8x7b"), 14336, 4)
    for zero in (0, 1):
        one = simulate(_mixtral(1, 128, zero=zero), H100, 128, timeline=False).memory
        for ep in (2, 8):
            got = simulate(_mixtral(ep, 128, zero=zero), H100, 128, timeline=False).memory
            for a, b in zip(one, got):
                layers = 8  # 32 layers over pp = 4, all MoE
                held = layers * expert * (1 - 1 / ep)
                assert a.params - b.params == pytest.approx(2 * held)  # bf16 weights
                assert a.grads - b.grads == pytest.approx(4 * held)  # fp32 buffers
                if zero:  # each rank keeps 1/d of the state either way
                    assert b.optimizer == pytest.approx(a.optimizer)
                else:
                    assert a.optimizer - b.optimizer == pytest.approx(12 * held)


def test_expert_gradients_are_reduced_over_the_edp_ranks() -> None:
    cfg = _mixtral(4, 128)  # d = 8: ep groups of 4 ranks, edp groups of 2
    layout = validate(cfg, 128, gpus=True)
    c = Compute(H100, cfg.train.precision, PTDP)
    split = (4, 4, 1, layout.stage_layers, 4)
    params = parameters_per_stage(cfg.model, *split)
    experts = expert_parameters_per_stage(cfg.model, *split)
    for (seconds, _), n, x in zip(stage_reductions(cfg, layout, c), params, experts):
        dense = all_reduce_seconds(4.0 * (n - x), 8, group_link(H100, 8, 4))
        routed = all_reduce_seconds(4.0 * x, 2, group_link(H100, 2, 16))
        assert seconds == pytest.approx(dense + routed)
    # ...and the layout's ranks join the ep group (all-to-all: every peer point to point)
    # and the edp group (a collective), split from the dp group.
    comms = {c.name: c for c in communicators(cfg, layout, 4)}
    assert list(comms["ep"].ranks) == [0, 4, 8, 12] and comms["ep"].peers == (0, 8, 12)
    assert list(comms["edp"].ranks) == [4, 20] and comms["edp"].collectives


def test_the_experts_gemms_take_the_rows_of_ep_ranks() -> None:
    model = model_preset("qwen3-30b-a3b")
    tokens = 4096
    for ep in (1, 2, 8):
        gemms = layer_gemms(model, 1, 1, moe=True, ep=ep)
        fc1, fc2 = gemms[3], gemms[4]
        assert fc1 == Gemm(tokens * 8 * ep // 128, 2 * 768, 2048, 128 // ep)
        assert fc2 == Gemm(tokens * 8 * ep // 128, 2048, 768, 128 // ep)
        assert fc1.flops == 2 * tokens * 8 * 2 * 768 * 2048  # a rank's t k rows, any ep
    # Qwen3's attention: QKV 2048 -> 32 x 128 + 2 x 4 x 128, the projection 4096 -> 2048.
    assert gemms[:2] == [Gemm(tokens, 4096 + 1024, 2048), Gemm(tokens, 2048, 4096)]


def test_full_recomputation_repeats_the_forward_all_to_alls() -> None:
    model, c = model_preset("mixtral-8x7b"), Compute(H100, _mixtral(1).train.precision, PTDP)
    kw = dict(micro_batch=1, tp=4, c=c)
    plain = ep_comm_seconds(model, ep=4, recompute=Recompute.NONE, **kw)
    full = ep_comm_seconds(model, ep=4, recompute=Recompute.FULL, **kw)
    assert plain.f == plain.b > 0 and full.f == plain.f and full.b == 2 * plain.b
    none = ep_comm_seconds(model, ep=1, recompute=Recompute.FULL, **kw)
    assert (none.f, none.b, none.w) == (0.0, 0.0, 0.0)


def test_expert_layouts_fold_ep_and_etp_over_the_stage_ranks() -> None:
    # (ep, etp): ep divides the experts, ep * etp the stage's t * d * cp ranks, etp divides t.
    assert expert_layouts(8, 1, 16) == [(1, 1), (2, 1), (4, 1), (8, 1)]
    assert expert_layouts(128, 1, 12) == [(1, 1), (2, 1), (4, 1)]
    assert expert_layouts(6, 1, 4) == [(1, 1), (2, 1)]
    assert expert_layouts(0, 8, 16) == [(1, 1)]  # a dense model
    assert expert_layouts(8, 1, 16, ep=4) == [(4, 1)] and expert_layouts(8, 1, 6, ep=4) == []
    # Folded: at t = 2, d = 2 the experts take all four ranks, ep over tensor ranks too.
    assert expert_layouts(8, 2, 2) == [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]
    assert expert_layouts(8, 2, 2, etp=2) == [(1, 2), (2, 2)]


SMALL = {"num_layers": 4, "hidden_size": 512, "num_heads": 8, "num_query_groups": 4}
SMALL |= {"vocab_size": 1024, "seq_length": 1024}


def _small(preset: str, **model: object) -> RunConfig:
    """`preset` at 4 layers of 512, one-sample microbatches of a 32-sample batch."""
    model = MODEL_PRESETS[preset] | SMALL | model
    train = {"global_batch_size": 32, "micro_batch_size": 1, "precision": "bf16"}
    return apply_updates(RunConfig(), {"model": model, "train": train}, "test")


def _tiny_moe() -> RunConfig:
    """Qwen3's family (128-wide heads apart from h / heads) with 8 experts of 256, top-2."""
    return _small("qwen3-30b-a3b", num_experts=8, moe_top_k=2, moe_ffn_hidden_size=256)


def test_the_planner_searches_every_valid_ep_and_only_those() -> None:
    base = _tiny_moe()
    c = Compute(H100, base.train.precision, PTDP)
    space = Space(tps=(1, 2), modes=tuple(Recompute), schedules=("1f1b",), max_micro_batch=1)
    found = search(base, 16, c, space, Plans())
    seen: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for cfg in found.configs:
        layout = validate(cfg, 16, gpus=True)  # every candidate is a valid layout
        ranks = layout.tp * layout.dp * layout.cp  # one stage's: the experts fold over them
        assert 8 % layout.ep == 0 and ranks % (layout.ep * layout.etp) == 0
        seen.setdefault((layout.tp, ranks), set()).add((layout.ep, layout.etp))
    for (t, ranks), pairs in seen.items():  # every (ep, etp) the rules take: etp | t
        etps = [x for x in (1, 2) if t % x == 0]
        assert pairs == {(e, x) for x in etps for e in (1, 2, 4, 8) if ranks % (e * x) == 0}
    assert max(ep for pairs in seen.values() for ep, _ in pairs) == 8
    assert any(k[3] > 1 for k in found.eq1)  # equation (1) per (t, cp, p, ep, etp, zero)
    assert any(k[4] > 1 for k in found.eq1)  # etp is searched too
    # A dense model: ep = 1 only.
    dense = search(_small("llama3-8b"), 16, c, space, Plans()).configs
    assert dense and {cfg.parallel.ep for cfg in dense} == {1}


def test_plan_pins_ep_and_shows_it(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan(_tiny_moe(), gpus=16, system=H100, ep=4, top=3)
    assert result.options and all(o.prediction.layout.ep == 4 for o in result.options)
    args = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "64", "--device", "h100-sxm"]
    args += ["--global-batch", "64", "--tp", "4", "--pp", "4", "--parallel.ep", "4"]
    assert main([*args, "--model.num_layers", "8", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    assert best["layout"]["ep"] == 4 and best["config"]["parallel"]["ep"] == 4
    assert best["ep_layer_ms"] > 0 and "ep=4" in best["summary"]
    assert main([*args, "--model.num_layers", "8"]) == 0
    text = capsys.readouterr().out
    assert "--parallel.ep 4" in text and "expert parallel ep=4" in text


def test_simulate_takes_ep_on_the_command_line(tmp_path: Path, capsys) -> None:
    args = ["simulate", "--model", "mixtral-8x7b", "--gpus", "64", "--device", "h100-sxm"]
    args += ["--parallel.tp", "4", "--parallel.pp", "4", "--model.seq_length", "4096"]
    args += ["--train.global_batch_size", "64", "--train.micro_batch_size", "1"]
    args += ["--out", str(tmp_path)]
    assert main([*args, "--parallel.ep", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["ep"] == 4 and out["ep_layer_ms"] > 0
    assert main([*args, "--parallel.ep", "4"]) == 0
    text = capsys.readouterr().out
    assert "ep=4" in text and "expert parallel all-to-alls per MoE layer" in text
    assert main([*args, "--parallel.ep", "3"]) == 2  # 3 divides neither 8 experts nor d = 4
    assert "parallel.ep" in capsys.readouterr().err


def test_a_calibrated_all_to_all_prices_the_dispatch_and_combine(tmp_path: Path) -> None:
    # `ptdp calibrate` writes the all-to-all's own fit into its link; the experts' transfers
    # take it, the ring collectives keep the link's figures.
    text = (Path(__file__).parents[2] / "ptdp/perf/cost/hardware/h100-sxm.toml").read_text()
    path = tmp_path / "a2a.toml"
    keys = "[node]\nall_to_all_latency_us = 40\nall_to_all_bandwidth_gb_s = 100"
    path.write_text(text.replace("[node]", keys, 1))
    system = load_system(path)
    sent = 64 * 2**20
    assert all_to_all_seconds(sent, 8, system.intra) == pytest.approx(
        40e-6 + 7 * system.intra.step_latency + sent / 100e9
    )
    link = group_link(system, 8, 1)
    assert all_reduce_seconds(sent, 8, link) == all_reduce_seconds(sent, 8, H100.intra)
    cfg = _mixtral(2)
    c = Compute(system, cfg.train.precision, PTDP)
    got = ep_comm_seconds(cfg.model, micro_batch=1, tp=4, ep=2, recompute=Recompute.NONE, c=c)
    one = all_to_all_seconds(alltoall_bytes(4096, 2, 4096, 2, 2), 2, system.intra)
    assert got.f == got.b == pytest.approx(2 * one)
