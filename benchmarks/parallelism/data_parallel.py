"""Data parallelism on CPU ranks (gloo): overlapped gradient reduction and optimizer memory.

1. Step time of the demo model at dp=2 with each bucket's all-reduce started during the
   last microbatch's backward (`parallel.overlap_grad_reduce = true`) against the same
   run reducing after backward; both trainers live in the same two processes and their
   rounds alternate, so machine noise hits both alike. Medians and their ratio.
2. Optimizer memory per rank (fp32 master copies and AdamW moments, measured from the
   tensors after one step) for dp in {1, 2, 4}, with and without the distributed
   optimizer, in fp32 and bf16.

Needs the demo data (`bash scripts/demo.sh` once, or `ptdp preprocess` into
data/shakespeare/shakespeare).

    python benchmarks/parallelism/data_parallel.py [--steps 4 --rounds 8 --bucket-mb 1]
        [--part 1|2|all]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.spawn import spawn
from ptdp.config.files import apply_updates, load_toml
from ptdp.parallel.env import LaunchEnv
from ptdp.train.run import prepare
from ptdp.train.step.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


def demo_config(**updates: dict):
    cfg = load_toml(ROOT / "configs" / "demo.toml")
    base = {
        "data": {"path": str(ROOT / "data" / "shakespeare" / "shakespeare")},
        "train": {"progress": False, "device": "cpu"},
    }
    for section, values in updates.items():
        base.setdefault(section, {}).update(values)
    return apply_updates(cfg, base, "benchmark")


def build(rank: int, world: int, **updates: dict) -> Trainer:
    env = LaunchEnv(rank, world, rank)
    cfg, layout, data = prepare(demo_config(**updates), env)
    return Trainer(cfg, layout, env, data)


def time_steps(trainer: Trainer, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def overlap_worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    batch = {"micro_batch_size": 4, "global_batch_size": 16}
    trainers = {
        mode: build(
            rank,
            world,
            parallel={"overlap_grad_reduce": mode == "overlapped", "bucket_mb": args.bucket_mb},
            train=batch,
        )
        for mode in ("overlapped", "after backward")
    }
    times: dict[str, list[float]] = {mode: [] for mode in trainers}
    for trainer in trainers.values():  # warm-up
        time_steps(trainer, 1)
    for r in range(args.rounds):  # ABBA order: neither mode always goes first
        for mode, trainer in list(trainers.items())[:: 1 if r % 2 == 0 else -1]:
            times[mode].append(time_steps(trainer, args.steps))
    early = trainers["overlapped"].grads.early_launches
    total = trainers["overlapped"].grads.launches
    return {"times": times, "early": early, "launches": total}


def memory_worker(rank: int, world: int, args: argparse.Namespace) -> list[tuple]:
    rows = []
    for precision in ("fp32", "bf16"):
        for distributed in (False, True):
            trainer = build(
                rank,
                world,
                optim={"distributed": distributed},
                train={
                    "micro_batch_size": 2,
                    "global_batch_size": 2 * world,
                    "precision": precision,
                },
            )
            trainer.train_step()  # AdamW allocates its moments on the first step
            mine = torch.tensor(float(trainer.optimizer.state_bytes()))
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            rows.append(
                (precision, distributed, mine.item(), trainer.optimizer.planned_state_bytes())
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds per mode")
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="gradient bucket size")
    parser.add_argument("--part", choices=("1", "2", "all"), default="all")
    args = parser.parse_args()
    if args.part in ("1", "all"):
        overlap_part(args)
    if args.part in ("2", "all"):
        memory_part(args)


def overlap_part(args: argparse.Namespace) -> None:

    print("1. dp=2 step time, demo model, micro batch 4, global batch 16 (2 microbatches/rank)")
    res = spawn(overlap_worker, 2, args)
    med = {mode: statistics.median(t) for mode, t in res["times"].items()}
    for mode, value in med.items():
        print(f"   {mode:>15}: median {value * 1e3:7.1f} ms/step over {args.rounds} rounds")
    ratio = med["overlapped"] / med["after backward"]
    print(f"   overlapped / after backward = {ratio:.3f}")
    print(f"   buckets started during backward: {res['early']} of {res['launches']}")


def memory_part(args: argparse.Namespace) -> None:
    print("2. optimizer memory per rank (max over ranks), demo model")
    print(
        "   | precision | dp | distributed | measured MiB | planned MiB | x dp / not distributed |"
    )
    print("   |---|---:|---|---:|---:|---:|")
    for dp in (1, 2, 4):
        rows = spawn(memory_worker, dp, args)
        plain = {p: m for p, d, m, _ in rows if not d}
        for precision, distributed, measured, planned in rows:
            share = measured * dp / plain[precision] if distributed else 1.0
            print(
                f"   | {precision} | {dp} | {'yes' if distributed else 'no'} | "
                f"{measured / 2**20:.2f} | {planned / 2**20:.2f} | {share:.3f} |"
            )


if __name__ == "__main__":
    main()
