"""Faults injected into real 4-process `ptdp train` runs: how long until every rank has
exited (or the run has recovered), what each rank said, and how much work was lost.

Each scenario launches `ptdp train` four times by hand with torchrun's variables set (as
`srun` would: no launcher tears the other ranks down, so ptdp's watchdog must), or once
under torchrun. This file is also the per-rank driver (`driver` as first argument): it
patches one fault into one rank, PTDP_FAULT = "kind:rank:step[:seconds]" (or "none"), fired once at
that rank's first backward action of that step, in the middle of the step (not again in
a run that torchrun restarted, `--max-restarts`):

  kill   SIGKILL (as the kernel's out-of-memory killer does)
  raise  a RuntimeError inside the action (an exception in the training code)
  stop   SIGSTOP (a frozen process, or a machine that went silent)
  slow   sleep `seconds` inside the action (a straggler)
  nan    a NaN in this rank's copy of one gradient after the reduction
  term   SIGTERM to every rank, whatever `rank` says (a scheduler's notice before
         preemption)

Before firing it writes the wall-clock time to <run_dir>/fault_at.

    python benchmarks/fault_tolerance/failures.py [--out benchmarks/results/failures.json]

By default the rows go to runs/benchmarks/failures.json (ignored by git); name the
tracked record with --out to update it.

tests/dist/test_rank_death.py runs the same launches with assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 12.0
"""train.collective_timeout_s of these runs: every rank must be gone within it."""


# ----------------------------------------------------------------------------- the driver


@contextlib.contextmanager
def _inside(inner, fault):
    """Fire `fault` inside the action's own context, as a fault in its kernel would."""
    with inner:
        fault()
        yield


def _inject(kind: str, rank: int, step: int, seconds: float) -> None:
    from ptdp.pipeline.actions import Action, Kind
    from ptdp.train.step.trainer import Trainer

    original = Trainer.around
    fired = False

    def fire(self) -> None:
        (self.run_dir / "fault_at").write_text(f"{time.time()!r}")

    def _raise() -> None:
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")

    def around(self, action):
        nonlocal fired
        is_backward = isinstance(action, Action) and action.kind in (Kind.B, Kind.BW)
        on_rank = self.env.rank == rank or kind == "term"
        if fired or not is_backward or not on_rank or self.step + 1 != step:
            return original(self, action)
        fired = True
        fire(self)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "term":  # every rank, as a scheduler signals them all
            os.kill(os.getpid(), signal.SIGTERM)
        elif kind == "raise":
            return _inside(original(self, action), _raise)
        elif kind == "slow":
            return _inside(original(self, action), lambda: time.sleep(seconds))
        return original(self, action)

    def forward_backward(self):
        loss = original_fb(self)
        if (
            self.env.rank == rank
            and self.step + 1 == step
            and not self.run_dir.joinpath("fault_at").exists()
        ):
            fire(self)
            next(iter(self.model.parameters())).main_grad.view(-1)[0] = float("nan")
        return loss

    original_fb = Trainer.forward_backward
    if kind == "nan":
        Trainer.forward_backward = forward_backward
    else:
        Trainer.around = around


def driver(run_dir: str, args: list[str]) -> int:
    import torch

    from ptdp.cli import main

    torch.set_num_threads(1)
    fault = os.environ.get("PTDP_FAULT", "none")
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
    if fault != "none" and not restarted:  # once: not again in a run torchrun restarted
        kind, rank, step, *rest = fault.split(":")
        _inject(kind, int(rank), int(step), float(rest[0]) if rest else 0.0)
    return main(["train", "--train.run_dir", run_dir, *args])


# ----------------------------------------------------------------------------- launching


