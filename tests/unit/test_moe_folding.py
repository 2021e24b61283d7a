"""Parallel folding: the experts' own (etp, ep, edp) layout over a stage's tp*cp*dp ranks,
and the rules that refuse the layouts it cannot take, before any process group."""

from __future__ import annotations

import pytest

from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.parallel.mesh import MeshShape, ParallelMesh
from ptdp.rules.layout import validate

MOE = {"num_experts": 8, "moe_top_k": 2}


def test_the_experts_fold_etp_fastest_then_ep_then_edp_within_a_stage() -> None:
    # tp=2, dp=4, pp=2: a stage holds 8 ranks; etp=2, ep=2 leave edp=2
    shape = MeshShape(tp=2, dp=4, pp=2, ep=2, etp=2)
    assert shape.expert_group_ranks("etp")[:2] == [[0, 1], [2, 3]]
    assert shape.expert_group_ranks("ep")[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.expert_group_ranks("edp")[:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all(min(g) >= 8 for g in shape.expert_group_ranks("ep")[4:])  # stage 2 apart
    mesh = ParallelMesh(shape, rank=7)
    assert [mesh.coord(a) for a in ("etp", "ep", "edp")] == [1, 1, 1]
    assert [mesh.size(a) for a in ("etp", "ep", "edp")] == [2, 2, 2]


def test_etp_equal_to_tp_is_the_unfolded_layout() -> None:
    """ep over consecutive members of each dp*cp group, edp a stride of ep apart: the
    layout of experts split like the dense layers."""
    shape = MeshShape(tp=2, dp=2, cp=2, ep=2, etp=2)
    assert shape.expert_group_ranks("etp") == shape.group_ranks("tp")
    for members in shape.group_ranks("dp_cp"):
        assert members[0:2] in shape.expert_group_ranks("ep")
        assert members[0::2] in shape.expert_group_ranks("edp")


def test_folded_ep_spans_the_tensor_ranks() -> None:
    shape = MeshShape(tp=2, dp=2, ep=4)
    assert shape.expert_group_ranks("ep") == [[0, 1, 2, 3]]
    assert shape.expert_group_ranks("edp") == [[0], [1], [2], [3]]
    shape = MeshShape(tp=4, dp=1, ep=1, etp=1)  # every expert whole on each tensor rank
    assert shape.expert_group_ranks("edp") == [[0, 1, 2, 3]]


def _refusal(world: int, model: dict, parallel: dict) -> str:
    cfg = apply_updates(RunConfig(), {"model": MOE | model, "parallel": parallel}, "t")
    with pytest.raises(ConfigError) as info:
        validate(cfg, world)
    return str(info.value)


@pytest.mark.parametrize(
    ("world", "model", "parallel", "message"),
    [
        (4, {}, {"tp": 2, "ep": 4, "etp": 2}, "ep * parallel.etp = 4 * 2 = 8 does not divide"),
        (4, {}, {"tp": 2, "ep": 4, "etp": 2}, "--parallel.ep 2"),
        (4, {}, {"tp": 2, "ep": 3}, "model.num_experts = 8 is not divisible by parallel.ep = 3"),
        (2, {"moe_ffn_hidden_size": 33}, {"tp": 2, "etp": 2}, "not divisible by parallel.etp = 2"),
        (2, {"moe_ffn_hidden_size": 33}, {"tp": 2, "etp": 2}, "--parallel.etp 1"),
        (2, {"moe_capacity_factor": 1.25}, {"tp": 2}, "--parallel.etp 2"),
        (1, {"num_experts": 0, "moe_top_k": 2}, {"etp": 2}, "model.num_experts = 0"),
        (2, {}, {"tp": 2, "etp": 0}, "parallel.etp = 0 must be >= 1"),
        (2, {"seq_length": 33}, {"tp": 2}, "each tensor rank routes its own slice"),
    ],
)  # fmt: skip
def test_bad_folded_layouts_are_refused_naming_a_fix(
    world: int, model: dict, parallel: dict, message: str
) -> None:
    assert message in _refusal(world, model, parallel)


@pytest.mark.parametrize(
    "parallel",
    [{"tp": 2, "ep": 2}, {"tp": 2, "ep": 4}, {"tp": 2, "ep": 2, "etp": 2}, {"tp": 4, "etp": 2}],
)
def test_folded_layouts_are_accepted(parallel: dict) -> None:
    train = {"micro_batch_size": 1, "global_batch_size": 8}
    cfg = apply_updates(RunConfig(), {"model": MOE, "parallel": parallel, "train": train}, "t")
    layout = validate(cfg, 4)
    assert (layout.ep, layout.etp) == (parallel.get("ep", 1), parallel.get("etp", 1))
    assert layout.folded


def test_a_dense_model_keeps_attention_s_layout() -> None:
    layout = validate(apply_updates(RunConfig(), {"parallel": {"tp": 2}}, "t"), 2)
    assert layout.etp == 2 and not layout.folded
