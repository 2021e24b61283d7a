"""The performance model against the paper's Table 2 (section 5.2): PTD-P against ZeRO-3.

Each row as `ptdp.perf.validate.validation.check_table_2_row` predicts it on the paper's cluster
(a100-80gb): ZeRO-3 without model parallelism under `--software deepspeed-2021`, PTD-P at
t = 8 with the interleaving v the planner picks under `megatron-2021`, both with full
recomputation. Prints the markdown table of BENCHMARKS.md.

    python benchmarks/perf_model/table2_validation.py    # a few minutes (the PTD-P plans)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ptdp.perf.cost.hardware import GIB
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.validate.paper import TABLE_2
from ptdp.perf.validate.validation import check_table_2_row

TOKENS = 300e9
"""The paper's training-time column: days for 300B tokens."""


def main() -> None:
    start, system = time.perf_counter(), load_system("a100-80gb")
    print(
        "| scheme | model | GPUs | B | b | v | paper TFLOP/s | predicted | error | paper days "
        "| predicted days | s/step | GiB/GPU |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in TABLE_2:
        p = check_table_2_row(row, system)
        error = 100 * (p.tflops_per_device / row.tflops - 1)
        days = TOKENS / p.tokens_per_second / 86400
        print(
            f"| {row.scheme} | {row.model} | {row.gpus} | {row.batch} | {row.micro_batch} | "
            f"{p.layout.vpp} | {row.tflops} | {p.tflops_per_device:.1f} | {error:+.1f}% | "
            f"{row.days} | {days:.0f} | {p.iteration_seconds:.1f} | {p.peak_memory / GIB:.1f} |",
            flush=True,
        )
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