def claim(marker: Path) -> bool:
    """Atomically mark a fault as fired (False if it already was), with the time: the
    chaos and recovery runs inject each fault once, whichever rank gets there first."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, repr(time.time()).encode())
    os.close(fd)
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_args(data: str, tp: int, pp: int, steps: int, **train: object) -> list[str]:
    """Overrides for a tiny 4-layer model on `data` in layout tp x pp."""
    train = {
        "micro_batch_size": 2,
        "global_batch_size": 8,
        "steps": steps,
        "log_interval": 1,
        "eval_interval": 0,
        "progress": "false",
        "device": "cpu",
        "collective_timeout_s": TIMEOUT_S,
        **train,
    }
    model = {"num_layers": 4, "hidden_size": 32, "num_heads": 4, "seq_length": 32}
    args = ["--data.path", data, "--parallel.tp", str(tp), "--parallel.pp", str(pp)]
    for section, values in (("model", model), ("train", train)):
        for key, value in values.items():
            args += [f"--{section}.{key}", str(value)]
    return args


@dataclass
class Launch:
    procs: list[subprocess.Popen]
    logs: list[Path]
    run_dir: Path

    def wait(self, limit_s: float, ignore: tuple[int, ...] = ()) -> dict[int, float]:
        """Wall-clock exit time of each process not ignored (those exited by limit_s)."""
        exited: dict[int, float] = {}
        deadline = time.monotonic() + limit_s
        watched = [i for i in range(len(self.procs)) if i not in ignore]
        while len(exited) < len(watched) and time.monotonic() < deadline:
            for i in watched:
                if i not in exited and self.procs[i].poll() is not None:
                    exited[i] = time.time()
            time.sleep(0.05)
        return exited

    def output(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def fault_at(self) -> float:
        return float((self.run_dir / "fault_at").read_text())

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()


def launch(
    tmp: Path,
    args: list[str],
    fault: str,
    world: int = 4,
    torchrun: bool = False,
    max_restarts: int = 0,
) -> Launch:
    """Start `ptdp train` on `world` ranks with `fault` injected; outputs go to files.
    `max_restarts`: torchrun restarts the ranks after a failure (the fault fires once)."""
    tmp.mkdir(parents=True, exist_ok=True)
    run_dir = tmp / "run"
    port = str(_free_port())
    env = os.environ | {
        "PTDP_FAULT": fault,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }
    script = [str(Path(__file__).resolve()), "driver", str(run_dir), *args]
    if torchrun:
        run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
        run += ["--max-restarts", str(max_restarts)] if max_restarts else []
        commands = [[*run, "--master-addr", "127.0.0.1", "--master-port", port, *script]]
        envs = [env]
    else:
        commands = [[sys.executable, *script]] * world
        envs = [
            env | {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world)}
            for r in range(world)
        ]
    logs, procs = [], []
    for i, (cmd, e) in enumerate(zip(commands, envs)):
        logs.append(tmp / f"out{i}.log")
        with logs[-1].open("w") as out:
            procs.append(subprocess.Popen(cmd, env=e, cwd=ROOT, stdout=out, stderr=out))
    return Launch(procs, logs, run_dir)


# ----------------------------------------------------------------------------- the report


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str
    tp: int
    pp: int
    torchrun: bool = False
    frozen: tuple[int, ...] = ()
    train: tuple[tuple[str, object], ...] = ()
    resume: bool = False
    """Resume afterwards and count the steps run twice (the work lost)."""
    max_restarts: int = 0
    """torchrun --max-restarts: the run restarts itself; its record in events.jsonl says
    how long from the fault to the restarted run's first step."""


SCENARIOS = [
    Scenario("one rank SIGKILLed (torchrun)", "kill:2:8", 2, 2, torchrun=True, resume=True),
    Scenario(
        "one rank SIGKILLed, torchrun --max-restarts 1", "kill:2:8", 2, 2, True, max_restarts=1
    ),
    Scenario("one rank SIGKILLed (by hand, like srun)", "kill:2:8", 2, 2, resume=True),
    Scenario("one rank raises an exception", "raise:1:8", 2, 2, resume=True),
    Scenario("one rank frozen (SIGSTOP)", "stop:2:8", 2, 2, frozen=(2,), resume=True),
    Scenario("SIGTERM to every rank (preemption notice)", "term:0:8", 2, 2, resume=True),
    Scenario(
        "NaN gradient on one rank, on_nan = skip", "nan:1:8", 2, 2, train=(("on_nan", "skip"),)
    ),
    Scenario(
        "NaN gradient on one rank, on_nan = rollback",
        "nan:1:8",
        2,
        2,
        train=(("on_nan", "rollback"),),
    ),
    Scenario(
        "NaN gradient on one rank, on_nan = stop",
        "nan:1:8",
        2,
        2,
        train=(("on_nan", "stop"),),
        resume=True,
    ),
    Scenario(
        "straggler: one rank 4 s late in a step",
        "slow:2:8:4",
        1,
        4,
        train=(("straggler_factor", 3),),
    ),
]
STEPS, SAVE_INTERVAL = 12, 5


