"""Parallel folding on 4 CPU ranks (gloo): the experts laid out apart from attention against
the experts split like the dense layers, at tp = 2 with sequence parallelism and dp = 2.

The MoE demo model of benchmarks/parallelism/expert_parallel.py (6 layers, h = 256,
s = 256; 8 experts, 2 per token) on a byte-level corpus of this repository's text:

- unfolded: etp = tp = 2 (every expert split over the tensor ranks), ep = 2 over dp: each
  tensor rank routes, sends and computes the whole microbatch's tokens;
- folded: etp = 1 (every expert whole), ep = 4 over tp * dp: each tensor rank routes its
  own half of the sequence, and each token-choice crosses the all-to-all once.

1. All-to-all bytes one training step sends to other ranks, per MoE layer and microbatch
   (mean over ranks; `ptdp.parallel.comm._all_to_all` counted per call).
2. Tokens/s: all trainers live in the same four processes and their timed rounds
   alternate (ABBA), so machine noise hits them alike; medians and ratios.

Rows go to runs/benchmarks/moe_folding.json (`--out`); a run rewrites no tracked file.

    python benchmarks/parallelism/moe_folding.py [--steps 2 --rounds 6 --part 1|2|all]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.corpus import repo_corpus
from benchmarks.common.spawn import spawn
from benchmarks.parallelism.expert_parallel import _trainer
from ptdp.parallel import comm

ROOT = Path(__file__).resolve().parents[2]
WORLD = 4
LAYOUTS = {
    "unfolded (etp=2, ep=2)": {"tp": 2, "sequence_parallel": True, "etp": 2, "ep": 2},
    "folded (etp=1, ep=4)": {"tp": 2, "sequence_parallel": True, "etp": 1, "ep": 4},
}
"""The layouts compared, by name: `parallel` keys on top of the demo config."""


def bytes_worker(rank: int, world: int, data: str, root: str) -> dict:
    """One step's all-to-all bytes to other ranks per MoE layer and microbatch, by layout."""
    plain, out = comm._all_to_all, {}
    for name, parallel in LAYOUTS.items():
        sent = []

        def counted(x, g, send, recv, sent=sent):
            others = sum(n for i, n in enumerate(send) if i != g.rank)
            sent.append(others * x[0].nbytes if len(x) else 0)
            return plain(x, g, send, recv)

        comm._all_to_all = counted
        try:
            _cfg, layout, trainer = _trainer(
                rank, world, f"{root}/bytes-{len(out)}", data, parallel
            )
            trainer.train_step()
        finally:
            comm._all_to_all = plain
        mine = torch.tensor(float(sum(sent)))
        dist.all_reduce(mine)
        layers = len(trainer.chunks[0].moe_layers())
        out[name] = mine.item() / world / layers / layout.num_microbatches
    return out


def speed_worker(rank: int, world: int, data: str, root: str, steps: int, rounds: int) -> dict:
    trainers = {
        name: _trainer(rank, world, f"{root}/speed-{i}", data, parallel)[2]
        for i, (name, parallel) in enumerate(LAYOUTS.items())
    }
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for trainer in trainers.values():  # warm-up
        trainer.train_step()
    for r in range(rounds):  # ABBA: neither goes first every round
        for name, trainer in list(trainers.items())[:: 1 if r % 2 == 0 else -1]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                trainer.train_step()
            dist.barrier()
            times[name].append((time.perf_counter() - start) / steps)
    tokens = next(iter(trainers.values())).tokens_per_step
    return {k: [tokens / t for t in v] for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds per layout")
    parser.add_argument("--part", choices=("1", "2", "all"), default="all")
    parser.add_argument("--out", default=str(ROOT / "runs" / "benchmarks" / "moe_folding.json"))
    args = parser.parse_args()
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        data, root = repo_corpus(Path(tmp) / "data"), str(Path(tmp) / "runs")
        if args.part in ("1", "all"):
            print("1. all-to-all KiB sent to other ranks per MoE layer and microbatch")
            rows = spawn(bytes_worker, WORLD, data, root, timeout_s=1800)
            for name, value in rows.items():
                print(f"   {name}: {value / 1024:,.1f} KiB")
            result["bytes"] = rows
        if args.part in ("2", "all"):
            print(f"2. tokens/s, {WORLD} ranks (tp = 2, dp = 2)")
            speeds = spawn(speed_worker, WORLD, data, root, args.steps, args.rounds, timeout_s=3600)
            med = {k: statistics.median(v) for k, v in speeds.items()}
            first = next(iter(med))
            for name, value in med.items():
                ratio = value / med[first]
                print(f"   {name}: median {value:,.0f} tokens/s over {args.rounds} rounds "
                      f"({ratio:.3f}x {first})")  # fmt: skip
            result["speed"] = speeds
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
