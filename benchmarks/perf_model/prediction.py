"""The performance model against ptdp's own measured step times on this machine.

Issue 22, item 2. With a cluster file calibrated here (`--calibration FILE`; default: run
`torchrun --nproc-per-node 2 -m ptdp calibrate` now, into runs/benchmarks/), each
configuration of `CASES` trains for a few steps on CPU (gloo, one thread per rank), its
median step time after the warm-up steps is measured (ptdp's `Trainer.train_step`: the
forward-backward of the global batch, the gradient reduction and the optimizer step,
between barriers; the configurations of one world size take turns, so a busy spell of
the shared machine lands on every one of them, each turn an untimed step and then a timed
one, since a run repeats one configuration's step), and
`ptdp.perf.simulate.simulator.simulate` predicts it from the file. The cases differ in what the
model must get right: one process at several widths, sequence lengths, micro-batch sizes
and recomputation; two ranks at tp = 2 with and without sequence parallelism, pp = 2
under every schedule, dp = 2 at ZeRO 0, 1, 2 and 3; cp = 2 where `validate` accepts it
(listed as skipped otherwise). Targets: median |error| <= 10%, max |error| <= 20%. One
pipelined run's last step is drawn above its simulated timeline. Between the two-rank step
rounds the calibration's wait cost (`waits.sync_rounds`) is sampled again, and the table
shows the predictions with it too: whether an error is the figure having moved since the
calibration.

Writes runs/benchmarks/prediction.json, prediction.md and prediction_timeline.png (plus
its Chrome trace); never a tracked file.

    python benchmarks/perf_model/prediction.py          # a few minutes on 2 quiet cores
    python benchmarks/perf_model/prediction.py --calibration runs/calibration/cpu.toml \\
        --only pp2-1f1b
    python benchmarks/perf_model/prediction.py --tiny   # every case at a tiny size (seconds)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.corpus import repo_corpus
from benchmarks.common.spawn import spawn
from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.parallel.env import LaunchEnv
from ptdp.perf.calibrate.fit import collective_bytes
from ptdp.perf.calibrate.microbench import build_groups
from ptdp.perf.calibrate.timing import Timing
from ptdp.perf.calibrate.waits import collective_sync, sync_rounds
from ptdp.perf.cost.hardware import System
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.simulate.plot import plot_timelines, write_chrome_trace
from ptdp.perf.simulate.simulator import Prediction, simulate
from ptdp.pipeline.timeline import Event, from_dicts, to_dicts
from ptdp.rules.layout import ORDER, validate
from ptdp.train.run import prepare
from ptdp.train.step.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "runs" / "benchmarks"  # ignored runs/: no tracked file
TARGETS = (0.10, 0.20)  # median and max |error|
BASE = {
    "model": {
        "num_layers": 4, "hidden_size": 128, "num_heads": 4, "seq_length": 128, "dropout": 0.0,
    },
    "train": {"micro_batch_size": 4, "global_batch_size": 8},
}  # fmt: skip
TINY = {"num_layers": 4, "hidden_size": 32, "num_heads": 4, "seq_length": 16}
"""--tiny: every case's model at this size (4 layers: pp = 2 with two chunks per rank)."""


@dataclass(frozen=True)
class Case:
    """One configuration: its world size, what it changes from `BASE` and what it tests."""

    name: str
    world: int
    tests: str
    parallel: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)


def _pp(schedule: str, **parallel: object) -> Case:
    return Case(
        f"pp2-{schedule}",
        2,
        f"schedule {schedule}: bubble, p2p latency, per-microbatch cost",
        {"pp": 2, "schedule": schedule, **parallel},
        train={"micro_batch_size": 2, "global_batch_size": 8},
    )


