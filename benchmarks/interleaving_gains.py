"""Interleaving's and scatter/gather's gains on the paper's Figure 12 / 18 setting.

GPT-3 175B on 96 A100s (a100-80gb), t = 8, p = 12, b = 1, full recomputation, Megatron-LM
2021's software (`--software megatron-2021`), global batch 12 to 60: TFLOP/s per GPU
(equation (3)'s FLOPs) of 1F1B and of the interleaved schedule with and without
scatter/gather, for each v given (the paper does not state its v). Prints a markdown table.

    python benchmarks/interleaving_gains.py            # v = 2 and 4, about 10 s
    python benchmarks/interleaving_gains.py --vpp 2 4 8
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from ptdp.config import RunConfig, apply_updates
from ptdp.perf.costs import MEGATRON_2021
from ptdp.perf.hardware import load_system
from ptdp.perf.paper import preset
from ptdp.perf.simulator import simulate

SYSTEM = load_system("a100-80gb")


def tflops(batch: int, vpp: int, scatter_gather: bool) -> float:
    """Predicted TFLOP/s per GPU of one setting of the figures."""
    parallel = {
        "tp": 8,
        "pp": 12,
        "vpp": vpp,
        "schedule": "interleaved" if vpp > 1 else "1f1b",
        "recompute": "full",
        "sequence_parallel": False,
        "scatter_gather": scatter_gather,
        "overlap_grad_reduce": False,
    }
    train = {"precision": "bf16", "micro_batch_size": 1, "global_batch_size": batch}
    cfg = replace(RunConfig(), model=preset("gpt3-175b"))
    cfg = apply_updates(cfg, {"parallel": parallel, "train": train}, "Figure 12 / 18")
    return simulate(cfg, SYSTEM, 96, software=MEGATRON_2021, timeline=False).tflops_per_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vpp", type=int, nargs="+", default=[2, 4], help="chunks per rank")
    args = parser.parse_args()
    print("| B | v | 1F1B | interleaved, s/g | without s/g | interleaving gain | s/g gain |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch in (12, 24, 36, 48, 60):
        base = tflops(batch, 1, True)
        for v in args.vpp:
            on, off = tflops(batch, v, True), tflops(batch, v, False)
            print(
                f"| {batch} | {v} | {base:.1f} | {on:.1f} | {off:.1f} | "
                f"{100 * (on / base - 1):+.1f}% | {100 * (on / off - 1):+.1f}% |",
                flush=True,
            )


if __name__ == "__main__":
    main()
