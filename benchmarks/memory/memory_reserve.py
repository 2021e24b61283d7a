"""The memory reserve per rank: the old fixed figure against `ptdp.perf.cost.reserve`'s formula.

For the paper's Table 1 rows (b = 1, v = 1 as the paper ran them), GPT-3 175B at 384 and
1024 GPUs, a one-GPU run, a 4D layout with context parallelism and two Llama 3 layouts
(s = 8192, vocabulary 128,256) on H100s, print each term of the
formula at the rank nearest its limit, the old fixed reserve (4 GiB on the 80 GB GPUs),
and whether the fit decision (model count + reserve <= device memory) changes, at b = 1 and
for the largest micro-batch (1-16) the planner could pick. Nothing is
measured (no GPU here) and no tracked file is written:

    python benchmarks/memory/memory_reserve.py
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.perf.cost.hardware import GIB, System
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.memory import estimate_memory
from ptdp.perf.cost.reserve import communicators, rank_reserve
from ptdp.perf.validate.paper import README_GPT3, TABLE_1, model_config, paper_run
from ptdp.rules.layout import validate

OLD_GIB = 4.0
"""What a100-80gb, h100-sxm and h200 fixed before (a100-40gb: 3)."""


def _gpt(layers: int, hidden: int, heads: int, seq: int, **parallel: object) -> RunConfig:
    sections = {
        "model": {
            "num_layers": layers,
            "hidden_size": hidden,
            "num_heads": heads,
            "vocab_size": 50304,
        },
        "parallel": parallel,
        "train": {"precision": "bf16", "micro_batch_size": 1, "global_batch_size": 64},
    }
    sections["model"]["seq_length"] = seq
    return apply_updates(RunConfig(), sections, "memory_reserve")


def cases() -> list[tuple[str, RunConfig, int, str]]:
    """(name, config, GPUs, system)."""
    out = [
        (f"{r.name} t={r.tp} p={r.pp}", paper_run(r, micro_batch=1, vpp=1), r.gpus, "a100-80gb")
        for r in TABLE_1
    ]
    gpt3 = paper_run(README_GPT3, micro_batch=1, vpp=1)
    out.append(("gpt3-175b t=8 p=16 (1024)", gpt3, 1024, "a100-80gb"))
    out.append(("gpt3-175b t=8 p=16 (384)", gpt3, 384, "a100-80gb"))
    one = _gpt(24, 2048, 16, 4096)
    out.append(("1.3B one GPU, s=4096", one, 1, "h100-sxm"))
    four = _gpt(
        32, 4096, 32, 16384, tp=8, cp=2, pp=4, recompute="selective", sequence_parallel=True
    )
    out.append(("7B 4D t=8 cp=2 p=4 d=2, s=16k", four, 128, "h100-sxm"))
    for name, gpus, parallel in (
        ("llama3-8b", 64, {"tp": 1, "pp": 8, "recompute": "full"}),
        ("llama3-70b", 512, {"tp": 8, "pp": 8, "recompute": "selective"}),
    ):
        train = {"precision": "bf16", "micro_batch_size": 1, "global_batch_size": 512}
        sections = {
            "parallel": {**parallel, "sequence_parallel": parallel["tp"] > 1},
            "train": train,
        }
        cfg = apply_updates(model_config(name), sections, "memory_reserve")
        what = f"t={parallel['tp']} p={parallel['pp']} {parallel['recompute']}"
        out.append((f"{name} {what} ({gpus})", cfg, gpus, "h100-sxm"))
    return out


def fits(cfg: RunConfig, gpus: int, system: System) -> tuple[bool, bool]:
    """(fits under the old fixed reserve, fits under the formula)."""
    layout = validate(cfg, gpus)
    memory = estimate_memory(cfg, gpus, layout=layout)
    new = max(m.total + rank_reserve(cfg, layout, system, m).total for m in memory)
    cap = system.device.memory_bytes
    return max(m.total for m in memory) <= cap - OLD_GIB * GIB, new <= cap


def largest_b(cfg: RunConfig, gpus: int, system: System) -> tuple[int, int]:
    """The largest micro-batch (1, 2, 4, ... 16) that fits, old and new (0: none)."""
    out = [0, 0]
    layout = validate(cfg, gpus)
    per_rank = cfg.train.global_batch_size // layout.dp
    for b in (1, 2, 4, 8, 16):
        if per_rank % b:
            break
        train = replace(cfg.train, micro_batch_size=b)
        for i, ok in enumerate(fits(replace(cfg, train=train), gpus, system)):
            out[i] = b if ok else out[i]
    return out[0], out[1]


def row(name: str, cfg: RunConfig, gpus: int, system: System) -> str:
    layout = validate(cfg, gpus)
    memory = estimate_memory(cfg, gpus, layout=layout)
    reserves = [rank_reserve(cfg, layout, system, m) for m in memory]
    worst = max(range(len(memory)), key=lambda i: memory[i].total + reserves[i].total)
    m, r = memory[worst], reserves[worst]
    fit_old, fit_new = fits(cfg, gpus, system)
    b_old, b_new = largest_b(cfg, gpus, system)
    comms = len(communicators(cfg, layout, worst * layout.tp * layout.cp * layout.dp))
    change = "" if (fit_old, b_old) == (fit_new, b_new) else " **changes**"
    return (
        f"| {name} | {system.name} | {worst} | {comms} | {m.total / GIB:.1f} | "
        f"{r.context / GIB:.2f} | {r.nccl / GIB:.2f} | {r.allocator / GIB:.2f} | "
        f"{r.total / GIB:.2f} | {OLD_GIB:.0f} | {'yes' if fit_old else 'no'} -> "
        f"{'yes' if fit_new else 'no'} | {b_old} -> {b_new}{change} |"
    )


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    print(
        "| layout | system | pp rank | communicators | model count GiB | context | NCCL | "
        "allocator | reserve GiB | old GiB | fits at b=1 (old -> new) | largest b (old -> new) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, cfg, gpus, system in cases():
        print(row(name, cfg, gpus, load_system(system)))


if __name__ == "__main__":
    main()