CASES: tuple[Case, ...] = (
    Case("1p-base", 1, "h 128, s 128, b 4, m 2: the reference point"),
    Case("1p-h64", 1, "narrow GEMMs: small-GEMM efficiency", model={"hidden_size": 64}),
    Case("1p-h256", 1, "wide GEMMs: the curve's top", model={"hidden_size": 256}),
    Case("1p-s32", 1, "short sequence: attention small", model={"seq_length": 32}),
    Case("1p-s512", 1, "long sequence: attention's share", model={"seq_length": 512}),
    Case(
        "1p-b1", 1, "micro-batch 1, m 8: per-microbatch fixed costs",
        train={"micro_batch_size": 1},
    ),
    Case(
        "1p-b8", 1, "micro-batch 8, m 1: one large pass",
        train={"micro_batch_size": 8},
    ),
    Case("1p-full", 1, "full recomputation: a forward again in B", {"recompute": "full"}),
    Case("1p-selective", 1, "selective recomputation: attention again", {"recompute": "selective"}),
    Case("tp2", 2, "tensor parallel: 4 all-reduces per layer per microbatch", {"tp": 2}),
    Case(
        "tp2-sp", 2, "sequence parallel: reduce-scatter + all-gather pairs",
        {"tp": 2, "sequence_parallel": True},
    ),
    _pp("gpipe"),
    _pp("1f1b"),
    _pp("interleaved", vpp=2),
    _pp("zb-h1"),
    _pp("zb-h2"),
    _pp("zb-v", vpp=2),
    Case("dp2-zero0", 2, "gradient all-reduce, overlapped", {"zero": 0}),
    Case("dp2-zero1", 2, "reduce-scatter + sharded step + all-gather", {"zero": 1}),
    Case("dp2-zero2", 2, "ZeRO-2: gradients sharded as well", {"zero": 2}),
    Case("dp2-zero3", 2, "ZeRO-3: parameters gathered per layer", {"zero": 3}),
    Case("cp2", 2, "context parallel: key/value ring", {"cp": 2}),
)  # fmt: skip
REWARM = 1
"""Untimed steps of a config right before each of its timed ones. A training run repeats
one config's step, and the first step after the other configs' is slower: 1p-s32 29.1
against 26.1-26.7 ms for the next four, 1p-h64 38.9 against 36.8-37.6, 1p-b1 101.6
against 95.6-98.1 (medians over 4 rounds; the two-rank configs showed no such step)."""
TIMELINE_CASE = "pp2-1f1b"
SPELL_KEY = "collective sync in the steps' spell"
SPELL_ROUNDS = 5
SPELL_TIMING = Timing(0.03, SPELL_ROUNDS)
"""The wait cost sampled between the two-rank step rounds: 5 of `ptdp calibrate`'s rounds
after each, 45 over the 9 timed rounds, as many as the calibration takes."""


def case_config(case: Case, data: str, run_dir: str, tiny: bool) -> RunConfig:
    model = {**BASE["model"], **case.model, **(TINY if tiny else {})}
    if tiny and case.model.get("seq_length", 0) > TINY["seq_length"]:
        model["seq_length"] = 2 * TINY["seq_length"]
    train = {
        **BASE["train"],
        **case.train,
        "device": "cpu", "progress": False, "steps": 1000, "log_interval": 1000,
        "eval_interval": 0, "save_interval": 0, "run_dir": f"{run_dir}/{case.name}",
        "profile_timeline": case.name == TIMELINE_CASE,
    }  # fmt: skip
    updates = {
        "model": model,
        "parallel": case.parallel,
        "data": {"path": data, "valid_fraction": 0.05},
        "optim": {"warmup_steps": 2},
        "train": train,
    }
    return apply_updates(RunConfig(), updates, f"benchmark case {case.name}")


def accepted(case: Case, cfg: RunConfig) -> str:
    """'' if `validate` takes the case, else why not (a dimension still being built)."""
    try:
        layout = validate(cfg, case.world)
    except ConfigError as exc:
        return str(exc)
    # Validation and the performance model may take a dimension before the runtime does
    # (built by others, in parts): a run that would silently train something else is skipped.
    missing = [axis for axis in ("cp",) if getattr(layout, axis, 1) > 1 and axis not in ORDER]
    if missing:
        return f"not built: the mesh has no {', '.join(missing)} axis yet (ptdp/parallel/mesh.py)"
    if layout.zero >= 3 and not hasattr(layout, "shards_params"):
        return (
            "not built: validate takes zero = 3, but the runtime shards no parameters yet "
            "(no Layout.shards_params)"
        )
    return ""


