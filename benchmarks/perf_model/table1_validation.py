"""The performance model against the paper's Table 1 and the Megatron-LM README's GPT-3 run.

For every row of Table 1 (Narayanan et al., SC21) the planner takes the paper's model, GPU
count, t, p and batch, chooses the micro-batch (equation (1)) and the interleaving v (by
simulation) under the paper's software and settings (DGX A100 80GB cluster, Megatron-LM
2021 kernels, full recomputation), and the simulator predicts TFLOP/s per GPU against
the published figure; then every row as the authors' script ran it (its b, v and DDP), and
again at micro-batch 1 (the planner's v). Then the README's GPT-3 175B
run (1024 GPUs, batch 1536, b = 1, no interleaving), and, with --free, the planner choosing
t and p itself for each row.
Last, the memory model against single-process CPU runs of a small GPT-2 and Llama-style
model (fp32, each recompute mode, 1F1B and GPipe orders).

    python benchmarks/perf_model/table1_validation.py          # about 25 s
    python benchmarks/perf_model/table1_validation.py --free   # and unconstrained plans, ~2 min
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ptdp.config.enums import Recompute
from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.perf.cost.flops import paper_equation_3
from ptdp.perf.cost.hardware import GIB
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.memory import estimate_memory
from ptdp.perf.cost.software import MEGATRON_2021
from ptdp.perf.plan.planner import plan
from ptdp.perf.simulate.plot import plot_timelines
from ptdp.perf.validate.paper import AUTHORS_SCRIPT, README_GPT3, TABLE_1, paper_run
from ptdp.perf.validate.validation import (
    check_row,
    check_script_row,
    measure_cpu_memory,
    readme_gpt3,
)

ROOT = Path(__file__).resolve().parents[2]
PNG = ROOT / "runs" / "benchmarks" / "gpt3_175b_simulated_timeline.png"  # untracked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--free", action="store_true", help="also plan t and p freely")
    parser.add_argument(
        "--png", type=Path, default=PNG,
        help="timeline image (benchmarks/results/... updates the one BENCHMARKS.md shows)",
    )  # fmt: skip
    args = parser.parse_args()
    system = load_system("a100-80gb")
    start = time.perf_counter()
    print(
        "| model | GPUs | t | p | B | b | v | published TFLOP/s | predicted | error | "
        "bubble | s/iteration | GiB/GPU |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    errors = []
    for row in TABLE_1:
        check = check_row(row, system)
        p, cfg = check.option.prediction, check.option.config
        errors.append(check.error)
        print(
            f"| {row.params_billion}B | {row.gpus} | {row.tp} | {row.pp} | {row.batch} | "
            f"{cfg.train.micro_batch_size} | {p.layout.vpp} | {row.tflops:.0f} | "
            f"{check.predicted:.1f} | {100 * check.error:+.1f}% | {p.bubble_fraction:.3f} | "
            f"{p.iteration_seconds:.1f} | {p.peak_memory / GIB:.1f} |"
        )
    worst = max(errors, key=abs)
    print(
        f"\nmean |error| {100 * sum(map(abs, errors)) / len(errors):.1f}%, "
        f"worst {100 * worst:+.1f}%"
    )
    at_script(system)
    at_b1(system)

    script = readme_gpt3(system)
    planned = check_row(README_GPT3, system)
    flops = paper_equation_3(1536, 2048, 96, 12288, 51200)
    print("\nGPT-3 175B, 1024 GPUs, batch 1536, t = 8, p = 16 (README: ~32 s, ~138 TFLOP/s):")
    for name, p, b in [
        ("script settings (b = 1, no interleaving)", script, 1),
        (
            "planner's b and v",
            planned.option.prediction,
            planned.option.config.train.micro_batch_size,
        ),
    ]:
        print(
            f"  {name}: b={b} v={p.layout.vpp}: {p.iteration_seconds:.1f} s per iteration, "
            f"{flops / p.iteration_seconds / 1024 / 1e12:.1f} TFLOP/s per GPU "
            f"({100 * (p.tflops_per_device / 138 - 1):+.1f}%), bubble {p.bubble_fraction:.3f}"
        )
    events = [e for e in script.events if e.end < 0.2 * script.iteration_seconds]
    plot_timelines(
        args.png,
        {"simulated, first 20% of the step (warm-up and steady state)": events},
        title="GPT-3 175B on 1024 A100s, 1F1B, b=1 (t=8, p=16, d=8)",
    )
    print(f"  timeline: {args.png}")

    if args.free:
        print("\nplanner free to choose t and p (full recomputation, no sequence parallelism):")
        print("| model | GPUs | B | paper t, p | chosen t, p, v, b | predicted TFLOP/s |")
        print("|---|---:|---:|---|---|---:|")
        for row in TABLE_1:
            result = plan(
                paper_run(row, micro_batch=1, vpp=1),
                gpus=row.gpus,
                system=system,
                software=MEGATRON_2021,
                recompute=Recompute.FULL,
                sequence_parallel=False,
            )
            lay, b = result.best.prediction.layout, result.best.config.train.micro_batch_size
            print(
                f"| {row.params_billion}B | {row.gpus} | {row.batch} | {row.tp}, {row.pp} | "
                f"{lay.tp}, {lay.pp}, {lay.vpp}, {b} | "
                f"{result.best.prediction.tflops_per_device:.1f} |"
            )
    memory_table()
    print(f"\n({time.perf_counter() - start:.0f} s)")


def at_script(system) -> None:  # noqa: ANN001 - a script
    """Every row with the b, v and DDP of the authors' script, nothing searched."""
    print(f"\nas the authors' script ran each row, {AUTHORS_SCRIPT}:")
    print("| model | t | p | b | v | DDP | published TFLOP/s | predicted | error |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    errors = []
    for row in TABLE_1:
        predicted = check_script_row(row, system).tflops_per_device
        errors.append(predicted / row.tflops - 1)
        print(
            f"| {row.params_billion}B | {row.tp} | {row.pp} | {row.script_micro_batch} | "
            f"{row.script_vpp} | {'torch' if row.torch_ddp else 'local'} | {row.tflops:.0f} | "
            f"{predicted:.1f} | {100 * errors[-1]:+.1f}% |"
        )
    print(
        f"mean |error| {100 * sum(map(abs, errors)) / len(errors):.1f}%, "
        f"worst {100 * max(errors, key=abs):+.1f}%"
    )


def at_b1(system) -> None:  # noqa: ANN001 - a script
    """Every row at micro-batch 1 (the planner's v): where per-microbatch costs weigh most."""
    print("\nat b = 1 (the paper gives no b; v by the planner):")
    print("| model | t | p | v | published TFLOP/s | predicted | error |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    errors = []
    for row in TABLE_1:
        check = check_row(row, system, micro_batch=1)
        errors.append(check.error)
        print(
            f"| {row.params_billion}B | {row.tp} | {row.pp} | "
            f"{check.option.prediction.layout.vpp} | {row.tflops:.0f} | "
            f"{check.predicted:.1f} | {100 * check.error:+.1f}% |"
        )
    print(f"worst {100 * max(errors, key=abs):+.1f}%")


LLAMA = {
    "position_embedding": "rope",
    "normalization": "rmsnorm",
    "activation": "swiglu",
    "num_query_groups": 2,
    "tie_embeddings": False,
    "bias": False,
}


def memory_table() -> None:
    """Estimated against measured bytes, 2 layers, h = 64, s = 32, b = 4, fp32, on CPU."""
    print("\nmemory model against CPU runs (2 layers, h 64, s 32, b 4, fp32; KB):")
    print("| model | recompute | order | m | state est/meas | activations est | measured | error |")
    print("|---|---|---|---:|---|---:|---:|---:|")
    for family, options in (("GPT-2", {}), ("Llama", LLAMA)):
        for recompute in ("none", "selective", "full"):
            for schedule, m in (("1f1b", 2), ("gpipe", 3)):
                model = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": 32}
                cfg = apply_updates(
                    RunConfig(),
                    {
                        "model": {**model, "vocab_size": 64, **options},
                        "parallel": {"recompute": recompute, "schedule": schedule},
                        "train": {
                            "micro_batch_size": 4,
                            "global_batch_size": 4 * m,
                            "precision": "fp32",
                        },
                    },
                    "benchmark",
                )
                state, acts = measure_cpu_memory(cfg, schedule, m)
                est = estimate_memory(cfg, 1)[0]
                est_state = est.params + est.grads + est.optimizer
                print(
                    f"| {family} | {recompute} | {schedule} | {m} | {est_state / 1e3:.0f}/"
                    f"{state / 1e3:.0f} | {est.activations / 1e3:.0f} | {acts / 1e3:.0f} | "
                    f"{100 * (est.activations / acts - 1):+.1f}% |"
                )


if __name__ == "__main__":
    main()
