"""ZeRO levels on CPU ranks (gloo): model-state bytes per rank, measured against the memory
model, and step time, at parallel.zero = 0, 1, 2.

The demo model's shape (6 layers, h = 256, s = 256) on a byte-level corpus made from this
repository's own text (no download), dp ranks one thread each. Per level, after a few
optimizer steps: the bytes of parameters, gradients (the persistent buffer) and optimizer
state one rank holds, the most full-size bucket gradient ZeRO-2 held at once, each against
`ptdp.perf.memory.estimate_memory`; the median step time over the timed steps; the bucket
reductions started per step.

    python benchmarks/zero.py [--dp 2 --steps 4 --bucket-mb 1 --precision fp32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from ptdp.config import apply_updates, load_toml
from ptdp.data.preprocess import preprocess
from ptdp.parallel.env import LaunchEnv
from ptdp.perf.memory import estimate_memory
from ptdp.train.run import prepare
from ptdp.train.step.trainer import Trainer

try:
    from benchmarks._spawn import spawn
except ModuleNotFoundError:  # run as `python benchmarks/x.py`
    from _spawn import spawn

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


def corpus(directory: Path) -> str:
    """This repository's Markdown and Python text as a bytes-tokenized dataset."""
    texts = directory / "text"
    texts.mkdir(parents=True)
    for i, path in enumerate(sorted([*ROOT.glob("*.md"), *ROOT.glob("ptdp/**/*.py")])):
        (texts / f"{i:04d}.txt").write_text(path.read_text())
    preprocess([texts], directory / "repo", "bytes", progress=False)
    return str(directory / "repo")


def worker(rank: int, world: int, args: argparse.Namespace, data: str, run_dir: str) -> list:
    env, rows = LaunchEnv(rank, world, rank), []
    for zero in (0, 1, 2):
        cfg = load_toml(ROOT / "configs" / "demo.toml")
        cfg = apply_updates(
            cfg,
            {
                "data": {"path": data},
                "parallel": {"zero": zero, "bucket_mb": args.bucket_mb},
                "train": {
                    "micro_batch_size": 4, "global_batch_size": 8 * world, "progress": False,
                    "device": "cpu", "precision": args.precision,
                    "run_dir": f"{run_dir}/zero{zero}",
                },
            },
            "benchmark",
        )  # fmt: skip
        cfg, layout, run_data = prepare(cfg, env)
        trainer = Trainer(cfg, layout, env, run_data)
        trainer.train_step()  # warm-up; AdamW allocates its moments
        times = []
        launches = trainer.grads.launches
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            trainer.train_step()
            dist.barrier()
            times.append(time.perf_counter() - start)
        grads = trainer.grads
        (est,) = estimate_memory(cfg, world, layout=layout)
        rows.append(
            {
                "zero": zero,
                "params": sum(b.params.nbytes for b in grads.chunks),
                "grads": grads.grad_bytes(),
                "optimizer": trainer.optimizer.state_bytes(),
                "peak_full": grads.peak_full_bytes,
                "model": [est.params, est.grads, est.optimizer, est.grad_buckets],
                "ms": 1e3 * statistics.median(times),
                "reductions": (grads.launches - launches) / args.steps,
                "microbatches": layout.num_microbatches,
            }
        )
        if trainer.watchdog:
            trainer.watchdog.close()
        if trainer.owns_process_group:
            dist.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per level")
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = corpus(Path(tmp) / "data")
        rows = spawn(worker, args.dp, args, data, str(Path(tmp) / "runs"))
    print(
        f"dp={args.dp} {args.precision}, bucket {args.bucket_mb} MiB, "
        f"{rows[0]['microbatches']} microbatches per rank per step; MiB per rank "
        "(measured / model)"
    )
    print(
        "| zero | params | grads | optimizer | full buckets (peak) | total | ms/step "
        "| reductions/step |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        got = [r["params"], r["grads"], r["optimizer"], r["peak_full"]]
        cells = " | ".join(f"{g / MIB:.2f} / {m / MIB:.2f}" for g, m in zip(got, r["model"]))
        total = sum(got) / MIB
        print(f"| {r['zero']} | {cells} | {total:.2f} | {r['ms']:.0f} | {r['reductions']:.0f} |")


if __name__ == "__main__":
    main()