# ----------------------------------------------------------------------------- measure


def _timed_step(trainer: Trainer) -> tuple[float, float]:
    """(wall, process CPU) seconds of one `train_step`, between barriers."""
    dist.barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    trainer.train_step()
    took_cpu = time.process_time() - start_cpu
    dist.barrier()
    return time.perf_counter() - start, took_cpu


def worker(
    rank: int,
    world: int,
    configs: list[tuple[str, RunConfig]],
    warmup: int,
    steps: int,
    rewarm: int = 0,
):
    """Every config of this world size, in rounds of one timed step each (after `warmup`
    rounds), each after `rewarm` untimed ones: a busy spell of the shared machine then slows
    one step of every config, not every step of one. Each config's step times on this rank,
    the busiest rank's CPU time per step, and the timeline's events (every pipeline rank's
    last step) if the config records them.
    With two ranks, each timed round also takes `SPELL_ROUNDS` samples of the calibration's
    wait cost (`waits.sync_rounds`), under SPELL_KEY: the figure in the steps' own spell."""
    env = LaunchEnv(rank, world, rank)
    pair = build_groups(world, 2, 1) if world == 2 else None
    spell: list[float] = []
    trainers = {}
    for name, cfg in configs:
        cfg, layout, data = prepare(cfg, env)
        trainers[name] = Trainer(cfg, layout, env, data)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    cpu: dict[str, list[float]] = {name: [] for name in trainers}
    for i in range(warmup + steps):
        for name, trainer in trainers.items():
            for _ in range(rewarm if i >= warmup else 0):
                trainer.train_step()
            took, took_cpu = _timed_step(trainer)
            if i >= warmup:
                times[name].append(took)
                cpu[name].append(took_cpu)
        if pair is not None and i >= warmup:
            spell += sync_rounds(
                torch.float32, torch.device("cpu"), SPELL_TIMING, pair, SPELL_ROUNDS
            )
    out = {}
    for name, trainer in trainers.items():
        events: list = [None] * world
        mine = to_dicts(trainer.recorder.events) if trainer.recorder else []
        dist.all_gather_object(events, (mine, cpu[name]))
        busiest = [max(step) for step in zip(*(c for _, c in events))]
        rows = [row for rows, _ in events for row in rows]
        out[name] = {"times": times[name], "cpu": busiest, "events": rows, "steps": trainer.step}
        if trainer.watchdog:
            trainer.watchdog.close()
        if rank == 0:
            print(f"  {name}: {1e3 * statistics.median(times[name]):.1f} ms", flush=True)
    trainers.clear()
    gc.collect()
    if spell:
        out[SPELL_KEY] = spell
    return out


# ----------------------------------------------------------------------------- predict


def predict(cfg: RunConfig, world: int, system: System) -> Prediction:
    """`ptdp simulate --device FILE` for `cfg` (vocabulary resolved from its data)."""
    resolved, layout, _ = prepare(cfg, LaunchEnv(0, world, 0))
    return simulate(resolved, system, world, layout=layout)


def calibrate_now(out: Path) -> Path:
    """A two-rank calibration at `ptdp calibrate`'s defaults, made now (the ranks' collectives
    measured too): about 30 s here, where --quick's coarser pass left every one-process
    configuration 12-26% under its measured step."""
    path = out / "calibration.toml"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["-m", "ptdp", "calibrate", "--out", str(path)]
    print("calibrating:", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True, env=env, cwd=ROOT)
    return path


def spell_sync(system: System, samples: list[float]) -> float:
    """`collective_sync_us` (seconds) from the samples taken between the step rounds, as
    `ptdp calibrate` makes it from its own: the median round's per-call figure less what
    the file's all-reduce fit charges that call (wait_after_compute_us stays the file's)."""
    per_call, _, nbytes = collective_sync(samples, torch.float32)  # fp32, as measured
    latency, bandwidth = system.intra.collective("all_reduce")
    charged = latency + collective_bytes("all_reduce", nbytes, 2) / bandwidth
    return max(0.0, per_call - charged)


