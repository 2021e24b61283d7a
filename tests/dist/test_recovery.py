"""In-process recovery (issue 42): faults every process survives, at known steps of a
4-process run, cost one replayed step each and leave losses, weights and optimizer state
equal to the fault-free run's bit for bit; a repeating fault falls back to the restart
path with its reason in events.jsonl; the healthy path is bitwise unchanged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks.fault_tolerance.chaos import compare, final_state
from ptdp.parallel.env import LaunchEnv
from ptdp.train.faults.events import read_events
from ptdp.train.faults.recovery import RecoveryFallback
from ptdp.train.run import train
from ptdp.train.step.trainer import Trainer
from tests.dist.harness import run_ranks
from tests.helpers import tiny_config

pytestmark = pytest.mark.dist

T = 2.0  # collective timeout: what a rank blocked on the faulty one waits
FORWARD_BACKWARD, ALL_REDUCE = Trainer.forward_backward, dist.all_reduce


def _short_timeouts() -> None:
    """The harness's group waits 60 s; the runs here time out after T."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("short/", store), rank=rank, world_size=world,
        timeout=timedelta(seconds=T),
    )  # fmt: skip


def _config(data: str, run_dir: Path, tp: int, zero: int, **train_):
    return tiny_config(
        data, run_dir, optim={"decay_steps": 6},
        train={"micro_batch_size": 2, "steps": 6, "collective_timeout_s": T, **train_},
        parallel={"tp": tp, "pp": 2, "zero": zero},
    )  # fmt: skip


def _inject(rank: int, faults: dict[int, tuple[str, int]], repeat: bool = False) -> list[int]:
    """Patch this process's Trainer: at step s, faults[s] = (kind, rank) fires once (every
    time with `repeat`). Returns the list of the steps started (replays appear twice)."""
    started: list[int] = []
    fired: set[int] = set()
    forward_backward, all_reduce = FORWARD_BACKWARD, ALL_REDUCE

    def due(self, kind: str) -> bool:
        step = self.step + 1
        if faults.get(step, ("", -1)) != (kind, rank) or (step in fired and not repeat):
            return False
        fired.add(step)
        return True

    def patched(self):
        started.append(self.step + 1)
        dist.all_reduce = all_reduce
        if due(self, "raise"):
            raise ValueError("injected fault")
        if due(self, "stop"):  # frozen past the collective timeout, then continued
            subprocess.Popen(["sh", "-c", f"sleep {1.6 * T}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        if due(self, "comm"):
            dist.all_reduce = _failing(all_reduce)  # the step's first all-reduce
        loss = forward_backward(self)
        if due(self, "nan"):  # after the reduction: this rank's copy only
            for piece in self.optimizer.pieces:  # some are counted in the norm on no rank
                piece.master.grad.view(-1)[0] = float("nan")
        return loss

    Trainer.forward_backward = patched
    return started


def _failing(all_reduce):
    def once(*args, **kwargs):
        dist.all_reduce = all_reduce
        raise RuntimeError("gloo/transient: injected communication error")

    return once


def _runs(rank: int, world: int, data: str, root: str, layouts: list, faults: dict) -> None:
    _short_timeouts()
    out = {}
    for name, tp, zero, modes in layouts:
        for mode in modes:
            recovery = mode.removesuffix("-faults")
            on_nan = "retry" if recovery == "in_process" else "stop"
            cfg = _config(data, Path(root) / f"{name}-{mode}", tp, zero,
                          recovery=recovery, on_nan=on_nan)  # fmt: skip
            started = _inject(rank, faults if mode.endswith("-faults") else {})
            result = train(cfg, env=LaunchEnv(rank, world, rank))
            out[f"{name}-{mode}"] = {"losses": result.losses, "started": started}
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))


def _check(root: Path, layouts: list, faults: dict) -> None:
    seen = json.loads((root / "rank0.json").read_text())
    for name, *_, modes in layouts:
        base = f"{name}-{modes[0]}"
        for mode in modes[1:]:
            run = f"{name}-{mode}"
            assert seen[run]["losses"] == seen[base]["losses"], run
            assert compare(final_state(root / base), final_state(root / run))["bitwise_equal"]
            replayed = sorted(faults) if mode.endswith("-faults") else []
            steps = seen[run]["started"]
            assert steps == sorted([*range(1, 7), *replayed]), (run, steps)  # one replay each
            events = [e for e in read_events(root / run) if e["event"] == "recovery"]
            assert [(e["step"], e["tries"]) for e in events] == [(s, 1) for s in replayed]
            for e in events:  # a NaN is seen by all (first rank named), a frozen rank as
                causes, rank = faults[e["step"]]  # a collective that broke or timed out
                assert e["cause"] in causes and rank in (None, e["rank"]), e
                assert e["seconds_to_next_step"] > 0


