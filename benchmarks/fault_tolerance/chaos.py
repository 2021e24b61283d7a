"""Chaos run: a multi-rank `ptdp train` under `torchrun --max-restarts` into which a seeded
schedule injects faults at random steps; how long each took to detect and to recover
from, the steps it cost (from RUN_DIR/events.jsonl), and the effective-training-time
ratio (useful step time over wall time) beside the same run without faults.

Fault kinds (each fires once, on one rank, in its first backward action of the step,
the mechanism of benchmarks/fault_tolerance/failures.py; `save` fires inside the
checkpoint writer and `nan` after the gradient reduction; a marker file records that it
fired, so a restarted run that trains the step again does not fire it again):

  kill      SIGKILL of a random rank (the out-of-memory killer)
  stop      SIGSTOP (a frozen rank: the watchdog names it after T/4; never continued)
  raise     an exception inside the action
  term      SIGTERM to every rank (a scheduler's notice): the step is finished and saved
  save      SIGKILL while the rank writes a checkpoint (its shards on disk, not recorded)
  truncate  a shard of the latest checkpoint cut to half its size, then SIGKILL: the
            restart continues from the checkpoint before it
  nan       a NaN in one gradient (train.on_nan = rollback: no restart)
  shrink    SIGKILL, and the job comes back with half the processes (dp halves; the
            global batch, data order and schedule stay): torchrun has no restart left,
            and the harness launches it again as a scheduler's requeue on fewer nodes
            (SLURM_RESTART_COUNT=1 makes it a restart, train.resume = auto)

    python benchmarks/fault_tolerance/chaos.py [--layout dp2pp2] [--steps 450]
        [--fault-interval 50] [--save-interval 10] [--seed 0] [--out runs/benchmarks/chaos.json]

With `--recovery in_process` it runs the in-process comparison of
benchmarks/fault_tolerance/recovery.py instead (its options: --zero, --kinds
raise,comm,nan,stop, ...): the faults every process survives at random steps, under
train.recovery = in_process and restart on the same schedule, per fault the detection and
recovery times and steps lost, and the ratio of the two modes' effective training time.

tests/dist/test_chaos.py runs it at a small scale with assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.fault_tolerance import recovery
from benchmarks.fault_tolerance.failures import (
    TIMEOUT_S,
    _free_port,
    _inside,
    claim,
    tiny_corpus,
    train_args,
)

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("kill", "stop", "raise", "term", "save", "truncate", "nan", "shrink")
ENDS_RUN = frozenset(KINDS) - {"nan"}
"""Kinds after which the launcher restarts the job."""
LAYOUTS = {"tp2pp2": (2, 2), "dp2pp2": (1, 2), "dp1pp2": (1, 2)}
"""(tp, pp); dp follows the processes (4 for the first two, 2 for dp1pp2)."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int