def file_date(source: str) -> str:
    """The calibration's own date line ('Measured by `ptdp calibrate` on DATE'), else mtime."""
    path = Path(source)
    if not path.is_file():
        return "built-in file"
    for line in path.read_text().splitlines()[:3]:
        if "ptdp calibrate` on " in line:
            return line.split("` on ", 1)[1].split(":", 1)[0]
    return datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).date().isoformat()


# ----------------------------------------------------------------------------- report


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| config | world | tests | predicted ms | measured ms | error | best ms | CPU ms "
        "| predicted without framework term | without collective sync "
        "| predicted with the steps' wait cost | its error |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.get("skipped"):
            why = r["skipped"].splitlines()[-1].strip()[:120]
            cells = f"| {r['name']} | {r['world']} | {r['tests']} | skipped: {why} |"
            lines.append(cells + " |" * 8)
            continue
        lines.append(
            f"| {r['name']} | {r['world']} | {r['tests']} | {r['predicted_ms']:.1f} | "
            f"{r['measured_ms']:.1f} | {100 * r['error']:+.1f}% | {r['best_ms']:.1f} | "
            f"{r['cpu_ms']:.1f} | {r['predicted_without_framework_ms']:.1f} | "
            f"{r['predicted_without_sync_ms']:.1f} | "
            + (
                f"{r['predicted_in_spell_ms']:.1f} | {100 * r['error_in_spell']:+.1f}% |"
                if "error_in_spell" in r
                else "- | - |"
            )
        )
    return lines


def summarise(rows: list[dict]) -> dict:
    """Median and max |error| against the median step (the targets), and against the best
    step (the calibration times the fastest of several batches, so this is its like)."""
    ran = [r for r in rows if not r.get("skipped")]
    if not ran:
        return {"median_abs_error": None, "max_abs_error": None, "met": False}
    errors = [abs(r["error"]) for r in ran]
    best = [abs(r["predicted_ms"] / r["best_ms"] - 1) for r in ran]
    median, worst = statistics.median(errors), max(errors)
    # One process, one thread, no waits: its CPU time is about the step a quiet machine takes.
    cpu = [abs(r["predicted_ms"] / r["cpu_ms"] - 1) for r in ran if r["world"] == 1] or [0.0]
    return {
        "median_abs_error": median,
        "max_abs_error": worst,
        "met": median <= TARGETS[0] and worst <= TARGETS[1],
        "best_step_median_abs_error": statistics.median(best),
        "best_step_max_abs_error": max(best),
        "one_process_cpu_median_abs_error": statistics.median(cpu),
        "one_process_cpu_max_abs_error": max(cpu),
    }


def in_spell(rows: list[dict], system: System, spell: System | None) -> dict:
    """The errors with `collective_sync_us` measured between the step rounds instead of the
    file's: how much of the error is the wait cost having moved since the calibration."""
    ran = [r for r in rows if "error_in_spell" in r]
    if spell is None or not ran:
        return {}
    errors = [abs(r["error_in_spell"]) for r in ran]
    median, worst = statistics.median(errors), max(errors)
    return {
        "spell": {
            "collective_sync_us": 1e6 * spell.device.collective_sync,
            "file_collective_sync_us": 1e6 * system.device.collective_sync,
            "median_abs_error": median,
            "max_abs_error": worst,
            "met": median <= TARGETS[0] and worst <= TARGETS[1],
        }
    }