def _steps_logged(text: str) -> list[int]:
    return [
        int(line.split()[1])
        for line in text.splitlines()
        if line.startswith("step ") and line.split()[1].isdigit()
    ]


def _first_line(text: str, *marks: str) -> str:
    for line in text.splitlines():
        if any(m in line for m in marks):
            return line.split("error: ", 1)[-1]
    return ""


def run_scenario(s: Scenario, data: str, tmp: Path) -> dict:
    extra = dict(s.train) | {"save_interval": SAVE_INTERVAL}
    args = train_args(data, s.tp, s.pp, STEPS, **extra)
    fault_step = int(s.fault.split(":")[2])
    run = launch(tmp, args, s.fault, torchrun=s.torchrun, max_restarts=s.max_restarts)
    try:
        exited = run.wait(limit_s=180, ignore=s.frozen)
        fault_at = run.fault_at()
        codes = [p.poll() for p in run.procs]
        rank0 = run.output(0)
    finally:
        run.kill_all()
    stopped = any(c != 0 for c in codes)
    row = {
        "fault": s.name,
        "exit codes": codes,
        "seconds from fault to every rank exited": (
            round(max(exited.values()) - fault_at, 2) if stopped else None
        ),
        "message": _first_line(
            rank0, "failed first", "interrupted by", "watchdog:", "non-finite", "rolled back"
        ),
    }
    if "watchdog: step" in rank0:
        row["seconds until reported"] = float(rank0.split(" has run ", 1)[1].split(" s,")[0])
    if "rolled back" in rank0:
        restored = int(rank0.split("(step ", 1)[1].split(")")[0])
        row["work lost"] = (
            f"{fault_step - restored} steps: weights back to step {restored}, the batches "
            f"of steps {restored + 1}..{fault_step} skipped"
        )
    elif "step skipped" in rank0:
        row["work lost"] = f"the batch of step {fault_step}"
    elif not stopped:
        row["work lost"] = "none"
    if s.max_restarts:
        events = [json.loads(line) for line in (run.run_dir / "events.jsonl").open()]
        restart = next(e for e in events if e["event"] == "restart")
        row["restart"] = {
            k: restart[k]
            for k in ("cause", "failed_rank", "fault_step", "step", "steps_lost", "detection_s")
            + ("fault_to_first_step_s", "start_to_first_step_s")
        }
        row["work lost"] = f"{restart['steps_lost']} completed steps and the step in progress"
    if s.resume:
        done = max(_steps_logged(rank0), default=0)
        again = launch(tmp, [*args, "--resume"], "none")
        again.wait(limit_s=180)
        resumed = _steps_logged(again.output(0))
        again.kill_all()
        redone = max(0, done - min(resumed) + 1) if resumed else None
        row["work lost"] = f"{redone} completed steps (trained again after --resume)" + (
            "" if redone == 0 else " and the step in progress"
        )
        row["resume exit code"] = again.procs[0].poll()
    return row


def tiny_corpus(tmp: Path) -> str:
    """A byte-level dataset of about 100k tokens under `tmp`; returns its prefix (tmp/tiny)."""
    from ptdp.data.preprocess import preprocess

    text = tmp / "text"
    text.mkdir(parents=True, exist_ok=True)
    words = "to be or not that is the question whether tis nobler in the mind".split()
    for i in range(12):
        (text / f"d{i}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(2000)))
    preprocess([text], tmp / "tiny", "bytes", progress=False)
    return str(tmp / "tiny")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs/benchmarks/failures.json")
    parser.add_argument("--only", default="", help="run the scenarios whose name has this")
    parser.add_argument("--keep", type=Path, help="keep every run's logs in this directory")
    opts = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = opts.keep or Path(tmp_name)
        tiny_corpus(tmp)
        for i, s in enumerate(SCENARIOS):
            if opts.only not in s.name:
                continue
            print(f"[{i + 1}/{len(SCENARIOS)}] {s.name} ...", flush=True)
            (tmp / str(i)).mkdir(exist_ok=True)
            rows.append(run_scenario(s, str(tmp / "tiny"), tmp / str(i)))
            print(json.dumps(rows[-1], indent=1), flush=True)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["driver"]:
        sys.exit(driver(sys.argv[2], sys.argv[3:]))
    main()
