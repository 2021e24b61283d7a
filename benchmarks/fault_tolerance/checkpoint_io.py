"""Checkpoint bandwidth and asynchronous save on CPU ranks (gloo), against `dd` on the same
file system (issue 52).

Each rank holds a synthetic optimizer state (--state-mib of fp32, cut into 4 MiB tensors,
each a box of a global tensor split over the ranks, as ptdp's `Boxes` are) and measures,
at worlds 1, 2 and 4 and writer threads 1, 2 and 4:

1. save: `start_checkpoint(...).finish()` (DCP write with CRC-32 on write, fsync, the
   per-rank record, rank 0's atomic publish), in GB/s per rank (this rank's bytes over
   the slowest rank's time);
2. load: what `CheckpointManager.restore` does (names and sizes checked, then `dcp.load`
   with this rank's share of the checksums computed in a background thread), and, for a
   baseline in the same run, the earlier order (every checksum read first, then the load);
3. `dd`: `world` concurrent `dd if=/dev/zero of=F bs=16M count=N conv=fsync` of the same
   bytes per process, and `dd if=F of=/dev/null bs=16M` of the files just written. Caches
   cannot be dropped without root, so the read figure is the page cache's, and so is the
   checkpoint load's (its files were just written too).
4. the stall: a synthetic step (a matmul, then an in-place update of all the state, as an
   optimizer step does) saved every --save-every steps (40) with no save, a synchronous
   save and an asynchronous one: the median time in the save call, the median step time,
   and the peak resident memory above the state while saving (sampled every 5 ms).

Files go to a temporary directory under --run-dir (removed afterwards). Medians over
--repeats. The results are printed, and written as JSON to --out when given.

    python benchmarks/fault_tolerance/checkpoint_io.py [--state-mib 128] [--repeats 3] \\
        [--out benchmarks/results/checkpoint_io.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.spawn import spawn, timed
from ptdp.checkpoint.boxes import Boxes, TensorPlace, placed_boxes
from ptdp.checkpoint.store import find_checkpoint, load_entries, read_metadata, verify_files
from ptdp.checkpoint.summed import BackgroundCheck
from ptdp.checkpoint.writer import PendingCheckpoint, start_checkpoint
from ptdp.config.sections import RunConfig

ROWS, COLS = 1024, 1024  # one 4 MiB fp32 tensor per rank and key


def build_state(rank: int, world: int, mib: int) -> tuple[torch.Tensor, dict]:
    """A flat fp32 state of `mib` MiB and its entries: one box per 4 MiB tensor, at this
    rank's rows of a global (world * ROWS, COLS) tensor."""
    n = max(1, mib // 4)
    flat = torch.randn(n * ROWS * COLS)
    place = TensorPlace((ROWS, COLS), (ROWS, COLS), (rank * ROWS, 0), (world * ROWS, COLS))
    state = {}
    for i in range(n):
        part = flat[i * ROWS * COLS : (i + 1) * ROWS * COLS]
        state[f"optimizer/state/p{i}/exp_avg"] = Boxes(place.size, placed_boxes(place, part, 0))
    return flat, state | {"step": 1}


def load_targets(state: dict) -> dict:
    """Fresh tensors shaped as this rank's boxes, to load into."""
    out = {}
    for key, value in state.items():
        if isinstance(value, Boxes):
            out[key] = Boxes(tuple(value.shape), [(b, torch.empty_like(d)) for b, d in value.boxes])
    return out


def load_checked(step_dir: Path, state: dict, rank: int, world: int) -> None:
    """As CheckpointManager.restore: sizes first, checksums in the background of the load."""
    metadata = read_metadata(step_dir)
    assert not verify_files(step_dir, metadata, rank, world, checksums=False)
    with BackgroundCheck(lambda: verify_files(step_dir, metadata, rank, world)) as check:
        load_entries(step_dir, load_targets(state), distributed=world > 1)
        assert not check.problems()


def load_read_first(step_dir: Path, state: dict, rank: int, world: int) -> None:
    """The earlier order: every checksum of this rank's share read, then the load."""
    metadata = read_metadata(step_dir)
    assert not verify_files(step_dir, metadata, rank, world)
    load_entries(step_dir, load_targets(state), distributed=world > 1)


def _save(
    run_dir: Path, step: int, state: dict, cfg: RunConfig, distributed: bool, threads: int
) -> None:
    start_checkpoint(
        run_dir, step, state, cfg, None, keep=1, distributed=distributed, threads=threads
    ).finish()


def bandwidth(rank: int, world: int, args, root: str) -> dict:
    """Save and load GB/s per rank for each writer-thread count."""
    _, state = build_state(rank, world, args.state_mib)
    nbytes = args.state_mib // 4 * ROWS * COLS * 4
    cfg, out = RunConfig(), {}
    for threads in args.threads:
        run_dir = Path(root) / f"bw{threads}"
        saves, loads, firsts = [], [], []
        for step in range(1, args.repeats + 1):
            save = partial(_save, run_dir, step, state, cfg, world > 1, threads)
            saves.append(timed(save))
            step_dir = find_checkpoint(run_dir)
            loads.append(timed(partial(load_checked, step_dir, state, rank, world)))
            firsts.append(timed(partial(load_read_first, step_dir, state, rank, world)))
        gbs = [nbytes / s / 1e9 for s in saves]
        out[str(threads)] = {
            "save_gbs": statistics.median(gbs),
            "load_gbs": statistics.median(nbytes / s / 1e9 for s in loads),
            "load_read_first_gbs": statistics.median(nbytes / s / 1e9 for s in firsts),
        }
    return out


class PeakRss:
    """The peak resident memory of this process while active, sampled every 5 ms."""

    def __init__(self) -> None:
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def stall(rank: int, world: int, args, root: str) -> dict:
    """The save call's time, the step time and the peak memory above the state, for no
    save, a synchronous save and an asynchronous one every --save-every steps (repeats + 1
    saves), so that a background write can end before the next save is asked for."""
    flat, state = build_state(rank, world, args.state_mib)
    x = torch.randn(256, 256)
    group = dist.new_group(backend="gloo") if world > 1 else None
    cfg, out = RunConfig(), {}
    for mode in ("none", "sync", "async"):
        run_dir = Path(root) / f"stall-{mode}"
        steps, stalls, pending = [], [], None
        base = PeakRss.now()
        with PeakRss() as rss:
            for step in range(1, args.save_every * (args.repeats + 1) + 1):
                start = time.perf_counter()
                for _ in range(20):
                    x = torch.tanh(x @ x) * 0.5
                flat.add_(1e-6)  # the optimizer's update of every element of the state
                steps.append(time.perf_counter() - start)
                if mode == "none" or step % args.save_every:
                    continue
                start = time.perf_counter()
                if pending is not None:
                    pending.finish()
                pending = start_checkpoint(
                    run_dir, step, state, cfg, None, keep=1, distributed=world > 1,
                    asynchronous=mode == "async", process_group=group,
                    threads=args.stall_threads,
                )  # fmt: skip
                if mode == "sync":
                    pending.finish()
                    pending = None
                stalls.append(time.perf_counter() - start)
            if isinstance(pending, PendingCheckpoint):
                pending.finish()
        out[mode] = {
            "stall_s": statistics.median(stalls) if stalls else 0.0,
            "step_s": statistics.median(steps[1:]),
            "peak_above_mib": (rss.peak - base) / 2**20,
        }
    return out


def dd(directory: Path, world: int, mib: int) -> dict:
    """`world` concurrent dd writes (fsync) of `mib` MiB each, then reads of those files:
    GB/s per process (the read from the page cache: caches cannot be dropped here)."""
    count = max(1, mib // 16)
    files = [directory / f"dd{i}" for i in range(world)]

    def run(cmds: list[list[str]]) -> float:
        start = time.perf_counter()
        procs = [subprocess.Popen(c, stderr=subprocess.DEVNULL) for c in cmds]
        assert all(p.wait() == 0 for p in procs)
        return time.perf_counter() - start

    write = run(
        [["dd", "if=/dev/zero", f"of={f}", "bs=16M", f"count={count}", "conv=fsync"] for f in files]
    )
    read = run([["dd", f"if={f}", "of=/dev/null", "bs=16M"] for f in files])
    for f in files:
        f.unlink()
    nbytes = count * 16 * 2**20
    return {"write_gbs": nbytes / write / 1e9, "read_gbs": nbytes / read / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mib", type=int, default=128, help="state per rank, MiB")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per figure")
    parser.add_argument("--worlds", default="1,2,4", help="rank counts, comma-separated")
    parser.add_argument("--threads", default="1,2,4", help="writer threads, comma-separated")
    parser.add_argument("--stall-threads", type=int, default=2, help="writer threads, stall")
    every = "steps between saves in the stall figures (a background write must fit in them)"
    parser.add_argument("--save-every", type=int, default=40, help=every)
    parser.add_argument("--run-dir", default="runs/bench-checkpoint-io", help="files go here")
    parser.add_argument("--out", default="", help="write the results as JSON here")
    args = parser.parse_args()
    args.threads = [int(t) for t in args.threads.split(",")]
    Path(args.run_dir).mkdir(parents=True, exist_ok=True)
    results: dict = {"state_mib_per_rank": args.state_mib, "repeats": args.repeats}
    for world in (int(w) for w in args.worlds.split(",")):
        with tempfile.TemporaryDirectory(dir=args.run_dir) as root:
            results[f"world{world}"] = {
                "dd": [dd(Path(root), world, args.state_mib) for _ in range(args.repeats)],
                "bandwidth": spawn(bandwidth, world, args, root, timeout_s=600),
                "stall": spawn(stall, world, args, root, timeout_s=600),
            }
            shutil.rmtree(root, ignore_errors=True)
    report(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


def report(results: dict) -> None:
    print(f"state {results['state_mib_per_rank']} MiB per rank, medians of {results['repeats']}")
    print(
        "| ranks | dd write / read GB/s | threads | save GB/s | load GB/s | load, sums read first |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for key, res in results.items():
        if not key.startswith("world"):
            continue
        w = statistics.median(d["write_gbs"] for d in res["dd"])
        r = statistics.median(d["read_gbs"] for d in res["dd"])
        for threads, b in res["bandwidth"].items():
            print(
                f"| {key[5:]} | {w:.2f} / {r:.2f} | {threads} | {b['save_gbs']:.3f} | "
                f"{b['load_gbs']:.3f} | {b['load_read_first_gbs']:.3f} |"
            )
    print()
    print("| ranks | save | stall s | step s | peak MiB above the state |")
    print("|---:|---|---:|---:|---:|")
    for key, res in results.items():
        if key.startswith("world"):
            for mode, s in res["stall"].items():
                print(
                    f"| {key[5:]} | {mode} | {s['stall_s']:.3f} | {s['step_s']:.4f} | "
                    f"{s['peak_above_mib']:.0f} |"
                )


if __name__ == "__main__":
    main()