def draw_timeline(row: dict, prediction: Prediction, out: Path) -> tuple[Path | None, Path]:
    measured = from_dicts(row["events"])
    simulated = [e for e in prediction.events if e.lane != "dp" or e.kind == "DP"]
    sources: dict[str, list[Event]] = {
        f"measured (last step; each action's bar includes its wait for input): "
        f"{row['measured_ms']:.0f} ms median step": measured,
        f"simulated from the calibration: {row['predicted_ms']:.0f} ms step": simulated,
    }
    trace = write_chrome_trace(out / "prediction_timeline.json", sources)
    try:
        png = plot_timelines(
            out / "prediction_timeline.png", sources, title=f"{row['name']} ({row['tests']})"
        )
    except ImportError:  # matplotlib is optional
        png = None
    return png, trace


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = args.calibration or str(calibrate_now(out))
    system = load_system(source)
    zero = (0.0, 0.0)  # the same file without its framework term, to show what that adds
    bare = replace(system, device=replace(system.device, layer_overhead=zero, head_overhead=zero))
    unsynced = replace(  # no wait costs beyond the bytes
        system,
        device=replace(system.device, collective_sync=0.0, wait_after_compute=0.0, ring_sync=0.0),
    )
    cases = [c for c in CASES if not args.only or c.name in args.only]
    cases = [c for c in cases if c.name not in args.skip]
    rows, by_world = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        data = repo_corpus(Path(tmp) / "data")
        configs = {}
        for case in cases:
            cfg = case_config(case, data, f"{tmp}/runs", args.tiny)
            why = accepted(case, cfg)
            row = {"name": case.name, "world": case.world, "tests": case.tests}
            if why:
                rows.append(row | {"skipped": why})
                continue
            configs[case.name] = cfg
            by_world.setdefault(case.world, []).append((case.name, cfg))
            rows.append(row)
        measured = {}
        for world, todo in sorted(by_world.items()):
            print(f"measuring {len(todo)} config(s) on {world} rank(s)", flush=True)
            measured |= spawn(
                worker, world, todo, args.warmup, args.steps, args.rewarm, timeout_s=args.timeout
            )
        predictions, spell = {}, None
        if SPELL_KEY in measured:
            sync = spell_sync(system, measured.pop(SPELL_KEY))
            spell = replace(system, device=replace(system.device, collective_sync=sync))
        for row in rows:
            if row.get("skipped"):
                continue
            p = predictions[row["name"]] = predict(configs[row["name"]], row["world"], system)
            m = measured[row["name"]]
            row["measured_ms"] = 1e3 * statistics.median(m["times"])
            row["times_ms"] = [1e3 * t for t in m["times"]]
            row["steps_taken"] = m["steps"]  # warm-up, untimed and timed
            row["best_ms"] = min(row["times_ms"])
            row["cpu_ms"] = 1e3 * statistics.median(m["cpu"])
            row["predicted_ms"] = 1e3 * p.iteration_seconds
            row["error"] = (row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"]
            without = predict(configs[row["name"]], row["world"], bare).iteration_seconds
            row["predicted_without_framework_ms"] = 1e3 * without
            without = predict(configs[row["name"]], row["world"], unsynced).iteration_seconds
            row["predicted_without_sync_ms"] = 1e3 * without
            if spell is not None:
                p = predict(configs[row["name"]], row["world"], spell)
                row["predicted_in_spell_ms"] = 1e3 * p.iteration_seconds
                row["error_in_spell"] = row["predicted_in_spell_ms"] / row["measured_ms"] - 1
            row["events"] = m["events"]
    result = {
        "command": " ".join(["python", "benchmarks/perf_model/prediction.py", *args.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
        "machine": f"{platform.node()}: {_cpu()}, torch {torch.__version__}, gloo, 1 thread/rank",
        "calibration": source,
        "calibration_date": file_date(source),
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "rewarm_steps": args.rewarm,
        "targets": {"median_abs_error": TARGETS[0], "max_abs_error": TARGETS[1]},
        **summarise(rows),
        **in_spell(rows, system, spell),
        "rows": [{k: v for k, v in r.items() if k != "events"} for r in rows],
    }
    timeline = next((r for r in rows if r["name"] == TIMELINE_CASE and "events" in r), None)
    if timeline is not None:
        png, trace = draw_timeline(timeline, predictions[TIMELINE_CASE], out)
        result["timeline"] = {"png": png and str(png), "trace": str(trace)}
    (out / "prediction.json").write_text(json.dumps(result, indent=1))
    (out / "prediction.md").write_text(markdown(result))
    return result


def _cpu() -> str:
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else []:
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"{platform.machine()}, {os.cpu_count()} cores"


def markdown(result: dict) -> str:
    med, worst = result["median_abs_error"], result["max_abs_error"]
    verdict = (
        "no case measured"
        if med is None
        else f"median |error| {100 * med:.1f}% (target <= {100 * TARGETS[0]:.0f}%), "
        f"max |error| {100 * worst:.1f}% (target <= {100 * TARGETS[1]:.0f}%): "
        + ("met" if result["met"] else "not met")
        + f"; against each config's best step: median |error| "
        f"{100 * result['best_step_median_abs_error']:.1f}%, max "
        f"{100 * result['best_step_max_abs_error']:.1f}%; one process against its CPU time "
        f"per step: median |error| {100 * result['one_process_cpu_median_abs_error']:.1f}%, "
        f"max {100 * result['one_process_cpu_max_abs_error']:.1f}%"
    )
    lines = [
        f"command: `{result['command']}` ({result['date']})",
        f"machine: {result['machine']}",
        f"calibration: {result['calibration']} (measured {result['calibration_date']}); "
        f"median of {result['timed_steps']} steps after {result['warmup_steps']} warm-up, "
        f"each after {result['rewarm_steps']} untimed",
        "",
        *table(result["rows"]),
        "",
        verdict,
        "",
        "error = predicted / measured - 1 (measured: median step); best: the fastest timed "
        "step; CPU: process CPU time of the busiest rank per step (median), which a loaded "
        "machine does not stretch as it stretches wall time (for one process, about the step "
        "a quiet machine would take; with two ranks it leaves out the waits); without "
        "framework term: the same file with layer_overhead_us and head_overhead_us at 0; without "
        "collective sync: the same file with collective_sync_us, wait_after_compute_us and "
        "ring_sync_us at 0; with the steps' wait "
        "cost: the same file with collective_sync_us measured between the two-rank step "
        "rounds (`waits.sync_rounds`, as `ptdp calibrate` measures it).",
    ]
    if "spell" in result:
        sp = result["spell"]
        lines += [
            "",
            f"with the steps' wait cost (collective_sync_us {sp['collective_sync_us']:.0f} "
            f"measured during the steps, the file's {sp['file_collective_sync_us']:.0f}): "
            f"median |error| {100 * sp['median_abs_error']:.1f}%, max "
            f"{100 * sp['max_abs_error']:.1f}%: " + ("met" if sp["met"] else "not met"),
        ]
    if "timeline" in result:
        lines.append(f"timeline ({TIMELINE_CASE}): {result['timeline']['png']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default="", metavar="FILE",
                        help="`ptdp calibrate` output (default: calibrate now)")  # fmt: skip
    parser.add_argument("--only", nargs="+", default=[], metavar="NAME", help="these cases only")
    parser.add_argument("--skip", nargs="+", default=[], metavar="NAME", help="leave these out")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing")
    parser.add_argument("--steps", type=int, default=9, help="timed steps (their median counts)")
    parser.add_argument(
        "--rewarm", type=int, default=REWARM, help="untimed steps of a config before each timed one"
    )
    parser.add_argument("--tiny", action="store_true",
                        help="every case at a tiny size (the test's); --calibration may name "
                        "a built-in cluster")  # fmt: skip
    parser.add_argument("--out", default=str(OUT), help="where the JSON, table and PNG go")
    parser.add_argument("--timeout", type=float, default=600.0, help="gloo timeout, seconds")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.list:
        for c in CASES:
            print(f"{c.name:14} {c.world} rank(s)  {c.tests}")
        return {}
    unknown = sorted(set(args.only + args.skip) - {c.name for c in CASES})
    if unknown:
        parser.error(f"unknown case(s) {unknown}; --list shows them")
    least = {"--warmup": (args.warmup, 0), "--rewarm": (args.rewarm, 0), "--steps": (args.steps, 1)}
    for flag, (value, lowest) in least.items():
        if value < lowest:
            parser.error(f"{flag} must be at least {lowest}, not {value}")
    start = time.perf_counter()
    result = run(args)
    print(markdown(result))
    print(f"({time.perf_counter() - start:.0f} s; written to {args.out})")
    return result


if __name__ == "__main__":
    main()
