"""fp8 against bf16: the same run (model, data, seed, steps) in bf16 and in each fp8 recipe;
the loss it ends at and the tokens/s it trains at.

The loss is the mean of the last `--tail` logged steps (the same batches in every run), so
the fp8 rows say how far float8 GEMMs move the result from bf16's. On a CPU, torchao
emulates the float8 products (the casts are real), so tokens/s there says nothing about a
GPU's float8 tensor cores; on a GPU it is the fp8 speed-up over bf16 of ptdp's own step.

    python benchmarks/speed/fp8_loss.py                             # CPU: tiny model, 200 steps
    python benchmarks/speed/fp8_loss.py --device cuda --hidden 2048 --layers 24 --heads 16 \\
        --seq 2048 --micro-batch 8 --data PREFIX --json out.json   # a GPU: the 1.3B shape

Without `--data` it trains on a seeded synthetic corpus of short English words (written to
a temporary directory); `--json` writes the rows and the machine to that file.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import random
import sys
import tempfile
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.data.preprocess import preprocess
from ptdp.train.run import train

RUNS = {
    "bf16": {"precision": "bf16"},
    "fp8-tensorwise": {"precision": "fp8", "fp8_recipe": "tensorwise"},
    "fp8-rowwise": {"precision": "fp8", "fp8_recipe": "rowwise"},
}
WORDS = "the of and to in is it that was for on are as with his they at be this from".split()


def synthetic_corpus(directory: Path, docs: int = 12) -> str:
    """A seeded byte-tokenized corpus of random short sentences; returns its prefix."""
    rnd = random.Random(0)
    (directory / "text").mkdir(parents=True)
    for i in range(docs):
        lines = (" ".join(rnd.choices(WORDS, k=rnd.randint(4, 10))) for _ in range(30))
        (directory / "text" / f"{i:02d}.txt").write_text("\n".join(lines) + "\n")
    preprocess([directory / "text"], directory / "tiny", "bytes", progress=False)
    return str(directory / "tiny")


def config(args: argparse.Namespace, data: str, run_dir: Path, keys: dict) -> RunConfig:
    model = {"num_layers": args.layers, "hidden_size": args.hidden, "num_heads": args.heads}
    return apply_updates(
        RunConfig(),
        {
            "model": {**model, "seq_length": args.seq},
            "data": {"path": data, "valid_fraction": 0.1},
            "optim": {"lr": args.lr, "min_lr": args.lr / 10, "warmup_steps": args.steps // 10},
            "train": {
                "micro_batch_size": args.micro_batch,
                "global_batch_size": args.micro_batch,
                "steps": args.steps,
                "log_interval": 1,
                "eval_interval": 0,
                "run_dir": str(run_dir),
                "progress": False,
                "device": args.device,
                **keys,
            },
        },
        "benchmarks/speed/fp8_loss.py",
    )


def run(args: argparse.Namespace, data: str, root: Path) -> list[dict]:
    rows = []
    for name, keys in RUNS.items():
        train(config(args, data, root / name, keys))
        logged = [json.loads(line) for line in (root / name / "metrics.jsonl").open()]
        steps = [r for r in logged if "loss" in r][-args.tail :]
        rows.append(
            {
                "run": name,
                "loss": sum(r["loss"] for r in steps) / len(steps),
                "tokens_per_s": sum(r["tokens_per_s"] for r in steps) / len(steps),
                "final_loss": steps[-1]["loss"],
            }
        )
    base = rows[0]
    for row in rows:
        row["loss_vs_bf16"] = row["loss"] / base["loss"] - 1
        row["speed_vs_bf16"] = row["tokens_per_s"] / base["tokens_per_s"]
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--tail", type=int, default=50, help="logged steps the loss is averaged over")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data", help="a preprocessed dataset prefix (default: a synthetic one)")
    p.add_argument("--json", help="write the rows and the machine to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or synthetic_corpus(Path(tmp) / "data")
        rows = run(args, data, Path(tmp) / "runs")
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    torchao = importlib.metadata.version("torchao")
    machine = f"{device} | {platform.machine()} | torch {torch.__version__} | torchao {torchao}"
    print(f"{machine} | {args.steps} steps, loss = mean of the last {args.tail}")
    for r in rows:
        print(
            f"{r['run']:>15}: loss {r['loss']:.4f} ({r['loss_vs_bf16']:+.2%} vs bf16) | "
            f"{r['tokens_per_s']:,.0f} tokens/s ({r['speed_vs_bf16']:.2f}x bf16)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
