"""`ptdp plan` and `ptdp simulate` output: the headline, one precision default, the 2021
software in plan, GPU counts instead of launch commands, `plan --compare`, and the
planner's short replays against full simulations."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.config.enums import Recompute
from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.software import MEGATRON_2021
from ptdp.perf.plan.planner import plan
from ptdp.perf.simulate.simulator import simulate
from ptdp.perf.validate.paper import preset_config

ROOT = Path(__file__).resolve().parents[2]
A100 = load_system("a100-80gb")
MODEL = """
[model]
num_layers = 4
hidden_size = 64
num_heads = 4
seq_length = 64
vocab_size = 128
"""


def tiny(**train) -> RunConfig:
    model = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "seq_length": 64}
    sections = {"model": {**model, "vocab_size": 128}, "train": {"precision": "bf16", **train}}
    return apply_updates(RunConfig(), sections, "test")


def test_planner_predictions_equal_full_simulations() -> None:
    # m = 32 microbatches on p = 2: the planner replays the steady state in short.
    result = plan(tiny(global_batch_size=64), gpus=4, system=A100, pp=2, tp=1, micro_batch=1)
    assert len(result.options) >= 3
    for o in result.options:
        full = simulate(o.config, A100, 4)
        assert o.prediction.layout.num_microbatches == 32
        assert o.prediction.iteration_seconds == pytest.approx(full.iteration_seconds, rel=1e-9)
        assert o.prediction.bubble_fraction == pytest.approx(full.bubble_fraction, rel=1e-6)
        assert o.prediction.dp_seconds == pytest.approx(full.dp_seconds, rel=1e-9)
    # Few microbatches: replayed in full, without the timeline's events; the same numbers.
    for o in plan(tiny(global_batch_size=32), gpus=8, system=A100).options:
        full = simulate(o.config, A100, 8)
        assert o.prediction.iteration_seconds == pytest.approx(full.iteration_seconds, rel=1e-12)
        assert len(o.prediction.events) < len(full.events)


def test_model_tflops_is_the_headline(tmp_path: Path, capsys) -> None:
    # Full recomputation executes more FLOPs: its executed TFLOP/s is higher than its model
    # TFLOP/s, and the ranking by step time is the ranking by model TFLOP/s.
    result = plan(tiny(global_batch_size=32), gpus=8, system=A100, recompute=Recompute.FULL)
    model = [o.prediction.model_tflops_per_device for o in result.options]
    assert model == sorted(model, reverse=True)
    assert all(o.prediction.tflops_per_device > o.prediction.model_tflops_per_device for o in
               result.options)  # fmt: skip
    (tmp_path / "m.toml").write_text(MODEL)
    args = ["plan", "--model", str(tmp_path / "m.toml"), "--gpus", "8", "--global-batch", "32"]
    assert main([*args, "--parallel.recompute", "full"]) == 0
    out = capsys.readouterr().out
    assert "| s/step | model TFLOP/s/GPU | MFU | executed TFLOP/s/GPU |" in out
    row = next(line for line in out.splitlines() if line.startswith(" *"))
    cells = [c.strip() for c in row.split("|")]
    best = result.best.prediction
    assert cells[3] == f"{best.model_tflops_per_device:.1f}"
    assert cells[4] == f"{100 * best.mfu:.1f}%" and cells[5] == f"{best.tflops_per_device:.1f}"
    sim = ["simulate", "--model", str(tmp_path / "m.toml"), "--out", str(tmp_path / "s")]
    assert main([*sim, "--parallel.recompute", "full"]) == 0
    text = capsys.readouterr().out
    headline = next(line for line in text.splitlines() if line.startswith("predicted iteration"))
    assert "model TFLOP/s per GPU | MFU" in headline and "executed" not in headline
    assert "executed with recomputation" in text


def test_one_precision_default(tmp_path: Path, capsys) -> None:
    # gpt-1.7b as a preset and as a TOML file without train.precision: both bf16, the same
    # prediction, in simulate and in plan.
    dims = "num_layers = 24\nhidden_size = 2304\nnum_heads = 24\nseq_length = 2048\n"
    (tmp_path / "g.toml").write_text(f"[model]\n{dims}vocab_size = 51200\ndropout = 0.1\n")
    common = ["--gpus", "8", "--parallel.tp", "8", "--train.global_batch_size", "64", "--json"]
    runs = {}
    for model in ("gpt-1.7b", str(tmp_path / "g.toml")):
        args = ["simulate", "--model", model, "--out", str(tmp_path / "s"), *common]
        assert main(args) == 0
        runs[model] = json.loads(capsys.readouterr().out)
        assert main(["plan", "--model", model, *common]) == 0
        best = json.loads(capsys.readouterr().out)["best"]
        assert best["config"]["train"]["precision"] == "bf16"
    preset, toml = runs.values()
    assert preset["precision"] == toml["precision"] == "bf16"
    assert toml["iteration_seconds"] == pytest.approx(preset["iteration_seconds"], rel=1e-12)
    args = ["simulate", "--model", str(tmp_path / "g.toml"), "--out", str(tmp_path / "s")]
    assert main([*args, *common, "--train.precision", "fp32"]) == 0  # given: kept
    fp32 = json.loads(capsys.readouterr().out)
    assert fp32["precision"] == "fp32" and fp32["iteration_seconds"] > toml["iteration_seconds"]


def test_megatron_2021_in_plan_and_simulate() -> None:
    base = tiny(global_batch_size=64)
    old = plan(base, gpus=8, system=A100, software=MEGATRON_2021)
    assert old.options
    for o in (*old.options, *old.unranked):  # every layout that fits, ranked or not
        p = o.config.parallel
        assert not p.sequence_parallel and p.recompute is not Recompute.SELECTIVE
        assert p.schedule.value in ("1f1b", "interleaved")
    new = plan(base, gpus=8, system=A100)
    assert any(o.config.parallel.sequence_parallel for o in (*new.options, *new.unranked))
    with pytest.raises(ConfigError, match="no sequence parallelism .*sequence_parallel false"):
        plan(base, gpus=8, system=A100, software=MEGATRON_2021, sequence_parallel=True)
    with pytest.raises(ConfigError, match="no selective recomputation"):
        plan(base, gpus=8, system=A100, software=MEGATRON_2021, recompute=Recompute.SELECTIVE)
    # The 2021 code reduced gradients after the backward pass whatever the config says.
    layout = {"parallel": {"pp": 2}, "train": {"micro_batch_size": 1, "global_batch_size": 64}}
    cfg = apply_updates(preset_config("gpt-1.7b"), layout, "t")
    on = apply_updates(cfg, {"parallel": {"overlap_grad_reduce": True}}, "t")
    off = apply_updates(cfg, {"parallel": {"overlap_grad_reduce": False}}, "t")
    t_on, t_off = (simulate(c, A100, 8, software=MEGATRON_2021) for c in (on, off))
    assert t_on.iteration_seconds == t_off.iteration_seconds
    assert simulate(on, A100, 8).iteration_seconds < simulate(off, A100, 8).iteration_seconds


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallel.tp", "2", "--gpus", "3"],
        ["--parallel.tp", "2", "--parallel.dp", "2", "--gpus", "8"],
        ["--parallel.pp", "2", "--gpus", "1"],
    ],
)
def test_simulate_names_gpus_never_torchrun(layout: list[str], tmp_path: Path, capsys) -> None:
    (tmp_path / "m.toml").write_text(MODEL)
    args = ["simulate", "--model", str(tmp_path / "m.toml"), "--out", str(tmp_path), *layout]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "torchrun" not in err and "srun" not in err and "launch" not in err
    assert re.search(r"--gpus \d+", err), err


def test_plan_compare(tmp_path: Path, capsys) -> None:
    (tmp_path / "m.toml").write_text(MODEL)
    mine = tmp_path / "mine.toml"
    mine.write_text(
        '[parallel]\ntp = 2\npp = 2\nschedule = "1f1b"\n[train]\nmicro_batch_size = 2\n'
    )
    args = ["plan", "--model", str(tmp_path / "m.toml"), "--gpus", "8", "--global-batch", "32"]
    assert main([*args, "--compare", str(mine), "--json", "--top", "30"]) == 0
    out = json.loads(capsys.readouterr().out)
    got = out["compare"]
    assert got["problem"] == "" and got["option"]["layout"]["tp"] == 2
    theirs = got["option"]["iteration_seconds"]
    times = [o["iteration_seconds"] for o in out["options"]]
    assert got["rank"] == 1 + sum(t < theirs for t in times) and got["of"] == len(times) + 1
    best = out["best"]["iteration_seconds"]
    assert got["gain"] == pytest.approx(theirs / best - 1) and got["gain"] > 0
    assert main([*args, "--compare", str(mine), "--top", "30"]) == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith(f"your layout ({mine})"))
    assert f"rank {got['rank']} of {got['of']}" in line
    assert f"is predicted {100 * got['gain']:.1f}% faster" in line
    assert any(x.startswith(f" >{got['rank']:2d} | t=2 p=2") for x in text.splitlines())
    # `--compare` alone: the command line's own layout, which the plan also holds.
    pins = ["--parallel.tp", "1", "--parallel.pp", "1", "--train.micro_batch_size", "4"]
    assert main([*args, *pins, "--compare", "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["compare"]["gain"] == pytest.approx(0, abs=1e-12)
    assert same["compare"]["rank"] == 1 and same["compare"]["of"] == len(same["options"])
    # Invalid, and not fitting: said why.
    mine.write_text("[parallel]\ntp = 3\n")
    assert main([*args, "--compare", str(mine)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("your layout"))
    assert "cannot run on 8 GPUs" in line and "--gpus" in line and "torchrun" not in line
    big = ["--model.hidden_size", "12288", "--model.num_heads", "96"]
    mine.write_text("[parallel]\ntp = 1\n[train]\nmicro_batch_size = 4\n")
    assert main([*args, *big, "--compare", str(mine)]) in (0, 1)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("your layout"))
    assert "does not fit: needs" in line and "GiB usable" in line
    mine.write_text("[model]\nnum_layers = 8\n")
    assert main([*args, "--compare", str(mine)]) == 2
    assert "model or global batch differs" in capsys.readouterr().err


def test_no_benchmark_defaults_to_a_tracked_file() -> None:
    # Outputs a benchmark writes by default go under runs/ (ignored); tracked records only
    # when named on the command line.
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        for line in path.read_text().splitlines():
            writes = "default=" in line or re.match(r"^[A-Z_]+ = ROOT", line)
            if writes and "runs" not in line:
                assert not re.search(r"BENCHMARKS\.md|results/|\.png\"|docs/", line), (
                    f"{path.name}: {line.strip()}"
                )


def test_zb_v_at_many_microbatches_is_named_not_simulated() -> None:
    # m = 128 > 16 p on p = 2: zb-v has no short replay; it is listed as not simulated.
    result = plan(tiny(global_batch_size=128), gpus=2, system=A100, tp=1, pp=2, micro_batch=1)
    names = {o.config.parallel.schedule.value for o in result.options}
    assert "zb-v" not in names and {"1f1b", "zb-h1"} <= names
    skipped = [r for r in result.rejected if r.layout.endswith("zb-v")]
    assert skipped and "not simulated: m = 128 > 16 p" in skipped[0].reason
