"""Peak memory of training steps on CPU ranks against the performance model's count.

CPUs have no allocator statistics, so `LiveBytes` counts what `torch.cuda.memory_allocated`
counts on a GPU: the bytes of every tensor storage created while it is active (through a
`TorchDispatchMode`), until the storage is freed (a weak reference's callback), and the
most alive at once. It runs around one steady-state training step (the third; AdamW's
moments exist by then), so its peak is what the step adds on top of the model state:
the model's `activations + working + stash` for that pipeline rank
(`ptdp.perf.cost.memory.estimate_memory`), each rank measured on its own process (gloo,
one thread per rank). fp32, no dropout: the CPU flash-attention kernel, which keeps its
output and a logsumexp as on a GPU. Writes no tracked file unless --out is given:

    python benchmarks/memory/memory_validation.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.corpus import repo_corpus
from benchmarks.common.spawn import spawn
from ptdp.config.files import apply_updates, load_toml
from ptdp.parallel.env import LaunchEnv
from ptdp.perf.cost.memory import estimate_memory
from ptdp.train.run import prepare
from ptdp.train.step.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20

# Llama-style: RoPE, RMSNorm, SwiGLU, grouped-query attention (2 groups of 2 heads), untied.
LLAMA = {
    "position_embedding": "rope", "normalization": "rmsnorm", "activation": "swiglu",
    "num_query_groups": 2, "tie_embeddings": False, "bias": False,
}  # fmt: skip
# name: (world, model, parallel, micro batch, global batch)
CASES: dict[str, tuple[int, dict, dict, int, int]] = {
    "h64 s64": (1, {"hidden_size": 64, "seq_length": 64}, {}, 4, 8),
    "h128 s64": (1, {"hidden_size": 128, "seq_length": 64}, {}, 4, 8),
    "h128 s256": (1, {"hidden_size": 128, "seq_length": 256}, {}, 4, 8),
    "h128 s128 selective": (
        1, {"hidden_size": 128, "seq_length": 128}, {"recompute": "selective"}, 4, 8,
    ),
    "h128 s128 full": (1, {"hidden_size": 128, "seq_length": 128}, {"recompute": "full"}, 4, 8),
    "llama h128 s128": (1, {"hidden_size": 128, "seq_length": 128, **LLAMA}, {}, 4, 8),
    "llama h128 s128 full": (
        1, {"hidden_size": 128, "seq_length": 128, **LLAMA}, {"recompute": "full"}, 4, 8,
    ),
    "h64 s64 pp2 interleaved": (
        2, {"hidden_size": 64, "seq_length": 64},
        {"pp": 2, "vpp": 2, "schedule": "interleaved"}, 2, 8,
    ),
    "h128 s128 pp2 1f1b": (2, {"hidden_size": 128, "seq_length": 128}, {"pp": 2}, 2, 8),
    "h128 s128 pp2 interleaved": (
        2, {"hidden_size": 128, "seq_length": 128},
        {"pp": 2, "vpp": 2, "schedule": "interleaved"}, 2, 8,
    ),
    "h128 s128 pp2 zb-h1": (
        2, {"hidden_size": 128, "seq_length": 128}, {"pp": 2, "schedule": "zb-h1"}, 2, 8,
    ),
}  # fmt: skip
TINY = ("h64 s64", "h64 s64 pp2 interleaved")  # the suite runs these (tests/unit)


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created under it and still alive, and their peak.

    An op's output counts when its storage is none of its inputs' (views and in-place ops
    allocate nothing); it stops counting when the storage is freed. Tensors that existed
    before (parameters, gradient buffers, optimizer state) are never counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._held: dict[int, tuple[int, weakref.ref]] = {}

    def _freed(self, ptr: int) -> None:
        nbytes, _ = self._held.pop(ptr, (0, None))
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in inputs or ptr in self._held:
                continue
            ref = weakref.ref(storage, lambda _, ptr=ptr: self._freed(ptr))
            self._held[ptr] = (storage.nbytes(), ref)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        return out


def _config(data: str, run_dir: str, model: dict, parallel: dict, micro: int, batch: int):
    cfg = load_toml(ROOT / "configs" / "demo.toml")
    return apply_updates(
        cfg,
        {
            "model": {"num_layers": 4, "num_heads": 4, "dropout": 0.0, **model},
            "data": {"path": data},
            "parallel": parallel,
            "train": {
                "micro_batch_size": micro, "global_batch_size": batch, "progress": False,
                "device": "cpu", "precision": "fp32", "run_dir": run_dir, "log_interval": 1000,
            },
        },
        "benchmark",
    )  # fmt: skip


def worker(rank: int, world: int, data: str, root: str, names: list[str]) -> list[dict]:
    """Each case on `world` ranks: every rank's measured step peak against its count (MiB)."""
    rows = []
    for name in names:
        _, model, parallel, micro, batch = CASES[name]
        env = LaunchEnv(rank, world, rank)
        run_dir = f"{root}/{name.replace(' ', '-')}"
        cfg, layout, run_data = prepare(_config(data, run_dir, model, parallel, micro, batch), env)
        trainer = Trainer(cfg, layout, env, run_data)
        for _ in range(2):
            trainer.train_step()
        with LiveBytes() as meter:
            trainer.train_step()
        assert world == layout.pp, "one rank per pipeline stage: global rank = pp rank"
        est = estimate_memory(cfg, world, layout=layout, gloo_sends=True)[rank]
        mine = torch.tensor(
            [meter.peak, est.activations + est.working + est.stash], dtype=torch.float64
        )
        every = [torch.zeros_like(mine) for _ in range(world)] if world > 1 else [mine]
        if world > 1:
            dist.all_gather(every, mine)
        rows.append(
            {
                "case": name,
                "world": world,
                "ranks": [
                    {"pp_rank": r, "measured_mib": m / MIB, "predicted_mib": p / MIB}
                    for r, (m, p) in enumerate(t.tolist() for t in every)
                ],
            }
        )
    return rows


def run(names: list[str], root: str) -> list[dict]:
    """Measure `names` (grouped by world size) with data under `root`."""
    data = repo_corpus(Path(root))
    rows = []
    for world in sorted({CASES[n][0] for n in names}):
        group = [n for n in names if CASES[n][0] == world]
        if world == 1:
            rows += worker(0, 1, data, root, group)
        else:
            rows += spawn(worker, world, data, root, group)
    return rows


def error(row: dict) -> float:
    """Worst relative error of a case's ranks: (predicted - measured) / measured."""
    return max((r["predicted_mib"] - r["measured_mib"]) / r["measured_mib"] for r in row["ranks"])


def table(rows: list[dict]) -> str:
    lines = [
        "| case | pp rank | measured MiB | predicted MiB | error |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        for r in row["ranks"]:
            err = (r["predicted_mib"] - r["measured_mib"]) / r["measured_mib"]
            lines.append(
                f"| {row['case']} | {r['pp_rank']} | {r['measured_mib']:.2f} | "
                f"{r['predicted_mib']:.2f} | {err:+.1%} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    torch.set_num_threads(1)  # as each spawned rank runs
    with tempfile.TemporaryDirectory() as root:
        rows = run(names, root)
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
