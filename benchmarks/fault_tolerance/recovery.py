"""In-process recovery against the restart, on the same 4-process run and fault schedule
(issue 42): a `ptdp train` under `torchrun --max-restarts`, train.recovery = restart or
in_process, into which a seeded schedule injects the faults every process survives, one
per `--fault-interval` steps at a random step and rank:

  raise  an exception in the forward-backward of one rank
  comm   a transient error raised by the next all-reduce of one rank
  nan    a NaN in one rank's gradients after the reduction (on_nan = retry in process,
         stop under restart, which then resumes from the last checkpoint)
  stop   SIGSTOP of one rank, continued 1.5 collective timeouts later (in process the
         watchdog waits 2T for a silent rank: recovered; under restart it fails it
         after T/4)

Each fires once (a marker file), before the step's first forward. Reported per mode:
per fault the seconds from the fault to its detection (the first rank in the agreement,
or the failure record) and to the next completed step, and the steps lost
(from events.jsonl), the effective-training-time ratio (the kept steps' step time over
the wall time from the first step's start), and, from a fault-free run of each mode
launched alternately (`--healthy-runs`), the mean step time: the healthy path's cost;
and the ratio of the two modes' effective-training-time ratios. `benchmarks/fault_tolerance/chaos.py
--recovery in_process` runs the same comparison.

    python benchmarks/fault_tolerance/recovery.py [--layout tp2pp2] [--zero 0] [--steps 60]
        [--fault-interval 15] [--kinds raise,comm,nan,stop] [--seed 0]
        [--out runs/benchmarks/recovery.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.fault_tolerance.failures import _free_port, claim, tiny_corpus, train_args

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {"tp2pp2": (2, 2), "dp2pp2": (1, 2)}
TIMEOUT_S = 6.0
"""train.collective_timeout_s: a rank blocked on a faulty one waits this long."""


def schedule(steps: int, interval: int, kinds: list[str], seed: int) -> list[dict]:
    """One fault per `interval` steps, at a random step of it, kinds in turn."""
    rnd = random.Random(seed)
    out = []
    for i, lo in enumerate(range(1, steps - interval + 1, interval)):
        step = rnd.randint(lo + 1, lo + interval - 1)
        out.append({"kind": kinds[i % len(kinds)], "rank": rnd.randrange(4), "step": step})
    return out


def _inject(faults: list[dict], marks: Path, rank: int) -> None:
    import torch.distributed as dist

    from ptdp.train.step.trainer import Trainer

    forward_backward, all_reduce = Trainer.forward_backward, dist.all_reduce

    def failing(*args, **kwargs):
        dist.all_reduce = all_reduce
        raise RuntimeError("gloo/transient: injected communication error")

    def due(kind: str, step: int) -> bool:
        return any(
            f["kind"] == kind and f["step"] == step and f["rank"] == rank and claim(marks / str(i))
            for i, f in enumerate(faults)
        )

    def patched(self):
        step = self.step + 1
        if due("raise", step):
            raise RuntimeError(f"injected fault on rank {rank} at step {step}")
        if due("stop", step):
            wait = next(f.get("for_s", 1.5 * TIMEOUT_S) for f in faults if f["kind"] == "stop")
            subprocess.Popen(["sh", "-c", f"sleep {wait}; kill -CONT {os.getpid()} 2>/dev/null"])
            os.kill(os.getpid(), signal.SIGSTOP)
        if due("comm", step):
            dist.all_reduce = failing
        loss = forward_backward(self)
        if due("nan", step):
            for piece in self.optimizer.pieces:
                piece.master.grad.view(-1)[0] = float("nan")
        return loss

    Trainer.forward_backward = patched


def driver(marks: str, args: list[str]) -> int:
    import torch

    from ptdp.cli import main

    torch.set_num_threads(1)
    faults = json.loads(Path(marks, "schedule.json").read_text())
    _inject(faults, Path(marks), int(os.environ["RANK"]))
    return main(["train", *args])


def launch(work: Path, args: list[str], faults: list[dict], restarts: int) -> float:
    """One torchrun launch; returns its wall time."""
    (work / "marks").mkdir(parents=True, exist_ok=True)
    (work / "marks/schedule.json").write_text(json.dumps(faults))
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    cmd += ["--max-restarts", str(restarts), "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(_free_port()), str(Path(__file__).resolve()), "driver"]
    cmd += [str(work / "marks"), "--train.run_dir", str(work / "run"), *args]
    t0 = time.time()
    with (work / "torchrun.log").open("a") as out:
        code = subprocess.run(cmd, env=env, cwd=ROOT, stdout=out, stderr=out).returncode
    if code:
        raise RuntimeError(f"torchrun exited with {code}; see {work / 'torchrun.log'}")
    return time.time() - t0


def _rows(path: Path) -> list[dict]:
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.strip()]


def report(work: Path, faults: list[dict]) -> dict:
    """Per fault: the recovery (or restart) that followed it; the time ratio."""
    metrics = [r for r in _rows(work / "run/metrics.jsonl") if "step_time_s" in r]
    kept = {r["step"]: r["step_time_s"] for r in metrics}  # a replayed step: its last time
    events = _rows(work / "run/events.jsonl")
    fired = {int(m.name): float(m.read_text()) for m in (work / "marks").glob("[0-9]*")}
    rows = []
    for i, f in enumerate(faults):
        at = fired.get(i)
        ends = ("recovery", "restart")
        e = next((e for e in events if e["event"] in ends and at and e["time"] >= at), {})
        rows.append(
            {
                **f,
                "fired": at is not None,
                "handled_by": e.get("event"),
                "detection_s": _detection(e, events, at),
                "fault_to_next_step_s": round(e["time"] - at, 2) if e else None,
                "steps_lost": e.get("steps_lost", 0 if e.get("event") == "recovery" else None),
            }
        )
    return {"faults": rows, "useful_s": round(sum(kept.values()), 2), "steps": len(kept)}


def _detection(end: dict, events: list[dict], at: float | None) -> float | None:
    """Seconds from the fault to its first record: in process, the first rank's entry into
    the agreement (the recovery's fault_time); under restart, the failure record."""
    if not end or at is None:
        return None
    if end["event"] == "recovery":
        return round(end["fault_time"] - at, 2)
    failure = next((e for e in events if e["event"] == "failure" and e["time"] >= at), None)
    return round(failure["time"] - at, 2) if failure else None


def ratio(faulty: dict) -> float | None:
    """The effective-training-time ratio in process over restart, on the same schedule."""
    if not {"in_process", "restart"} <= faulty.keys() or not faulty["restart"]["effective_ratio"]:
        return None
    return round(faulty["in_process"]["effective_ratio"] / faulty["restart"]["effective_ratio"], 3)


def run_mode(data: str, root: Path, layout: str, zero: int, steps: int, mode: str,
             faults: list[dict], save_interval: int) -> dict:  # fmt: skip
    tp, pp = LAYOUTS[layout]
    on_nan = "retry" if mode == "in_process" else "stop"
    args = train_args(
        data, tp, pp, steps, save_interval=save_interval, on_nan=on_nan, recovery=mode,
        collective_timeout_s=TIMEOUT_S,
    ) + ["--parallel.zero", str(zero), "--model.bias", "false"]  # fmt: skip
    work = root / f"{mode}-{len(faults)}"
    restarts = sum(f["kind"] in ("raise", "comm", "nan", "stop") for f in faults)
    wall = launch(work, args, faults, restarts)
    out = report(work, faults) | {"mode": mode, "wall_s": round(wall, 1)}
    out["effective_ratio"] = round(out["useful_s"] / wall, 3)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the comparison (also `chaos.py --recovery in_process`)."""
    parser.add_argument("--layout", choices=tuple(LAYOUTS), default="tp2pp2")
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fault-interval", type=int, default=15)
    parser.add_argument("--save-interval", type=int, default=10)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--healthy-runs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/benchmarks/recovery.json")
    parser.add_argument("--work", help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--modes", default="restart,in_process")


RATIO = "effective_ratio_in_process_over_restart"
KINDS = ("raise", "comm", "nan", "stop")
"""The faults every process survives."""


def compare_modes(a: argparse.Namespace) -> dict:
    """Both modes on one seeded schedule (and fault-free runs of each); writes a.out."""
    bad = set(a.kinds.split(",")) - set(KINDS)
    if bad:
        raise SystemExit(f"--kinds {sorted(bad)}: in process only {', '.join(KINDS)}")
    faults = schedule(a.steps, a.fault_interval, a.kinds.split(","), a.seed)
    out = {"layout": a.layout, "zero": a.zero, "steps": a.steps, "schedule": faults,
           "collective_timeout_s": TIMEOUT_S, "healthy": {}, "faulty": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        tmp = a.work or scratch
        data = tiny_corpus(Path(tmp))
        for i in range(a.healthy_runs):  # alternately, so drift in the machine hits both
            for mode in ("restart", "in_process"):
                root = Path(tmp, f"healthy{i}")
                r = run_mode(data, root, a.layout, a.zero, a.steps, mode, [], a.save_interval)
                times = [m["step_time_s"] for m in _rows(root / f"{mode}-0/run/metrics.jsonl")
                         if "step_time_s" in m][1:]  # fmt: skip
                out["healthy"].setdefault(mode, []).append(round(statistics.median(times), 5))
        for mode in a.modes.split(","):
            r = run_mode(data, Path(tmp), a.layout, a.zero, a.steps, mode, faults,
                         a.save_interval)  # fmt: skip
            out["faulty"][mode] = r
            print(json.dumps(r), flush=True)
    out[RATIO] = ratio(out["faulty"])
    print(json.dumps(out["healthy"]))
    print(f"effective ratio, in process over restart: {out[RATIO]}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    compare_modes(parser.parse_args())


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "driver":
        sys.exit(driver(sys.argv[2], sys.argv[3:]))
    main()
