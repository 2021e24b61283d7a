"""Expert parallelism on CPU ranks (gloo): all-to-all bytes, model state per rank, speed.

An MoE version of the demo model (6 layers, h = 256, s = 256; 8 experts of the MLP's width,
2 per token, the Switch balancing loss) on a byte-level corpus made from this repository's
own text (no download), 2 or 4 ranks of one thread each, the same global batch everywhere.

1. Bytes per MoE layer: what the all-to-alls of one training step sent to other ranks
   (`ptdp.parallel.comm._all_to_all`, counted per call), per MoE layer and microbatch, at
   ep = 1, 2, 4 (dp = ep), against `ptdp.perf.cost.moe.alltoall_bytes` x 4 (dispatch and
   combine, forward and backward) under uniform routing; the ratio is the routing's skew
   (the step's real loads, not a perfect balance).
2. Model state per rank (parameters, gradients, optimizer state; MiB, max over ranks) at
   ep = 1 and ep = 2 (dp = 2, ZeRO-0 and ZeRO-1), against
   `ptdp.perf.cost.memory.estimate_memory`.
3. Tokens/s at ep = 2 against ep = 1 (dp = 2): both trainers live in the same two processes
   and their timed rounds alternate, so machine noise hits both alike; medians and ratio.

Rows go to runs/benchmarks/expert_parallel.json (`--out`); a run rewrites no tracked file.

    python benchmarks/parallelism/expert_parallel.py [--steps 3 --rounds 6 --part 1|2|3|all]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.corpus import repo_corpus
from benchmarks.common.rounds import alternating_rounds
from benchmarks.common.spawn import spawn
from ptdp.config.files import apply_updates, load_toml
from ptdp.parallel import comm
from ptdp.parallel.env import LaunchEnv
from ptdp.perf.cost.memory import estimate_memory
from ptdp.perf.cost.moe import alltoall_bytes
from ptdp.train.run import prepare
from ptdp.train.step.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20
MOE = {"num_experts": 8, "moe_top_k": 2, "moe_aux_loss_coeff": 0.01}
MICRO, GLOBAL = 4, 16


def _config(data: str, run_dir: str, parallel: dict):
    cfg = load_toml(ROOT / "configs" / "demo.toml")
    return apply_updates(
        cfg,
        {
            "model": MOE,
            "data": {"path": data},
            "parallel": parallel,
            "train": {
                "micro_batch_size": MICRO, "global_batch_size": GLOBAL, "progress": False,
                "device": "cpu", "run_dir": run_dir, "log_interval": 1000,
            },
        },
        "benchmark",
    )  # fmt: skip


def _trainer(rank: int, world: int, run_dir: str, data: str, parallel: dict):
    env = LaunchEnv(rank, world, rank)
    cfg, layout, run_data = prepare(_config(data, run_dir, parallel), env)
    return cfg, layout, Trainer(cfg, layout, env, run_data)


def bytes_worker(rank: int, world: int, data: str, root: str) -> dict:
    """One step's all-to-all bytes sent to other ranks, per MoE layer and microbatch."""
    sent = []
    plain = comm._all_to_all

    def counted(x, g, send, recv):
        others = sum(n for i, n in enumerate(send) if i != g.rank)
        sent.append(others * x[0].nbytes if len(x) else 0)
        return plain(x, g, send, recv)

    comm._all_to_all = counted
    try:
        cfg, layout, trainer = _trainer(rank, world, f"{root}/bytes{world}", data, {"ep": world})
        trainer.train_step()
    finally:
        comm._all_to_all = plain
    mine = torch.tensor(float(sum(sent)))
    dist.all_reduce(mine)
    layers = len(trainer.chunks[0].moe_layers())
    m = cfg.model
    formula = 4 * alltoall_bytes(m.seq_length * MICRO, m.moe_top_k, m.hidden_size, world, 4)
    return {
        "ep": world,
        "calls": len(sent),
        "measured": mine.item() / world / layers / layout.num_microbatches,
        "formula": formula,
    }


def memory_worker(rank: int, world: int, data: str, root: str) -> list[dict]:
    rows = []
    for ep in (1, 2):
        for zero in (0, 1):
            name = f"{root}/mem-ep{ep}-zero{zero}"
            cfg, layout, trainer = _trainer(rank, world, name, data, {"ep": ep, "zero": zero})
            trainer.train_step()  # AdamW allocates its moments
            g = trainer.grads
            mine = torch.tensor(
                [float(g.param_bytes()), float(g.grad_bytes()), trainer.optimizer.state_bytes()]
            )
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            (est,) = estimate_memory(cfg, world, layout=layout)
            rows.append(
                {
                    "ep": ep,
                    "zero": zero,
                    "measured": [v / MIB for v in mine.tolist()],
                    "model": [est.params / MIB, est.grads / MIB, est.optimizer / MIB],
                }
            )
    return rows


def speed_worker(rank: int, world: int, data: str, root: str, steps: int, rounds: int) -> dict:
    trainers = {
        f"ep={ep}": _trainer(rank, world, f"{root}/speed-ep{ep}", data, {"ep": ep})[2]
        for ep in (1, 2)
    }
    return alternating_rounds(trainers, steps, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds per layout")
    parser.add_argument("--part", choices=("1", "2", "3", "all"), default="all")
    parser.add_argument("--out", default=str(ROOT / "runs" / "benchmarks" / "expert_parallel.json"))
    args = parser.parse_args()
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        data, root = repo_corpus(Path(tmp) / "data"), str(Path(tmp) / "runs")
        if args.part in ("1", "all"):
            print("1. all-to-all bytes sent per MoE layer and microbatch (mean over ranks)")
            print("   | ep | measured KiB | formula KiB (uniform) | measured / formula |")
            print("   |---:|---:|---:|---:|")
            rows = [{"ep": 1, "calls": 0, "measured": 0.0, "formula": 0.0}]
            rows += [spawn(bytes_worker, ep, data, root) for ep in (2, 4)]
            for row in rows:
                ratio = row["measured"] / row["formula"] if row["formula"] else float("nan")
                print(
                    f"   | {row['ep']} | {row['measured'] / 1024:.1f} | "
                    f"{row['formula'] / 1024:.1f} | {ratio:.3f} |"
                )
            result["bytes"] = rows
        if args.part in ("2", "all"):
            print("2. model state per rank, MiB (max over ranks), dp = 2: measured / model")
            print("   | ep | zero | parameters | gradients | optimizer |")
            print("   |---:|---:|---|---|---|")
            rows = spawn(memory_worker, 2, data, root)
            for row in rows:
                cells = " | ".join(
                    f"{a:.2f} / {b:.2f}" for a, b in zip(row["measured"], row["model"])
                )
                print(f"   | {row['ep']} | {row['zero']} | {cells} |")
            result["memory"] = rows
        if args.part in ("3", "all"):
            print(f"3. tokens/s, 2 ranks, global batch {GLOBAL} x 256 tokens")
            speeds = spawn(speed_worker, 2, data, root, args.steps, args.rounds, timeout_s=1800)
            med = {k: statistics.median(v) for k, v in speeds.items()}
            for name, value in med.items():
                print(f"   {name}: median {value:,.0f} tokens/s over {args.rounds} rounds")
            print(f"   ep=2 / ep=1 = {med['ep=2'] / med['ep=1']:.3f}")
            result["speed"] = speeds
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
