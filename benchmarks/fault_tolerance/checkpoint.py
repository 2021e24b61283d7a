"""Checkpoint save and load on CPU ranks (gloo): parallel DCP writes, a single writer,
and the training loop's pause under synchronous and asynchronous saves.

For the demo model (configs/demo.toml, 4096-token vocabulary) in several layouts:

1. `Trainer.save()` (every rank writes its own shards, then checksums and the atomic
   publish) and `Trainer.restore()` (every rank reads what its shards overlap), as the
   slowest rank sees them between barriers, and the bytes of each rank's shard files.
2. A single writer of the same state in the same run: rank 0 holds the full
   single-process state (fp32 masters and AdamW moments, assembled with
   `load_checkpoint`; the gather itself is not timed, so this is a lower bound for a
   gather-to-rank-0 save) and `torch.save`s it to one file; load = `torch.load` of it.
3. The pause of the training loop: the time of the `save()` call with
   `train.async_save = false` (the whole write) against `true` (the copy of the state to
   new CPU memory; the write then runs in a background thread during the next step and
   is published by the next save).

Medians over --repeats. Needs the demo data (`bash scripts/demo.sh` once).

    python benchmarks/fault_tolerance/checkpoint.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.spawn import spawn, timed
from ptdp import checkpoint as ckpt
from ptdp.config.files import apply_updates, load_toml
from ptdp.parallel.env import LaunchEnv
from ptdp.train.run import prepare
from ptdp.train.step.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {  # name: (world, parallel)
    "1 process": (1, {}),
    "dp=2": (2, {}),
    "tp=2": (2, {"tp": 2}),
    "pp=2": (2, {"pp": 2}),
    "tp=2 pp=2": (4, {"tp": 2, "pp": 2}),
}


def build(rank: int, world: int, run_dir: str, parallel: dict, async_save: bool) -> Trainer:
    cfg = load_toml(ROOT / "configs" / "demo.toml")
    updates = {
        "data": {"path": str(ROOT / "data" / "shakespeare" / "shakespeare")},
        "parallel": parallel,
        "train": {
            "progress": False,
            "device": "cpu",
            "micro_batch_size": 2,
            "global_batch_size": 8,
            "run_dir": run_dir,
            "async_save": async_save,
        },
    }
    env = LaunchEnv(rank, world, rank)
    cfg, layout, data = prepare(apply_updates(cfg, updates, "benchmark"), env)
    return Trainer(cfg, layout, env, data)


def worker(rank: int, world: int, args, parallel: dict, root: str) -> dict:
    res: dict = {"save": [], "load": [], "single_save": [], "single_load": []}
    res |= {"pause_sync": [], "pause_async": []}
    trainer = build(rank, world, os.path.join(root, "sync"), parallel, False)
    trainer.train_step()  # AdamW's moments exist from the first step
    for _ in range(args.repeats):
        res["save"].append(timed(trainer.save))
    step_dir = ckpt.find_checkpoint(trainer.run_dir)
    for _ in range(args.repeats):
        res["load"].append(timed(lambda: trainer.restore(step_dir)))
    mine = sum(f.stat().st_size for f in step_dir.glob(f"__{rank}_*.distcp"))
    sizes: list = [None] * world
    dist.all_gather_object(sizes, mine)
    res["bytes"] = sizes
    # A single writer of the same state: rank 0, one torch.save file.
    single = Path(root) / "single.pt"
    if rank == 0:
        full = ckpt.load_checkpoint(step_dir)
    for _ in range(args.repeats):
        res["single_save"].append(timed(lambda: rank == 0 and torch.save(full, single)))
        res["single_load"].append(timed(lambda: rank == 0 and torch.load(single)))
    res["single_bytes"] = single.stat().st_size if rank == 0 else 0
    # The training loop's pause: one step, a save, one step (overlapping a background write).
    trainers = {
        "pause_sync": trainer,
        "pause_async": build(rank, world, os.path.join(root, "async"), parallel, True),
    }
    for key, t in trainers.items():
        for _ in range(args.repeats):
            t.train_step()
            res[key].append(timed(t.save))
            t.train_step()
            t.finish_save()
    return res


def run_layout(world: int, args, parallel: dict) -> dict:
    """Rank 0's measurements of one layout, its run directories in a fresh temporary one."""
    with tempfile.TemporaryDirectory() as root:
        return spawn(worker, world, args, parallel, root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement")
    args = parser.parse_args()
    results = {name: run_layout(world, args, par) for name, (world, par) in LAYOUTS.items()}

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:.0f}"

    print(f"1-2. save and load, demo model (medians of {args.repeats}; slowest rank)")
    print("| layout | ranks | MiB per rank | parallel save ms | parallel load ms "
          "| single-writer MiB | single save ms | single load ms |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for name, res in results.items():
        per_rank = " / ".join(f"{b / 2**20:.1f}" for b in res["bytes"])
        print(
            f"| {name} | {len(res['bytes'])} | {per_rank} | {ms(res['save'])} | "
            f"{ms(res['load'])} | {res['single_bytes'] / 2**20:.1f} | "
            f"{ms(res['single_save'])} | {ms(res['single_load'])} |"
        )
    print()
    print("3. training loop pause per save (time of the save() call)")
    print("| layout | synchronous ms | asynchronous ms | ratio |")
    print("|---|---:|---:|---:|")
    for name, res in results.items():
        s, a = (statistics.median(res[k]) for k in ("pause_sync", "pause_async"))
        print(f"| {name} | {s * 1e3:.0f} | {a * 1e3:.0f} | {a / s:.2f} |")


if __name__ == "__main__":
    main()
