"""Honest fit in every output: `simulate`'s verdict at its limiting rank (JSON and text), the
planner ranking only layouts that fit, and its refusal naming the constraint that binds."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.config.enums import Precision
from ptdp.perf.cost.hardware import GIB
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.plan.refusal import Constraint, constraint_of
from ptdp.perf.report import format_prediction
from ptdp.perf.simulate.simulator import simulate
from ptdp.perf.validate.paper import perf_config

H100 = "h100-sxm"
LLAMA = ["--model", "llama3-8b", "--device", H100, "--train.micro_batch_size", "1"]


def _simulate(tmp_path: Path, capsys, *args: str) -> str:
    assert (
        main(["simulate", *LLAMA, "--train.global_batch_size", "8", "--out", str(tmp_path), *args])
        == 0
    )
    return capsys.readouterr().out


def test_json_of_a_layout_that_does_not_fit(tmp_path: Path, capsys) -> None:
    out = json.loads(_simulate(tmp_path, capsys, "--json"))
    assert out["fits"] is False
    assert out["limiting_rank"] == {
        "pp_rank": 0, "stages": [0], "first_global_rank": 0, "last_global_rank": 0,
    }  # fmt: skip
    terms = out["limiting_memory_gib"]
    assert out["capacity_gib"] == pytest.approx(79.6)
    assert out["need_gib"] == pytest.approx(199.21, abs=0.005)
    assert out["over_by_gib"] == pytest.approx(out["need_gib"] - 79.6)
    assert terms["total"] == pytest.approx(194.55, abs=0.005)
    assert terms["reserve"] == pytest.approx(4.66, abs=0.005)
    assert terms["optimizer"] == pytest.approx(89.75, abs=0.005)  # 8.03B x 12 B
    parts = ("params", "gathered", "grads", "grad_buckets", "optimizer", "activations")
    assert sum(terms[k] for k in (*parts, "working", "stash")) == pytest.approx(terms["total"])
    assert terms["total"] + terms["reserve"] == pytest.approx(out["need_gib"])
    assert out["memory_gib"][0]["total"] == terms["total"]  # the old per-rank list stays
    assert out["layout"]["world_size"] == 1 and "iteration_seconds" in out


def test_json_of_a_layout_that_fits(tmp_path: Path, capsys) -> None:
    tp_pp = ["--gpus", "8", "--parallel.tp", "2", "--parallel.pp", "4", "--json"]
    out = json.loads(_simulate(tmp_path, capsys, *tp_pp))
    assert out["fits"] is True and out["over_by_gib"] == 0.0
    # pp rank 0 holds the embedding and 4 microbatches in flight: global ranks 0 and 1 (tp 2)
    assert out["limiting_rank"] == {
        "pp_rank": 0, "stages": [0], "first_global_rank": 0, "last_global_rank": 1,
    }  # fmt: skip
    assert out["need_gib"] == pytest.approx(52.27, abs=0.005)
    assert out["limiting_memory_gib"]["activations"] == pytest.approx(30.0)
    assert max(m["total"] + m["reserved"] for m in out["memory_gib"]) == out["need_gib"]


def test_text_says_the_verdict_once(tmp_path: Path, capsys) -> None:
    text = _simulate(tmp_path, capsys)
    verdict = (
        "does not fit on H100-SXM5-80GB: needs 199.21 GiB of 79.60 GiB on pp rank 0 "
        "(194.55 counted + 4.66 reserve), over by 119.61 GiB"
    )
    assert verdict in text.splitlines()
    assert text.lower().count("does not fit") == 1 and "fits:" not in text
    text = _simulate(tmp_path, capsys, "--gpus", "8", "--parallel.tp", "2", "--parallel.pp", "4")
    fits = (
        "fits: needs 52.27 GiB of 79.60 GiB on pp rank 0 (49.37 counted + 2.91 reserve, "
        "the fullest rank), 27.33 GiB to spare"
    )
    assert fits in text.splitlines() and "does not fit" not in text.lower()


def test_text_shows_the_limiting_rank_of_a_long_pipeline() -> None:
    system = load_system(H100)
    cfg = perf_config("llama3-8b", None, ["--parallel.pp", "16", "--train.global_batch_size", "32"])
    p = simulate(cfg, system, 16)
    memory = list(p.memory)
    memory[6] = replace(memory[6], activations=1000 * GIB)  # the fullest, mid-pipeline
    p = replace(p, memory=tuple(memory))
    assert p.limiting.rank == 6 and not p.fits
    rows = [
        line.split("|")[0].strip()
        for line in format_prediction(p, system, Precision.BF16).splitlines()
    ]
    assert rows[rows.index("pp rank") + 1 :][:8] == ["0", "1", "2", "...", "6", "...", "14", "15"]
    text = format_prediction(p, system, Precision.BF16)
    assert "on pp rank 6 (" in text and "over by" in text


def test_plan_ranks_only_layouts_that_fit(capsys) -> None:
    # llama3-8b on 8 H100s: some layouts (t=1 p=2, ...) need more than 80 GB
    args = ["plan", *LLAMA[:4], "--gpus", "8", "--train.global_batch_size", "8", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    memory = [r for r in out["rejected"] if r["constraint"] == "memory"]
    assert memory and all("GiB" in r["reason"] for r in memory)
    assert len(out["options"]) == 5
    assert all(o["fits"] and o["over_by_gib"] == 0.0 for o in [*out["options"], out["best"]])
    assert all(o["need_gib"] <= o["capacity_gib"] for o in out["options"])


def _refusal(capsys, *args: str) -> list[str]:
    assert main(["plan", "--device", H100, *args]) == 1  # searched, nothing to rank
    return capsys.readouterr().out.splitlines()


def test_refusal_memory(capsys) -> None:
    lines = _refusal(
        capsys, "--model", "llama3-70b", "--gpus", "2", "--train.global_batch_size", "8"
    )
    assert lines[0] == "no layout fits in memory on 2 GPUs of h100-sxm:"
    assert lines[1] == (
        "  - memory (4 layouts): each needs more than a GPU holds; the closest, t=2 p=1, needs "
        "601.7 GiB per GPU with recompute=full at b=1, 76.0 GiB usable: over by 525.6 GiB, "
        "7.9x. The model state per GPU shrinks at best as 1 / GPUs (over t*p, and with ZeRO "
        "over d): at least 7.9x the GPUs (e.g. --gpus 16), or a device with more memory"
    )
    assert lines[2] == "refused:" and len(lines) == 7


def test_refusal_batch_and_world_size(capsys) -> None:
    # 7 GPUs: no t of an 8-GPU node nor p of 32 layers divides 7, and d = 7 does not divide 8
    lines = _refusal(capsys, *LLAMA[:2], "--gpus", "7", "--train.global_batch_size", "8")
    assert lines[:2] == [
        "no layout can run on 7 GPUs of h100-sxm, bound by the global batch:",
        "  - the global batch (1 layout): 8 samples are not divisible by the data-parallel "
        "size d = 7 that 7 GPUs leave (their only split: t = cp = p = 1); use a global batch "
        "that is a multiple of 7, e.g. 14, or --gpus 4 or 8",
    ]
    assert "no layout fits" not in "\n".join(lines)
    # p = 4 pinned on 12 GPUs: d = 3 at t = 1, and t*cp*p = 8, 16, 32 do not divide 12
    pinned = ["--gpus", "12", "--parallel.pp", "4", "--train.global_batch_size", "8"]
    lines = _refusal(capsys, *LLAMA[:2], *pinned)
    assert lines[:3] == [
        "no layout can run on 12 GPUs of h100-sxm, bound by the global batch and the GPU count:",
        "  - the global batch (1 layout): 8 samples are not divisible by the data-parallel "
        "size d = 3 that 12 GPUs leave; use a global batch that is a multiple of 3, e.g. 9, "
        "or --gpus 8 or 16",
        "  - the GPU count (5 layouts): 12 GPUs are not a multiple of t*cp*p = 8, 16, 32",
    ]


def test_refusal_layers(capsys) -> None:
    lines = _refusal(
        capsys, *LLAMA[:2], "--gpus", "5", "--parallel.pp", "5", "--train.global_batch_size", "10"
    )
    assert lines[0] == (
        "no layout can run on 5 GPUs of h100-sxm, bound by the layer count and the GPU count:"
    )
    assert lines[1].startswith(
        "  - the layer count (1 layout): model.num_layers = 32 is not divisible by pp*vpp = 5*1"
    )
    assert lines[2] == "  - the GPU count (1 layout): 5 GPUs are not a multiple of t*cp*p = 10"


def test_refusal_json_names_each_constraint(capsys) -> None:
    args = [
        "plan",
        *LLAMA[:4],
        "--gpus",
        "12",
        "--parallel.pp",
        "4",
        "--train.global_batch_size",
        "8",
    ]
    assert main([*args, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["best"] is None and out["options"] == []
    assert [r["constraint"] for r in out["rejected"]] == ["batch"] + ["world"] * 5
    assert out["explanation"][0].startswith("no layout can run on 12 GPUs")


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        ("train.global_batch_size = 8 is not divisible by micro_batch_size*dp = 3*8 = 24", "BATCH"),
        ("parallel.schedule = interleaved with 6 microbatches per step (...)", "BATCH"),
        ("model.num_layers = 32 is not divisible by pp*vpp = 5*1; ...", "LAYERS"),
        ("world size 12 is not divisible by tp*cp*pp = 1*1*8 = 8; ...", "WORLD"),
        ("model.num_heads = 12 is not divisible by parallel.tp = 8: tensor ...", "SHAPE"),
        ("optim.lr = 0 must be > 0", "OTHER"),
    ],
)
def test_validate_reasons_sorted_by_constraint(reason: str, kind: str) -> None:
    assert constraint_of(reason) is Constraint[kind]
