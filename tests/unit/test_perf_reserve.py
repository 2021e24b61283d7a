"""The memory reserve per rank (`ptdp.perf.cost.reserve`): each term on hand-computed layouts, the
file's fixed `reserved_gib` overriding the formula, and the same reserve in simulate and plan."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.parallel.mesh import MeshShape
from ptdp.perf.cost.costs import Compute
from ptdp.perf.cost.hardware import GIB
from ptdp.perf.cost.hardware_file import BUILTIN_DIR, load_system
from ptdp.perf.cost.memory import estimate_memory
from ptdp.perf.cost.reserve import (
    CUDA_CONTEXT_BYTES,
    _group,
    _in_node,
    communicators,
    fit,
    nccl_bytes,
    rank_reserve,
    with_reserve,
)
from ptdp.perf.cost.software import PTDP
from ptdp.perf.plan.search import Plans, _need
from ptdp.perf.simulate.simulator import simulate
from ptdp.rules.layout import COMBINED, ORDER, validate

MIB = 2**20
A100 = load_system("a100-80gb")  # 8 GPUs a node
SPANNING = 16 * 3 * 12 * MIB  # 2 channels per NIC x 8 NICs, ring + tree up + down, 12 MiB each
IN_NODE = 32 * 12 * MIB  # 32 channels, ring only


def gpt(gpus: int, layers: int = 8, hidden: int = 1024, **parallel: object) -> RunConfig:
    sections = {
        "model": {
            "num_layers": layers,
            "hidden_size": hidden,
            "num_heads": 16,
            "seq_length": 2048,
            "vocab_size": 51200,
        },
        "parallel": parallel,
        "train": {"precision": "bf16", "micro_batch_size": 1, "global_batch_size": 64},
    }
    return apply_updates(RunConfig(), sections, "test")


def reserve_of(cfg: RunConfig, gpus: int, system=A100, rank: int = 0):
    layout = validate(cfg, gpus)
    memory = estimate_memory(cfg, gpus, layout=layout)
    return rank_reserve(cfg, layout, system, memory[rank]), memory[rank], layout


def test_one_gpu_holds_the_context_and_one_more_largest_transient_only() -> None:
    cfg = gpt(1)
    r, _, layout = reserve_of(cfg, 1)
    assert communicators(cfg, layout, 0) == []
    assert (r.context, r.nccl) == (CUDA_CONTEXT_BYTES, 0.0)
    assert r.allocator == 2048 * 4 * 51200  # the fp32 logit gradient [s b, v], once more
    assert r.total < 1.5 * GIB < 4 * GIB  # the old fixed figure over-reserved here
    compiled = replace(cfg, train=replace(cfg.train, compile=True))  # 16-bit logits
    assert reserve_of(compiled, 1)[0].allocator == 2048 * 2 * 51200
    bigger = gpt(1)
    bigger = replace(bigger, train=replace(bigger.train, micro_batch_size=4))
    assert reserve_of(bigger, 1)[0].allocator == 4 * r.allocator  # grows with the activations
    middle = gpt(16, tp=8, pp=2)  # not the last stage: the MLP's [s b, f/t] gradient in bf16
    assert reserve_of(middle, 16)[0].allocator == 2048 * 2 * 4096 // 8


def test_pure_data_parallel_across_nodes_hand_computed() -> None:
    cfg = gpt(32)  # d = 32 over 4 nodes: the dp group and the world, both spanning nodes
    r, _, layout = reserve_of(cfg, 32)
    names = [c.name for c in communicators(cfg, layout, 0)]
    assert names == ["dp", "world"]
    assert r.nccl == 2 * SPANNING  # 1152 MiB: no point-to-point peer without a pipeline


def test_tensor_parallel_inside_one_node_hand_computed() -> None:
    cfg = gpt(8, tp=8)
    r, _, layout = reserve_of(cfg, 8)
    assert [c.name for c in communicators(cfg, layout, 0)] == ["tp", "world"]
    assert r.nccl == 2 * IN_NODE  # 768 MiB: 32 channels of one connection each, twice


def test_nvls_buffers_on_h100_nodes_hand_computed() -> None:
    cfg = gpt(8, tp=8)  # 16 NVLS channels x 2 x 128 KiB x 8 steps, one head per local rank
    r, _, _ = reserve_of(cfg, 8, load_system("h100-sxm"))
    assert r.nccl == 2 * (IN_NODE + 8 * 32 * MIB)


def test_pipeline_peers_across_nodes_hand_computed() -> None:
    cfg = gpt(16, tp=8, pp=2)  # stages on two nodes; the tied embedding's pair spans them
    r, _, layout = reserve_of(cfg, 16)
    comms = communicators(cfg, layout, 0)
    assert [c.name for c in comms] == ["tp", "pp", "embedding", "world"]
    world = comms[-1]
    assert world.peers == (8,)  # pp = 2: one neighbour, both directions on one connection
    assert nccl_bytes(world, 0, 8) == SPANNING + 2 * 4 * MIB  # 2 channels per net peer
    assert r.nccl == IN_NODE + 3 * SPANNING + 2 * 4 * MIB
    looped = gpt(32, tp=8, pp=4, vpp=2, schedule="interleaved")  # the last stage feeds the first
    assert communicators(looped, validate(looped, 32), 0)[-1].peers == (8, 24)
    plain = gpt(32, tp=8, pp=4)
    assert communicators(plain, validate(plain, 32), 0)[-1].peers == (8,)


def test_a_4d_rank_sits_in_more_communicators_than_pure_dp_and_reserves_more() -> None:
    dp_cfg, four_cfg = gpt(32), gpt(32, tp=4, cp=2, pp=2)  # d = 2
    dp, _, dp_layout = reserve_of(dp_cfg, 32)
    four, _, four_layout = reserve_of(four_cfg, 32)
    names = [c.name for c in communicators(four_cfg, four_layout, 0)]
    assert names == ["tp", "cp", "dp", "dp_cp", "pp", "embedding", "world"]
    assert len(names) > len(communicators(dp_cfg, dp_layout, 0))
    assert four.nccl > dp.nccl
    ring = gpt(32, tp=4, cp=2, pp=2, cp_comm="ring")  # the cp ring: p2p with one peer
    cp = communicators(ring, validate(ring, 32), 0)[1]
    assert (cp.name, cp.collectives, cp.peers) == ("cp", False, (4,))
    assert nccl_bytes(cp, 0, 8) == 32 * 12 * MIB  # in the node: 32 channels per peer


def _file(tmp_path: Path, reserve: str) -> Path:
    text = (BUILTIN_DIR / "a100-80gb.toml").read_text()
    path = tmp_path / "hw.toml"
    path.write_text(text.replace("kernel_overhead_us = 5\n", f"kernel_overhead_us = 5\n{reserve}"))
    return path


def test_a_files_reserved_gib_overrides_the_formula_everywhere(tmp_path: Path) -> None:
    fixed = load_system(_file(tmp_path, "reserved_gib = 6\n"))
    cfg = gpt(16, tp=8, pp=2)
    r, _, _ = reserve_of(cfg, 16, fixed)
    assert r.total == 6 * GIB
    p = simulate(cfg, fixed, 16, timeline=False)
    assert [m.reserved for m in p.memory] == [6 * GIB, 6 * GIB]
    assert fit(p.memory, fixed.device)[1] == 74 * GIB
    formula = simulate(cfg, A100, 16, timeline=False)
    assert [m.reserved for m in formula.memory] == [
        rank_reserve(cfg, formula.layout, A100, m).total for m in formula.memory
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1", "reserved_gib = -1 must be >= 0"),
        ('"4 GiB"', "reserved_gib = '4 GiB' is not a number"),
    ],
)
def test_a_broken_reserved_gib_is_refused(tmp_path: Path, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_system(_file(tmp_path, f"reserved_gib = {value}\n"))


def test_plan_and_simulate_apply_the_same_reserve_and_it_decides_the_fit(tmp_path: Path) -> None:
    cfg = gpt(16, tp=8, pp=2)
    plans = Plans()
    for system in (A100, load_system(_file(tmp_path, "reserved_gib = 4\n"))):
        need, usable = _need(cfg, 16, Compute(system, cfg.train.precision, PTDP), plans)
        p = simulate(cfg, system, 16, timeline=False)
        assert (need, usable) == fit(p.memory, system.device)
        worst = max(p.memory, key=lambda m: m.total + m.reserved)
        assert (need, usable) == (worst.total, system.device.memory_bytes - worst.reserved)
    # A device just large enough for the model's count and the formula's reserve, but not
    # for the old fixed 4 GiB: the formula fits it, the fixed figure refuses it.
    cfg = gpt(16, layers=16, hidden=4096, tp=8, pp=2)
    p = simulate(cfg, A100, 16, timeline=False)
    worst = max(p.memory, key=lambda m: m.total + m.reserved)
    assert worst.reserved < 4 * GIB
    room = (worst.total + worst.reserved) / GIB + 0.01
    text = (
        (BUILTIN_DIR / "a100-80gb.toml")
        .read_text()
        .replace("memory_gib = 80 ", f"memory_gib = {room} ")
    )
    (tmp_path / "small.toml").write_text(text)
    small = load_system(tmp_path / "small.toml")
    need, usable = fit(simulate(cfg, small, 16, timeline=False).memory, small.device)
    assert need <= usable
    (tmp_path / "fixed.toml").write_text(
        text.replace("kernel_overhead_us = 5\n", "kernel_overhead_us = 5\nreserved_gib = 4\n")
    )
    fixed = load_system(tmp_path / "fixed.toml")
    need, usable = fit(simulate(cfg, fixed, 16, timeline=False).memory, fixed.device)
    assert need > usable


def test_the_groups_counted_are_the_meshs_own() -> None:
    """`communicators` builds one rank's groups by arithmetic (the planner asks for thousands);
    they are the groups `ptdp.parallel.mesh` creates, and the node counts match walking them."""
    for tp, cp, dp, pp in [(1, 1, 4, 1), (2, 3, 1, 2), (4, 2, 3, 5), (2, 1, 2, 3)]:
        shape = MeshShape(tp=tp, cp=cp, dp=dp, pp=pp)
        for axis in (*ORDER, *COMBINED):
            for rank in range(shape.world_size):
                want = next(g for g in shape.group_ranks(axis) if rank in g)
                got = _group(shape.sizes(), rank, axis)
                assert list(got) == want
                for node in range(shape.world_size // 4 + 1):
                    assert _in_node(got, node, 4) == sum(r // 4 == node for r in want)


@pytest.mark.parametrize(
    ("gpus", "parallel"),
    [
        (12, {"tp": 2, "pp": 3, "pipeline_layers": [3, 3, 2]}),  # d = 2: half a second node
        (
            32,
            {"tp": 2, "pp": 4, "vpp": 2, "schedule": "interleaved"},
        ),  # interleaved: the last stage sends to the first
        (32, {"tp": 1, "cp": 2, "pp": 8, "cp_comm": "ring"}),
    ],
)
def test_ranks_sharing_a_position_share_the_nccl_term(gpus: int, parallel: dict) -> None:
    cfg = gpt(gpus, **parallel)
    layout = validate(cfg, gpus)
    for system in (A100, load_system("h100-sxm")):
        memory = estimate_memory(cfg, gpus, layout=layout)
        alone = [rank_reserve(cfg, layout, system, m).total for m in memory]
        assert [m.reserved for m in with_reserve(memory, cfg, layout, system)] == alone
