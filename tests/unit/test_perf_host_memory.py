"""Host memory per rank (`ptdp.perf.cost.host_memory`): each phase counted by hand for a small
Llama-like model at t = 2, p = 2 and an MoE at ep = 4; the node's sum against its memory; the
planner refusing a layout whose start does not fit, and keeping one that fits; the hardware
file's `[node] host_memory_gib`; and the lines `ptdp simulate` prints."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.config.enums import Activation, Normalization, PositionEmbedding, Precision
from ptdp.config.files import apply_updates
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.errors import ConfigError
from ptdp.perf.cost.hardware import GIB
from ptdp.perf.cost.hardware_file import BUILTIN_DIR, load_system
from ptdp.perf.cost.host_memory import (
    PROCESS_BASELINE_BYTES,
    HostMemory,
    Start,
    host_memory,
    largest_tensor,
    node_fit,
)
from ptdp.perf.plan.explain import host_memory_line
from ptdp.perf.plan.planner import plan
from ptdp.perf.plan.refusal import Constraint
from ptdp.perf.report import format_prediction
from ptdp.perf.simulate.simulator import simulate
from ptdp.rules.layout import validate

H100 = load_system("h100-sxm")
# h 64, 4 heads of 16, 2 key/value groups: QKV [64, 64 + 2 * 32] = 8192, projection 4096,
# SwiGLU fc1 [2 * 128, 64] = 16384, fc2 8192; two RMSNorms of 64; vocabulary 512 unpadded.
LLAMA = ModelConfig(
    num_layers=4,
    hidden_size=64,
    num_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=512,
    make_vocab_size_divisible_by=1,
    seq_length=32,
    position_embedding=PositionEmbedding.ROPE,
    normalization=Normalization.RMSNORM,
    activation=Activation.SWIGLU,
    tie_embeddings=False,
    bias=False,
)
LAYER = (8192 + 4096 + 16384 + 8192) // 2 + 2 * 64  # one layer on one of t = 2 ranks
FIRST = 2 * LAYER + 512 // 2 * 64  # pp rank 0: two layers and the embedding's half
LAST = 2 * LAYER + 64 + 512 // 2 * 64  # pp rank 1: the final norm and the output's half


def run(model: ModelConfig, **parallel: object) -> RunConfig:
    return apply_updates(
        RunConfig(),
        {
            "model": model.__dict__,
            "parallel": parallel,
            "train": {"global_batch_size": 16, "micro_batch_size": 1, "precision": "bf16"},
        },
        "test",
    )


def test_each_phase_of_a_dense_model_at_t2_p2_by_hand() -> None:
    cfg = run(LLAMA, tp=2, pp=2)
    first, last = host_memory(cfg, validate(cfg, 8, gpus=True))  # d = 2, no ZeRO
    largest = 512 * 64  # the embedding (or output) [v, h] in fp32: 4 bytes each
    assert largest_tensor(LLAMA) == largest
    assert first.baseline == PROCESS_BASELINE_BYTES == 3 * GIB
    assert first.hf_start == 1.5 * 4 * FIRST + 4 * largest
    assert last.hf_start == 1.5 * 4 * LAST + 4 * largest
    assert first.scratch == 4 * largest  # one full master value at a time
    assert first.resume == pytest.approx(1.6 * 12 * FIRST)  # fp32 weights and two moments
    assert first.async_save == 12 * FIRST
    assert first.save == 3 * 4 * (512 // 2 * 64)  # writer threads + 1 of its largest (vocab half)
    # ZeRO-1 over d = 2: each rank owns, saves and resumes half of its pipeline rank's state
    cfg = run(LLAMA, tp=2, pp=2, zero=1)
    sharded = host_memory(cfg, validate(cfg, 8, gpus=True))[0]
    assert sharded.resume == pytest.approx(1.6 * 12 * FIRST / 2)
    assert sharded.async_save == 12 * FIRST / 2 and sharded.hf_start == first.hf_start


def test_an_moe_at_ep4_by_hand() -> None:
    # 16 experts of width 64, 4 per rank (ep = 4, each whole: etp = 1), t = 2, d = 4: the
    # same experts on edp = t d / (ep etp) = 2 ranks.
    moe = replace(LLAMA, num_layers=2, num_experts=16, moe_ffn_hidden_size=64, moe_top_k=2)
    cfg = run(moe, tp=2, ep=4, etp=1, zero=1)
    (rank,) = host_memory(cfg, validate(cfg, 8, gpus=True))
    expert = 64 * 64 * 2 + 64 * 64  # SwiGLU fc1 [2 * 64, 64] and fc2 [64, 64], whole
    routed = 2 * 4 * expert  # two MoE layers, four experts each
    rest = 2 * ((8192 + 4096) // 2 + 2 * 64 + 16 * 64) + 2 * 256 * 64 + 64  # router replicated
    fused = 16 * 2 * 64 * 64  # all of a layer's experts' fc1 in one (transformers 5)
    assert largest_tensor(moe) == fused
    assert rank.hf_start == 1.5 * 4 * (rest + routed) + 4 * fused
    owned = rest / 4 + routed / 2  # ZeRO: the rest over d = 4, the experts over edp = 2
    assert rank.resume == pytest.approx(1.6 * 12 * owned)
    assert rank.async_save == pytest.approx(12 * owned)
    assert rank.save == 3 * 4 * (4 * 2 * 64 * 64)  # its four experts' fc1, 2 threads + 1


def test_the_node_sums_its_ranks_and_the_start_and_saves_count() -> None:
    cfg = run(LLAMA, tp=2, pp=2)
    layout = validate(cfg, 8, gpus=True)
    host = host_memory(cfg, layout)
    needs = [PROCESS_BASELINE_BYTES + h.resume for h in host]  # resume: larger than HF here
    fit = node_fit(host, layout, H100, Start.ANY, async_save=False)
    assert fit.ranks == 8 and fit.need == pytest.approx(4 * needs[0] + 4 * needs[1])
    assert fit.phase == "resuming from a checkpoint" and fit.fits
    assert fit.usable == pytest.approx(0.9 * 2048 * GIB)
    halves = replace(H100, gpus_per_node=4)  # a node of pp rank 0's ranks, one of pp rank 1's
    assert node_fit(host, layout, halves, Start.ANY, False).need == pytest.approx(4 * max(needs))
    h = HostMemory(0, baseline=1.0, hf_start=5.0, scratch=1.0, resume=3.0, save=2.0, async_save=4.0)
    assert h.peak(Start.ANY, False) == ("starting from Hugging Face weights", 5.0)
    assert h.peak(Start.RESUME, False) == ("resuming from a checkpoint", 3.0)
    assert h.peak(Start.SCRATCH, False) == ("saving", 2.0)
    assert h.peak(Start.SCRATCH, True) == ("saving asynchronously", 4.0)
    assert h.need(Start.RESUME, True) == 1.0 + 4.0


def _plan(host_gib: float, **pins: object):
    system = replace(H100, host_memory_bytes=host_gib * GIB)
    cfg = run(LLAMA)
    return plan(
        cfg, gpus=8, system=system, tp=2, pp=2, zero=0, micro_batch=1, schedules=("1f1b",), **pins
    )


def test_the_planner_refuses_a_layout_whose_start_does_not_fit() -> None:
    # 8 ranks of 3 GiB baseline each (the model's own bytes are tiny) > 0.9 x 20 GiB
    result = _plan(20)
    assert result.best is None
    host = [r for r in result.rejected if r.kind is Constraint.HOST_MEMORY]
    assert host and len(host) == len(result.rejected)
    assert host[0].reason == (
        "host memory: resuming from a checkpoint needs 3.0 GiB per rank, 8 ranks per node "
        "= 24.0 GiB > the node's 18 GiB usable (of 20 GiB, 10% reserved)"
    )
    head, line = result.explanation
    assert head == "no layout fits in host memory on 8 GPUs of h100-sxm:"
    assert line.startswith("host memory (1 layout): each node's ranks need more host memory")
    assert "over by 6.0 GiB" in line and "--host-memory-gib" in line
    hf = _plan(20, start=Start.HF).rejected[0].reason
    assert hf.startswith("host memory: starting from Hugging Face weights needs 3.0 GiB")


def test_the_planner_keeps_a_layout_that_fits() -> None:
    result = _plan(30)  # 24.0 GiB <= 27 GiB usable
    assert result.best is not None
    assert not [r for r in result.rejected if r.kind is Constraint.HOST_MEMORY]


def test_the_plans_why_names_the_recommended_layouts_host_memory() -> None:
    """The 'why' line of a plan: the recommended layout's fullest node, and the count of
    layouts that host memory refused."""
    kept = _plan(30)
    line = "host memory (--start any): resuming from a checkpoint needs 3.0 GiB per rank, "
    line += "8 ranks per node = 24.0 GiB of the node's 27 GiB usable"
    assert [x for x in kept.explanation if "host memory" in x] == [line]
    system = replace(H100, host_memory_bytes=30 * GIB)
    refused = host_memory_line(kept.best, system, Start.ANY, refused=3)
    assert refused == [line + "; 3 layouts refused for host memory"]
    assert host_memory_line(kept.best, replace(H100, host_memory_bytes=None), Start.ANY, 0) == []


def test_the_built_in_nodes_host_memory() -> None:
    gib = {n: load_system(n).host_memory_bytes / GIB for n in ("a100-40gb", "a100-80gb")}
    assert gib == {"a100-40gb": 1024, "a100-80gb": 2048}
    assert load_system("mi250x").host_memory_bytes == 512 * GIB
    for name in ("h100-sxm", "h200", "h800"):
        assert load_system(name).host_memory_bytes == 2048 * GIB


def _with_host(tmp_path: Path, line: str) -> Path:
    text = (BUILTIN_DIR / "a100-80gb.toml").read_text(encoding="utf-8")
    kept = [x for x in text.splitlines() if not x.startswith("host_memory_gib")]
    at = kept.index("gpus = 8") + 1
    path = tmp_path / "cluster.toml"
    path.write_text("\n".join([*kept[:at], *([line] if line else []), *kept[at:]]) + "\n")
    return path


@pytest.mark.parametrize("value", ["0", "-512", "nan"])
def test_a_node_without_positive_host_memory_is_refused(tmp_path: Path, value: str) -> None:
    path = _with_host(tmp_path, f"host_memory_gib = {value}")
    with pytest.raises(ConfigError, match=r"\[node\] host_memory_gib") as exc:
        load_system(path)
    assert str(path) in str(exc.value)


def test_a_file_without_host_memory_is_not_checked(tmp_path: Path) -> None:
    system = load_system(_with_host(tmp_path, ""))
    assert system.host_memory_bytes is None
    cfg = run(LLAMA, tp=2, pp=2)
    text = format_prediction(simulate(cfg, system, 8), system, Precision.BF16)
    assert "not checked: give [node] host_memory_gib in the hardware file" in text


def _simulate(tmp_path: Path, capsys, *args: str) -> str:
    command = ["simulate", "--model", "llama3-8b", "--device", "h100-sxm", "--gpus", "8"]
    command += ["--parallel.tp", "2", "--parallel.pp", "4", "--train.micro_batch_size", "1"]
    command += ["--train.global_batch_size", "8", "--out", str(tmp_path), *args]
    assert main(command) == 0
    return capsys.readouterr().out


def test_simulate_reports_host_memory(tmp_path: Path, capsys) -> None:
    lines = _simulate(tmp_path, capsys).splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("host memory per rank (GiB;"))
    assert "the node's 2048 GiB shared by its 8 ranks" in lines[at]
    assert lines[at + 1] == (
        "  pp rank | baseline | from HF | scratch | resume |  save | async save"
    )
    assert [x.split()[0] for x in lines[at + 2 : at + 6]] == ["0", "1", "2", "3"]
    head = "host memory (--start any: the larger of HF and resume): resuming from a checkpoint"
    assert lines[at + 6].startswith(head)
    assert "GiB, within the node's 1843 GiB usable" in lines[at + 6]
    small = _simulate(tmp_path, capsys, "--host-memory-gib", "64", "--start", "hf")
    assert "host memory (--start hf): starting from Hugging Face weights needs" in small
    assert ", over the node's 58 GiB usable (of 64 GiB) by " in small
    out = json.loads(_simulate(tmp_path, capsys, "--json", "--train.async_save", "true"))
    assert [r["pp_rank"] for r in out["host_memory_gib"]] == [0, 1, 2, 3]
    assert out["host_fit"]["fits"] and out["host_fit"]["node_capacity_gib"] == 2048


def test_a_cpu_holds_its_state_in_host_memory() -> None:
    cpu = replace(H100, device=replace(H100.device, kind="cpu"))
    cfg = run(LLAMA, tp=2, pp=2)
    text = format_prediction(simulate(cfg, H100, 8), cpu, Precision.BF16)
    assert "the training state above is host memory" in text
    assert "host memory per rank" not in text


def test_a_non_positive_host_memory_flag_is_refused(tmp_path: Path, capsys) -> None:
    command = ["simulate", "--model", "llama3-8b", "--host-memory-gib", "0", "--out", str(tmp_path)]
    assert main(command) != 0
    assert "--host-memory-gib" in capsys.readouterr().err