CAUSES = {
    "raise": ("exception",),
    "comm": ("communication error",),
    "nan": ("non-finite step",),
    "stop": ("communication error", "collective timeout"),
}
NAMED = ("raise", "comm")  # the faulty rank is named; the others are not told apart


def _fault_table(faults: dict) -> dict:
    return {
        s: (CAUSES[kind], rank if kind in NAMED else None) for s, (kind, rank) in faults.items()
    }


def test_tp2_pp2_every_fault_kind_replays_one_step(tiny_data: str, tmp_path: Path) -> None:
    """Healthy path unchanged (restart vs in_process, no fault), then four faults."""
    faults = {2: ("raise", 1), 3: ("comm", 2), 4: ("nan", 3), 5: ("stop", 0)}
    layouts = [("tp2pp2", 2, 0, ["restart", "in_process", "in_process-faults"])]
    run_ranks(_runs, 4, tiny_data, str(tmp_path), layouts, faults, timeout_s=240)
    _check_named(tmp_path, layouts, faults)


def _check_named(root: Path, layouts: list, faults: dict) -> None:
    _check(root, layouts, _fault_table(faults))


def test_dp2_pp2_zero1_and_zero3_recover(tiny_data: str, tmp_path: Path) -> None:
    faults = {2: ("raise", 3), 4: ("comm", 0)}
    layouts = [
        ("zero1", 1, 1, ["restart", "in_process-faults"]),
        ("zero3", 1, 3, ["restart", "in_process-faults"]),
    ]
    run_ranks(_runs, 4, tiny_data, str(tmp_path), layouts, faults, timeout_s=240)
    _check_named(tmp_path, layouts, faults)


def _repeating(rank: int, world: int, data: str, root: str) -> None:
    _short_timeouts()
    cfg = _config(data, Path(root) / "run", 1, 0, recovery="in_process")
    _inject(rank, {3: ("raise", 1)}, repeat=True)
    try:
        train(cfg, env=LaunchEnv(rank, world, rank))
    except RecoveryFallback as exc:
        Path(root, f"rank{rank}.txt").write_text(str(exc))
    if dist.is_initialized():
        torch.distributed.destroy_process_group()  # left broken by the fault: no barrier


def test_repeating_fault_falls_back_with_its_reason(tiny_data: str, tmp_path: Path) -> None:
    run_ranks(_repeating, 2, tiny_data, str(tmp_path), timeout_s=120)
    for rank in (0, 1):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert "step 3: exception on rank 1" in text and "repeated" in text, text
    fallback = [e for e in read_events(tmp_path / "run") if e["event"] == "recovery_fallback"]
    assert len(fallback) == 1, fallback
    assert fallback[0]["step"] == 3 and fallback[0]["rank"] == 1
    assert "repeated on the same step 3 times" in fallback[0]["reason"]


def _one_process(cfg):
    return replace(cfg, parallel=replace(cfg.parallel, pp=1))


def test_one_process_recovers_an_exception(
    tiny_data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No process group: the agreement is with itself; the rebuild keeps the state."""
    base = train(_one_process(_config(tiny_data, tmp_path / "base", 1, 0)))
    monkeypatch.setattr(Trainer, "forward_backward", FORWARD_BACKWARD)
    started = _inject(0, {3: ("raise", 0)})
    cfg = _config(tiny_data, tmp_path / "faulty", 1, 0, recovery="in_process")
    result = train(_one_process(cfg))
    assert result.losses == base.losses and started == [1, 2, 3, 3, 4, 5, 6]
    assert compare(final_state(tmp_path / "base"), final_state(tmp_path / "faulty"))[
        "bitwise_equal"
    ]


def test_frozen_rank_under_torchrun_rejoins(tiny_data: str, tmp_path: Path) -> None:
    """Under torchrun (the watchdog on): rank 2 is stopped for 1.5 T, past the collective
    timeout but within the second one (2 T); no process exits, step 3 is replayed once and
    the final state equals the fault-free run's bit for bit."""
    from benchmarks.fault_tolerance.recovery import launch, train_args

    t = 4.0
    args = train_args(tiny_data, 2, 2, 5, collective_timeout_s=t, recovery="in_process")
    launch(tmp_path / "base", args, [], restarts=0)  # raises if torchrun exits non-zero
    launch(tmp_path / "stop", args, [{"kind": "stop", "rank": 2, "step": 3, "for_s": 1.5 * t}], 0)
    events = [e for e in read_events(tmp_path / "stop/run") if e["event"] != "checkpoint"]
    assert [e["event"] for e in events] == ["recovery"], events
    assert events[-1]["step"] == 3 and events[-1]["tries"] == 1
    assert events[-1]["cause"] in CAUSES["stop"] and (tmp_path / "stop/marks/0").is_file()
    base, stop = (final_state(tmp_path / d / "run") for d in ("base", "stop"))
    assert compare(base, stop)["bitwise_equal"]
