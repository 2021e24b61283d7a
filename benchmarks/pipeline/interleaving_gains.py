"""Interleaving's and scatter/gather's gains on the paper's Figure 12 / 18 setting.

GPT-3 175B on 96 A100s (a100-80gb), t = 8, p = 12, b = 1, full recomputation, Megatron-LM
2021's software (`--software megatron-2021`), global batch 12 to 60: TFLOP/s per GPU
(equation (3)'s FLOPs) of 1F1B and of the interleaved schedule with and without
scatter/gather, for each v given (the paper does not state its v). Prints a markdown table.

With --measure, the same question on this machine instead: ptdp's own pp = 2 steps under
1F1B and interleaved (v = 2) at m = 2 (= p), 4 and 8 microbatches
(benchmarks/perf_model/prediction.py's model and measurement: each configuration a step in
turn, median of the timed steps), and the gain the calibrated model predicts for each m
beside the measured one.

    python benchmarks/pipeline/interleaving_gains.py            # v = 2 and 4, about 10 s
    python benchmarks/pipeline/interleaving_gains.py --vpp 2 4 8
    python benchmarks/pipeline/interleaving_gains.py --measure \\
        --calibration runs/benchmarks/calibration.toml
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.software import MEGATRON_2021
from ptdp.perf.simulate.simulator import simulate
from ptdp.perf.validate.paper import preset


def _measuring():  # noqa: ANN202 - three modules
    """The measuring half (torch, the prediction benchmark's runs), imported with --measure
    only: the figures' table needs neither."""
    from benchmarks.common import corpus, spawn
    from benchmarks.perf_model import prediction

    return spawn, prediction, corpus


SYSTEM = load_system("a100-80gb")


def tflops(batch: int, vpp: int, scatter_gather: bool) -> float:
    """Predicted TFLOP/s per GPU of one setting of the figures."""
    parallel = {
        "tp": 8,
        "pp": 12,
        "vpp": vpp,
        "schedule": "interleaved" if vpp > 1 else "1f1b",
        "recompute": "full",
        "sequence_parallel": False,
        "scatter_gather": scatter_gather,
        "overlap_grad_reduce": False,
    }
    train = {"precision": "bf16", "micro_batch_size": 1, "global_batch_size": batch}
    cfg = replace(RunConfig(), model=preset("gpt3-175b"))
    cfg = apply_updates(cfg, {"parallel": parallel, "train": train}, "Figure 12 / 18")
    return simulate(cfg, SYSTEM, 96, software=MEGATRON_2021, timeline=False).tflops_per_device


def _pp2(schedule: str, m: int):  # noqa: ANN202 - a prediction.Case
    vpp = {"vpp": 2} if schedule == "interleaved" else {}
    train = {"micro_batch_size": 2, "global_batch_size": 2 * m}
    return _measuring()[1].Case(
        f"pp2-{schedule}-m{m}",
        2,
        f"{schedule}, m = {m}",
        {"pp": 2, "schedule": schedule, **vpp},
        train=train,
    )


def measure(microbatches: list[int], calibration: str, steps: int, tiny: bool) -> list[dict]:
    """Measured and predicted step of pp = 2 under 1F1B and interleaved for each m; one row
    per m with both schedules' milliseconds and the gains (1F1B / interleaved - 1)."""
    spawning, prediction, corpus = _measuring()
    system = load_system(calibration)
    cases = [_pp2(s, m) for m in microbatches for s in ("1f1b", "interleaved")]
    with tempfile.TemporaryDirectory() as tmp:
        data = corpus.repo_corpus(Path(tmp) / "data")
        configs = [(c.name, prediction.case_config(c, data, f"{tmp}/runs", tiny)) for c in cases]
        measured = spawning.spawn(prediction.worker, 2, configs, 2, steps, timeout_s=600.0)
        ms = {}
        for name, cfg in configs:
            times = measured[name]["times"]
            cpu = measured[name]["cpu"]
            predicted = prediction.predict(cfg, 2, system).iteration_seconds
            ms[name] = (
                1e3 * statistics.median(times),
                1e3 * predicted,
                1e3 * statistics.median(cpu),
            )
    rows = []
    for m in microbatches:
        one, two = ms[f"pp2-1f1b-m{m}"], ms[f"pp2-interleaved-m{m}"]
        rows.append({
            "m": m,
            "1f1b_ms": one[0], "interleaved_ms": two[0],
            "1f1b_predicted_ms": one[1], "interleaved_predicted_ms": two[1],
            "1f1b_cpu_ms": one[2], "interleaved_cpu_ms": two[2],
            "measured_gain": one[0] / two[0] - 1, "predicted_gain": one[1] / two[1] - 1,
        })  # fmt: skip
    return rows


def measured_table(rows: list[dict]) -> list[str]:
    lines = [
        "| m | 1F1B ms (predicted) | interleaved ms (predicted) | gain measured | gain predicted "
        "| busiest rank's CPU ms, 1F1B / interleaved |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['m']} | {r['1f1b_ms']:.1f} ({r['1f1b_predicted_ms']:.1f}) | "
            f"{r['interleaved_ms']:.1f} ({r['interleaved_predicted_ms']:.1f}) | "
            f"{100 * r['measured_gain']:+.1f}% | {100 * r['predicted_gain']:+.1f}% | "
            f"{r['1f1b_cpu_ms']:.1f} / {r['interleaved_cpu_ms']:.1f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> list[dict] | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vpp", type=int, nargs="+", default=[2, 4], help="chunks per rank")
    parser.add_argument(
        "--measure", action="store_true", help="ptdp's pp = 2 runs here instead of the figures"
    )
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8], metavar="M")
    parser.add_argument(
        "--calibration", default="", metavar="FILE", help="with --measure: `ptdp calibrate`'s file"
    )
    parser.add_argument("--steps", type=int, default=9, help="with --measure: timed steps")
    parser.add_argument(
        "--tiny", action="store_true", help="with --measure: a tiny model (the test)"
    )
    args = parser.parse_args(argv)
    if args.measure:
        if any(m % 2 for m in args.microbatches):
            parser.error("--microbatches: interleaving at p = 2 needs an even m")
        prediction = _measuring()[1]
        calibration = args.calibration or str(prediction.calibrate_now(prediction.OUT))
        rows = measure(args.microbatches, calibration, args.steps, args.tiny)
        print("\n".join(measured_table(rows)))
        return rows
    print("| B | v | 1F1B | interleaved, s/g | without s/g | interleaving gain | s/g gain |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch in (12, 24, 36, 48, 60):
        base = tflops(batch, 1, True)
        for v in args.vpp:
            on, off = tflops(batch, v, True), tflops(batch, v, False)
            print(
                f"| {batch} | {v} | {base:.1f} | {on:.1f} | {off:.1f} | "
                f"{100 * (on / base - 1):+.1f}% | {100 * (on / off - 1):+.1f}% |",
                flush=True,
            )
    return None


if __name__ == "__main__":
    main()
