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
3. Tokens/s of the folded layout with a shared expert, `parallel.moe_overlap` off and on
   (the dispatch all-to-all in flight while the shared expert computes), alike.

Rows go to runs/benchmarks/moe_folding.json (`--out`); a run rewrites no tracked file.

    python benchmarks/parallelism/moe_folding.py [--steps 2 --rounds 6 --part 1|2|3|all]
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

import benchmarks.parallelism.expert_parallel as ep_bench
from benchmarks.common.corpus import repo_corpus
from benchmarks.common.rounds import alternating_rounds
from benchmarks.common.spawn import spawn
from ptdp.config.files import apply_updates
from ptdp.parallel import comm
from ptdp.parallel.env import LaunchEnv
from ptdp.train.run import prepare
from ptdp.train.step.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
WORLD = 4
LAYOUTS = {
    "unfolded (etp=2, ep=2)": {"tp": 2, "sequence_parallel": True, "etp": 2, "ep": 2},
    "folded (etp=1, ep=4)": {"tp": 2, "sequence_parallel": True, "etp": 1, "ep": 4},
}
"""The layouts compared, by name: `parallel` keys on top of the demo config."""
_FOLDED = LAYOUTS["folded (etp=1, ep=4)"]
OVERLAP = {
    "shared expert, overlap off": (_FOLDED, {"moe_shared_experts": 1}),
    "shared expert, overlap on": (_FOLDED | {"moe_overlap": True}, {"moe_shared_experts": 1}),
}
"""Part 3's layouts: (`parallel` keys, extra `model` keys)."""


def _trainer(rank: int, world: int, run_dir: str, data: str, parallel: dict, model: dict):
    env = LaunchEnv(rank, world, rank)
    base = ep_bench._config(data, run_dir, parallel)
    cfg, layout, run_data = prepare(apply_updates(base, {"model": model}, "benchmark"), env)
    return cfg, layout, Trainer(cfg, layout, env, run_data)


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


def speed_worker(
    rank: int, world: int, data: str, root: str, steps: int, rounds: int, part: str
) -> dict:
    layouts = (
        {k: (v, {}) for k, v in LAYOUTS.items()} if part == "2" else OVERLAP
    )  # name -> (parallel, model)
    trainers = {
        name: _trainer(rank, world, f"{root}/speed{part}-{i}", data, parallel, model)[2]
        for i, (name, (parallel, model)) in enumerate(layouts.items())
    }
    return alternating_rounds(trainers, steps, rounds)


def _report(speeds: dict, rounds: int) -> None:
    med = {k: statistics.median(v) for k, v in speeds.items()}
    first = next(iter(med))
    for name, value in med.items():
        ratio = value / med[first]
        print(f"   {name}: median {value:,.0f} tokens/s over {rounds} rounds "
              f"({ratio:.3f}x {first})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds per layout")
    parser.add_argument("--part", choices=("1", "2", "3", "all"), default="all")
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
        for part, title in (("2", "folded against unfolded"), ("3", "moe_overlap off and on")):
            if args.part not in (part, "all"):
                continue
            print(f"{part}. tokens/s, {WORLD} ranks (tp = 2, dp = 2): {title}")
            speeds = spawn(
                speed_worker, WORLD, data, root, args.steps, args.rounds, part, timeout_s=3600
            )
            _report(speeds, args.rounds)
            result[f"speed{part}"] = speeds
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
