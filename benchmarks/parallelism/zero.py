"""ZeRO levels on CPU ranks (gloo): model-state bytes per rank, measured against the memory
model; bytes the data-parallel collectives move per step, counted against the ZeRO paper's
formulas; step time and the exposed part of ZeRO-3's parameter gathers; at parallel.zero =
0, 1, 2, 3.

The demo model's shape (6 layers, h = 256, s = 256; `--hidden-size` for a wider one) on a
byte-level corpus made from this repository's own text (no download), dp ranks one thread
each. Per level, after a warm-up step: the bytes of parameters (the persistent buffer: 1/dp
at zero 3), gradients and optimizer state one rank holds, the most full-size bucket gradient
(ZeRO-2/3) and gathered parameters (ZeRO-3) held at once, each against
`ptdp.perf.cost.memory.estimate_memory`; the elements the data-parallel collectives moved per step
(`GradBuffers.traffic`: an all-gather or reduce-scatter of n elements counts n, an
all-reduce 2n) in units of the rank's parameter count Psi, against the paper's 2 Psi (zero
0, 1, 2) and 3 Psi (zero 3) at one microbatch per step (Rajbhandari et al. 2020, Sec. 7:
more microbatches repeat ZeRO-2's reduce-scatter and ZeRO-3's gathers); the median step
time, tokens/s, and for ZeRO-3 the seconds blocked on gathers per step with prefetch
(exposed) and without it (every gather waited for: their whole time). With `--precision
fp8` (torchao; emulated float8 GEMMs on a CPU) a last row runs ZeRO-3 with
parallel.zero3_fp8_all_gather: the linear layers' weights gathered as float8 bytes. Rows go
to runs/benchmarks/zero.json (`--out`); a run rewrites no tracked file.

    python benchmarks/parallelism/zero.py [--dp 2 --steps 4 --microbatches 1 --precision fp32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

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


def _config(args: argparse.Namespace, data: str, run_dir: str, zero: int, world: int, fp8ag: bool):
    cfg = load_toml(ROOT / "configs" / "demo.toml")
    return apply_updates(
        cfg,
        {
            "model": {"hidden_size": args.hidden_size},
            "data": {"path": data},
            "parallel": {
                "zero": zero, "bucket_mb": args.bucket_mb, "zero3_fp8_all_gather": fp8ag,
            },
            "train": {
                "micro_batch_size": 4, "global_batch_size": 4 * args.microbatches * world,
                "progress": False, "device": "cpu", "precision": args.precision,
                "run_dir": run_dir,
            },
        },
        "benchmark",
    )  # fmt: skip


def _measure(args: argparse.Namespace, trainer: Trainer, world: int) -> dict:
    """Time the steps; the traffic and gather waits they caused, per step."""
    grads, gather = trainer.grads, trainer.grads.gather
    trainer.train_step()  # warm-up; AdamW allocates its moments
    before = {k: list(v) for k, v in grads.traffic.items()}
    launches, waited, times = grads.launches, gather.wait_s if gather else 0.0, []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    moved = {
        k: [(v[i] - before.get(k, [0, 0])[i]) / args.steps for i in (0, 1)]
        for k, v in grads.traffic.items()
    }
    ms = 1e3 * statistics.median(times)
    return {
        "ms": ms,
        "tokens_per_s": trainer.tokens_per_step / ms * 1e3,
        "reductions": (grads.launches - launches) / args.steps,
        "traffic": moved,
        "gather_wait_s": ((gather.wait_s - waited) / args.steps) if gather else 0.0,
    }


def worker(rank: int, world: int, args: argparse.Namespace, data: str, run_dir: str) -> list:
    env, rows = LaunchEnv(rank, world, rank), []
    levels = [(0, True, False), (1, True, False), (2, True, False), (3, True, False)]
    levels += [(3, False, False)] + [(3, True, True)] * (args.precision == "fp8")
    for zero, prefetch, fp8ag in levels:
        name = f"zero{zero}" + ("" if prefetch else "-noprefetch") + ("-fp8ag" * fp8ag)
        cfg = _config(args, data, f"{run_dir}/{name}", zero, world, fp8ag)
        cfg, layout, run_data = prepare(cfg, env)
        trainer = Trainer(cfg, layout, env, run_data)
        grads = trainer.grads
        if grads.gather:
            grads.gather.prefetch = prefetch
        row = _measure(args, trainer, world)
        (est,) = estimate_memory(cfg, world, layout=layout)
        psi = trainer.parameter_count(full=False)
        row |= {
            "zero": zero,
            "prefetch": prefetch,
            "fp8_all_gather": fp8ag,
            "psi": psi,
            "params": grads.param_bytes(),
            "grads": grads.grad_bytes(),
            "optimizer": trainer.optimizer.state_bytes(),
            "peak_full": grads.peak_full_bytes,
            "peak_gathered": grads.gather.peak_bytes if grads.gather else 0,
            "model": [est.params, est.grads, est.optimizer, est.grad_buckets],
            "model_gathered": est.gathered,
            "microbatches": layout.num_microbatches,
        }
        rows.append(row)
        if trainer.watchdog:
            trainer.watchdog.close()
        if trainer.owns_process_group:
            dist.destroy_process_group()
    return rows


def paper_psi(zero: int, m: int) -> int:
    """The ZeRO paper's data-parallel traffic per step in units of Psi, at m microbatches:
    2 (all-reduce, or reduce-scatter + all-gather), ZeRO-2's reduce-scatter per microbatch,
    ZeRO-3's two gathers and one reduce-scatter per microbatch."""
    return {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[zero]


def _name(row: dict) -> str:
    """A row's level, and how it gathers."""
    name = f"{row['zero']}" + ("" if row["prefetch"] else " (no prefetch)")
    return name + (" (fp8 all-gather)" if row["fp8_all_gather"] else "")


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    m = rows[0]["microbatches"]
    print(
        f"dp={args.dp} {args.precision} h={args.hidden_size}, bucket {args.bucket_mb} MiB, "
        f"{m} microbatches per rank per step; MiB per rank (measured / model)"
    )
    print(
        "| zero | params | grads | optimizer | full buckets (peak) "
        "| gathered params (peak / model) | model state (peak) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if not r["prefetch"]:
            continue
        got = [r["params"], r["grads"], r["optimizer"], r["peak_full"]]
        cells = " | ".join(f"{g / MIB:.2f} / {e / MIB:.2f}" for g, e in zip(got, r["model"]))
        peak = (sum(got) + r["peak_gathered"]) / MIB
        gathered = f"{r['peak_gathered'] / MIB:.2f} / {r['model_gathered'] / MIB:.2f}"
        print(f"| {_name(r)} | {cells} | {gathered} | {peak:.2f} |")
    print(
        "\n| zero | all-reduce | reduce-scatter | all-gather | total (Psi) | paper (Psi) "
        "| MiB/step on the wire | ms/step | tokens/s | gather wait s/step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        t, psi = r["traffic"], r["psi"]
        kinds = [t.get(k, [0, 0]) for k in ("all_reduce", "reduce_scatter", "all_gather")]
        wire = sum(b for _, b in kinds) * (args.dp - 1) / args.dp / MIB
        units = [e / psi for e, _ in kinds]
        name = _name(r)
        cells = " | ".join(f"{u:.3f}" for u in units)
        print(
            f"| {name} | {cells} | {sum(units):.3f} | {paper_psi(r['zero'], m)} | {wire:.1f} "
            f"| {r['ms']:.0f} | {r['tokens_per_s']:.0f} | {r['gather_wait_s']:.3f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per level")
    parser.add_argument("--microbatches", type=int, default=1, help="per rank per step")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp8"), default="fp32")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "zero.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = repo_corpus(Path(tmp) / "data")
        rows = spawn(worker, args.dp, args, data, str(Path(tmp) / "runs"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    args.out.write_text(json.dumps(record, indent=1))
    report(args, rows)


if __name__ == "__main__":
    main()