def make_schedule(
    seed: int, steps: int, interval: int, save_interval: int, kinds: tuple[str, ...], world: int
) -> list[Fault]:
    """One fault of each kind, in a seeded order, about every `interval` steps (+-1/4)."""
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    faults: list[Fault] = []
    for i, kind in enumerate(order):
        step = interval * (i + 1) + rng.randint(-interval // 4, interval // 4)
        if kind == "save":  # during the save of a step that saves
            step = -(-step // save_interval) * save_interval
        if kind == "truncate":  # an older checkpoint must remain to fall back to
            step = max(step, 2 * save_interval + 1)
        if faults and step <= faults[-1].step:
            step = faults[-1].step + 1
        if step >= steps:
            raise SystemExit(
                f"{len(order)} faults every {interval} steps need more than {steps} steps; "
                "raise --steps or lower --fault-interval"
            )
        faults.append(Fault(kind, step, rng.randrange(world)))
    return faults


# ----------------------------------------------------------------------------- the driver


def _truncate_latest(run_dir: Path) -> str:
    """Cut the largest shard of the checkpoint `latest` names to half its size."""
    step_dir = run_dir / "checkpoints" / (run_dir / "checkpoints/latest").read_text().strip()
    shard = max(step_dir.glob("*.distcp"), key=lambda f: f.stat().st_size)
    os.truncate(shard, shard.stat().st_size // 2)
    return str(shard)


def _inject(faults: list[Fault], marks: Path) -> None:
    """Patch the trainer (and the checkpoint writer) to fire each fault once."""
    from ptdp.checkpoint import writer
    from ptdp.pipeline.actions import Action, Kind
    from ptdp.train.step.trainer import Trainer

    around, forward_backward, record = (
        Trainer.around,
        Trainer.forward_backward,
        writer.record_written,
    )

    def due(i: int, fault: Fault, trainer, step: int) -> bool:
        world, rank = trainer.env.world_size, trainer.env.rank
        if fault.step != step or (fault.kind != "term" and fault.rank % world != rank):
            return False
        return claim(marks / (f"fault{i}.rank{rank}" if fault.kind == "term" else f"fault{i}"))

    def chaos_around(self, action):
        if isinstance(action, Action) and action.kind in (Kind.B, Kind.BW):
            for i, f in enumerate(faults):
                if f.kind in ("nan", "save") or not due(i, f, self, self.step + 1):
                    continue
                if f.kind == "truncate":
                    (marks / f"fault{i}.file").write_text(_truncate_latest(self.run_dir))
                if f.kind == "raise":
                    message = f"injected fault on rank {self.env.rank} at step {f.step}"
                    return _inside(around(self, action), lambda m=message: _raise(m))
                sig = {"stop": signal.SIGSTOP, "term": signal.SIGTERM}.get(f.kind, signal.SIGKILL)
                os.kill(os.getpid(), sig)
        return around(self, action)

    def chaos_forward_backward(self):
        loss = forward_backward(self)
        for i, f in enumerate(faults):
            if f.kind == "nan" and due(i, f, self, self.step + 1):
                next(iter(self.model.parameters())).main_grad.view(-1)[0] = float("nan")
        return loss

    def chaos_record(tmp: Path, rank: int, world: int, sums=None) -> None:
        step = int(re.findall(r"\d+", tmp.name)[0])
        for i, f in enumerate(faults):
            if f.kind == "save" and f.step == step and f.rank % world == rank:
                if claim(marks / f"fault{i}"):
                    os.kill(os.getpid(), signal.SIGKILL)  # shards written, record not
        record(tmp, rank, world, sums)

    Trainer.around, Trainer.forward_backward = chaos_around, chaos_forward_backward
    writer.record_written = chaos_record


def _raise(message: str) -> None:
    raise RuntimeError(message)


def driver(run_dir: str, marks: str, args: list[str]) -> int:
    import torch

    from ptdp.cli import main

    torch.set_num_threads(1)
    faults = [Fault(**f) for f in json.loads(Path(marks, "schedule.json").read_text())]
    _inject(faults, Path(marks))
    return main(["train", "--train.run_dir", run_dir, *args])


# ----------------------------------------------------------------------------- the harness


def chaos_args(data: str, layout: str, steps: int, save_interval: int) -> list[str]:
    tp, pp = LAYOUTS[layout]
    return train_args(
        data, tp, pp, steps, save_interval=save_interval, on_nan="rollback", log_interval=1
    ) + ["--model.bias", "false"]  # a zero-gradient bias would make AdamW amplify rounding


def _torchrun(work: Path, args: list[str], world: int, restarts: int, requeue: int, log: Path):
    port = str(_free_port())
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if requeue:
        env["SLURM_RESTART_COUNT"] = str(requeue)  # as a scheduler's requeue would set it
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
    cmd += ["--max-restarts", str(restarts), "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", port, str(Path(__file__).resolve()), "driver"]
    cmd += [str(work / "run"), str(work / "marks"), *args]
    with log.open("a") as out:
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=out)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _fired(marks: Path, faults: list[Fault]) -> dict[int, float]:
    """When each fault fired (the first rank's time for term)."""
    times: dict[int, float] = {}
    for i in range(len(faults)):
        for m in [marks / f"fault{i}", *marks.glob(f"fault{i}.rank*")]:
            text = m.read_text() if m.is_file() else ""
            if text:
                times[i] = min(times.get(i, float("inf")), float(text))
    return times


class Watch:
    """Progress lines while a launch runs: faults fired, events recorded, the step."""

    def __init__(self, work: Path, faults: list[Fault], t0: float, say) -> None:
        self.work, self.faults, self.t0, self.say = work, faults, t0, say
        self.seen_faults: set[int] = set()
        self.seen_events = 0
        self.last_step_print = 0.0

    def poll(self) -> None:
        now = time.time() - self.t0
        for i, _ in sorted(_fired(self.work / "marks", self.faults).items(), key=lambda x: x[1]):
            if i not in self.seen_faults:
                self.seen_faults.add(i)
                f = self.faults[i]
                self.say(
                    f"[{now:6.1f} s] fault {i + 1}: {f.kind} on rank {f.rank} at step {f.step}"
                )
        events = _read_jsonl(self.work / "run/events.jsonl")
        for e in events[self.seen_events :]:
            keys = ("rank", "how", "step", "steps_lost", "fault_to_first_step_s", "signal")
            detail = ", ".join(f"{k}={e[k]}" for k in keys if e.get(k) is not None)
            self.say(f"[{now:6.1f} s] event {e['event']}: {detail}")
        self.seen_events = len(events)
        if now - self.last_step_print >= 10:
            self.last_step_print = now
            rows = _read_jsonl(self.work / "run/metrics.jsonl")
            step = rows[-1]["step"] if rows else 0
            self.say(f"[{now:6.1f} s] step {step}")


def run(
    data: str,
    work: Path,
    layout: str,
    steps: int,
    save_interval: int,
    faults: list[Fault],
    world: int = 4,
    limit_s: float = 1800,
    say=print,
) -> dict:
    """Train under torchrun with `faults` injected; the report (see `report`)."""
    (work / "marks").mkdir(parents=True, exist_ok=True)
    (work / "marks/schedule.json").write_text(json.dumps([asdict(f) for f in faults]))
    args = chaos_args(data, layout, steps, save_interval)
    shrink = next((f.step for f in faults if f.kind == "shrink"), steps + 1)
    segments = [  # (processes, restarts torchrun may make, requeue count)
        (world, sum(f.kind in ENDS_RUN for f in faults if f.step < shrink), 0)
    ]
    if shrink <= steps:
        segments.append((world // 2, sum(f.kind in ENDS_RUN for f in faults if f.step > shrink), 1))
    t0 = time.time()
    watch, log = Watch(work, faults, t0, say), work / "torchrun.log"
    codes = []
    for n, restarts, requeue in segments:
        say(f"[{time.time() - t0:6.1f} s] torchrun: {n} processes, --max-restarts {restarts}")
        proc = _torchrun(work, args, n, restarts, requeue, log)
        while proc.poll() is None and time.time() - t0 < limit_s:
            time.sleep(0.5)
            watch.poll()
        if proc.poll() is None:
            proc.kill()
            raise RuntimeError(f"the chaos run took over {limit_s} s; see {log}")
        codes.append(proc.returncode)
    watch.poll()
    wall = time.time() - t0
    say(f"[{wall:6.1f} s] done, torchrun exit codes {codes}")
    return report(work, faults, save_interval, wall, codes)


def report(work: Path, faults: list[Fault], save_interval: int, wall: float, codes) -> dict:
    """Per fault: when it fired, when it was detected, the first step after it, the steps
    lost; the useful step time (each kept step's time, once) over the wall time."""
    events = _read_jsonl(work / "run/events.jsonl")
    fired = _fired(work / "marks", faults)
    rows = []
    for i, f in enumerate(faults):
        at = fired.get(i)
        row = {"fault": f.kind, "step": f.step, "rank": f.rank, "fired": at is not None}
        if at is not None:
            row |= _outcome(f, at, events)
        if (work / f"marks/fault{i}.file").is_file():
            row["truncated"] = (work / f"marks/fault{i}.file").read_text()
        rows.append(row)
    skipped = {
        s
        for e in events
        if e["event"] == "rollback"
        for s in range(e["restored"] + 1, e["step"] + 1)
    }
    kept = {r["step"]: r["step_time_s"] for r in _read_jsonl(work / "run/metrics.jsonl")}
    useful = sum(t for s, t in kept.items() if s not in skipped)
    return {
        "faults": rows,
        "events": events,
        "torchrun_exit_codes": codes,
        "final_step": max(kept, default=0),
        "wall_s": round(wall, 2),
        "useful_step_time_s": round(useful, 2),
        "effective_training_time_ratio": round(useful / wall, 4),
    }


def _outcome(f: Fault, at: float, events: list[dict]) -> dict:
    """The events that followed a fault fired at `at`: how it ended the run (or the
    rollback), and the restarted run's record."""
    after = [e for e in events if e["time"] >= at - 0.01]
    if f.kind == "nan":
        e = next((e for e in after if e["event"] == "rollback"), None)
        if e is None:
            return {"named": False}
        took = round(e["time"] - at, 3)
        return {
            "named": True,
            "detection_s": took,
            "fault_to_first_step_s": took,
            "resumed_at": e["restored"],
            "steps_lost": e["steps_lost"],
        }
    end = next((e for e in after if e["event"] in ("failure", "interrupted")), None)
    if end is None:
        return {"named": False}
    begin = next(
        (e for e in after if e["event"] in ("restart", "resume") and e["time"] > end["time"]), None
    )
    row = {
        "named": end["event"] == "interrupted" or end.get("rank") == f.rank,
        "ended_by": end["event"]
        + (f" of rank {end['rank']} ({end.get('how')})" if "rank" in end else ""),
        "detection_s": round(end["time"] - at, 3),
    }
    if begin is not None:
        row |= {
            "fault_to_first_step_s": round(begin["time"] - at, 3),
            "start_to_first_step_s": begin["start_to_first_step_s"],
            "resumed_at": begin["step"],
            "steps_lost": begin["steps_lost"],
            "launch": begin["launch"],
            "skipped": begin.get("skipped"),
            "layout": begin["layout"] if begin["layout"] != begin["layout_saved"] else None,
        }
    return row


def final_state(run_dir: Path) -> dict:
    """The final checkpoint's model weights and optimizer state, by name."""
    from ptdp import checkpoint as ckpt

    state = ckpt.load_checkpoint(ckpt.find_checkpoint(run_dir))
    tensors = {f"model/{k}": v for k, v in state["model"].items()}
    for name, moments in state["optimizer"]["state"].items():
        tensors |= {f"optimizer/{name}/{k}": v for k, v in moments.items()}
    return tensors


def compare(a: dict, b: dict) -> dict:
    """Whether two final states are equal bit for bit, and their largest difference."""
    import torch

    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
    equal = all(torch.equal(a[k], b[k]) for k in tensors) and all(
        a[k] == b[k] for k in a if k not in tensors
    )
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in tensors)
    return {"bitwise_equal": equal, "max_abs_diff": diff}


def main() -> None:
    mode = argparse.ArgumentParser(add_help=False)
    mode.add_argument("--recovery", choices=("restart", "in_process"), default="restart")
    chosen, rest = mode.parse_known_args()
    if chosen.recovery == "in_process":  # both modes on the faults every process survives
        parser = argparse.ArgumentParser(description=recovery.__doc__.splitlines()[0])
        recovery.add_arguments(parser)
        recovery.compare_modes(parser.parse_args(rest))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recovery", choices=("restart", "in_process"), default="restart")
    parser.add_argument("--layout", choices=("dp2pp2", "tp2pp2"), default="dp2pp2")
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--fault-interval", type=int, default=50)
    parser.add_argument("--save-interval", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/benchmarks/chaos.json")
    parser.add_argument("--keep", type=Path, help="keep the run directories and logs here")
    opts = parser.parse_args()
    kinds = tuple(k for k in opts.kinds.split(",") if k)
    if opts.layout == "tp2pp2" and "shrink" in kinds:
        kinds = tuple(k for k in kinds if k != "shrink")  # tp*pp = 4: no smaller world
        print("tp2pp2: no shrink (tp*pp = 4 processes hold one copy of the model)")
    bad = set(kinds) - set(KINDS)
    if bad:
        parser.error(f"unknown fault kinds {sorted(bad)}; choose from {', '.join(KINDS)}")
    faults = make_schedule(opts.seed, opts.steps, opts.fault_interval, opts.save_interval, kinds, 4)
    print("schedule: " + ", ".join(f"{f.kind}@{f.step}/rank{f.rank}" for f in faults))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = opts.keep or Path(tmp_name)
        data = tiny_corpus(tmp)
        print("fault-free run ...")
        clean = run(data, tmp / "clean", opts.layout, opts.steps, opts.save_interval, [])
        print("chaos run ...")
        chaos = run(data, tmp / "chaos", opts.layout, opts.steps, opts.save_interval, faults)
        same = compare(final_state(tmp / "chaos/run"), final_state(tmp / "clean/run"))
    result = {
        "command": " ".join(["python benchmarks/fault_tolerance/chaos.py", *sys.argv[1:]]),
        "layout": opts.layout,
        "steps": opts.steps,
        "fault_interval": opts.fault_interval,
        "save_interval": opts.save_interval,
        "seed": opts.seed,
        "collective_timeout_s": TIMEOUT_S,
        "chaos": chaos,
        "fault_free": clean,
        "final_state_vs_fault_free": same,
    }
    for row in chaos["faults"]:
        print(json.dumps({k: v for k, v in row.items() if k != "truncated"}))
    print(
        f"effective training time: {chaos['effective_training_time_ratio']:.3f} with faults, "
        f"{clean['effective_training_time_ratio']:.3f} without; final state vs fault-free: {same}"
    )
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["driver"]:
        sys.exit(driver(sys.argv[2], sys.argv[3], sys.argv[4:]))
    main()
