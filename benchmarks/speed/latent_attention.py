"""Multi-head latent attention against grouped-query attention on CPU ranks (gloo): tokens/s
of the Llama demo model (6 layers, h = 256, 8 heads, s = 256) with each attention, in one
process and at tp = 2 with sequence parallelism.

- gqa: configs/llama-demo.toml as it is (8 heads of 32, 2 key/value groups);
- mla: the same model with model.attention = mla, queries' latent 128, keys' and values'
  latent 64, keys of 32 + 16, values of 32 (DeepSeek-V3's ratios, scaled down).

The performance model's training FLOPs per token of each are printed beside, so that a
difference in tokens/s can be set against a difference in work. All trainers of a world
size live in the same processes and their timed rounds alternate (ABBA), so machine noise
hits them alike; medians and ratios of one run.

Rows go to runs/benchmarks/latent_attention.json (`--out`); a run rewrites no tracked file.

    python benchmarks/speed/latent_attention.py [--steps 2 --rounds 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.corpus import repo_corpus
from benchmarks.common.rounds import alternating_rounds
from benchmarks.common.spawn import spawn
from ptdp.config.files import apply_updates, load_toml
from ptdp.parallel.env import LaunchEnv
from ptdp.perf.cost.flops import flops_per_token
from ptdp.train.run import prepare
from ptdp.train.step.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
ATTENTION = {
    "gqa": {},
    "mla": {
        "attention": "mla", "num_query_groups": 0, "q_lora_rank": 128, "kv_lora_rank": 64,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    },
}  # fmt: skip
"""`model` keys over configs/llama-demo.toml, by name."""


def _config(data: str, run_dir: str, tp: int, model: dict):
    parallel = {"tp": tp, "sequence_parallel": tp > 1}
    train = {"micro_batch_size": 4, "global_batch_size": 8, "progress": False}
    train |= {"device": "cpu", "run_dir": run_dir, "log_interval": 1000}
    sections = {"model": model, "data": {"path": data}, "parallel": parallel, "train": train}
    return apply_updates(load_toml(ROOT / "configs" / "llama-demo.toml"), sections, "benchmark")


def speed_worker(rank: int, world: int, data: str, root: str, steps: int, rounds: int) -> dict:
    """Tokens/s per round of each model, and its training FLOPs per token (the data's
    vocabulary set)."""
    env = LaunchEnv(rank, world, rank)
    trainers, flops = {}, {}
    for name, model in ATTENTION.items():
        cfg, layout, run_data = prepare(_config(data, f"{root}/{world}-{name}", world, model), env)
        trainers[name] = Trainer(cfg, layout, env, run_data)
        flops[name] = flops_per_token(cfg.model)
    return {"speeds": alternating_rounds(trainers, steps, rounds), "flops": flops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds per model")
    parser.add_argument(
        "--out", default=str(ROOT / "runs" / "benchmarks" / "latent_attention.json")
    )
    args = parser.parse_args()
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        data, root = repo_corpus(Path(tmp) / "data"), str(Path(tmp) / "runs")
        for world in (1, 2):
            run = spawn(speed_worker, world, data, root, args.steps, args.rounds, timeout_s=3600)
            flops, speeds = run["flops"], run["speeds"]
            if world == 1:
                print(f"training FLOPs per token: gqa {flops['gqa']:,.0f}, mla "
                      f"{flops['mla']:,.0f} ({flops['mla'] / flops['gqa']:.3f}x)")  # fmt: skip
                result["flops_per_token"] = flops
            med = {k: statistics.median(v) for k, v in speeds.items()}
            print(f"tp = {world}: gqa median {med['gqa']:,.0f} tokens/s, mla {med['mla']:,.0f} "
                  f"({med['mla'] / med['gqa']:.3f}x) over {args.rounds} rounds")  # fmt: skip
            result[f"tp{world}"] = speeds
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
