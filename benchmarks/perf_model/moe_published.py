"""ptdp's model against published mixture-of-experts runs (`ptdp.perf.validate.published_moe`).

Each row's layout and batch on its device file with the row's Megatron-Core (its dispatcher,
overlaps and recomputation), predicted tokens/s per GPU against the published figure, and
whether the model says it fits in 80 GB; the rows ptdp cannot express are listed with why.
Prints a markdown table for BENCHMARKS.md; writes no file.

    python benchmarks/perf_model/moe_published.py      # about 10 s
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ptdp.perf.validate.published_moe import MOE_RUNS, SOURCES, moe_error, predict_moe_run


def _layout(row) -> str:  # noqa: ANN001 - a script
    parts = [f"t{row.tp}", f"ep{row.ep}", f"etp{row.etp}", f"p{row.pp}", f"v{row.vpp}"]
    parts.append(f"d{row.dp}")
    return " ".join(parts)


def main() -> None:
    print(
        "| run | GPUs | layout | B, b | published tokens/s/GPU | predicted | error | fits 80 GB "
        "(peak GiB) | source |"
    )
    print("|---|---:|---|---|---:|---:|---:|---|---|")
    later = []
    for row in MOE_RUNS:
        if row.unexpressible:
            later.append(row)
            continue
        p = predict_moe_run(row)
        m = p.limiting
        peak = (m.total + m.reserved) / 2**30
        error = f"{100 * moe_error(row, p):+.1f}%" + (" *" if row.doubt else "")
        print(
            f"| {row.name} | {row.gpus} | {_layout(row)} | {row.global_batch}, "
            f"{row.micro_batch} | {row.tokens_per_gpu:.0f} | {p.tokens_per_second / row.gpus:.0f} "
            f"| {error} | {'yes' if p.fits else 'no'} ({peak:.1f}) | {row.source} |"
        )
    print("\n\\* not in the target: " + next(r.doubt for r in MOE_RUNS if r.doubt))
    print("\nNot modelled:")
    for row in later:
        print(
            f"- {row.name} ({row.gpus} GPUs, {row.tokens_per_gpu:.0f} tokens/s/GPU): "
            f"{row.unexpressible}"
        )
    print("\nSources:")
    for key, source in SOURCES.items():
        print(f"- {key}: {source}")


if __name__ == "__main__":
    main()
