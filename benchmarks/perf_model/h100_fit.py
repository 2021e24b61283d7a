"""Fits the H100 file's GEMM curve to Megatron-Core's published H100 weak-scaling table.

Three constants for all nine rows (`ptdp.perf.validate.ground`: the GEMM law's e_max and F_half,
the fused attention's efficiency) by a pattern search on the RMS relative error of the
predicted model TFLOP/s per GPU; then, with the fitted constants, each row's error and the
interleaving its layout would pick. Prints the `[device.achieved]` lines for
`ptdp/perf/cost/hardware/h100-sxm.toml` and `h200.toml`, and a markdown table for BENCHMARKS.md;
writes no tracked file (`--json PATH` records the result).

    python benchmarks/perf_model/h100_fit.py           # about 10 min on the 2-core VM
    python benchmarks/perf_model/h100_fit.py --check   # the shipped file's errors only, ~15 s
    python benchmarks/perf_model/h100_fit.py --check --device calibration.toml   # another file's
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.validate.ground import GemmLaw, fit_gemm_law
from ptdp.perf.validate.published import MCORE_H100_WEAK_SCALING, SOURCE, predict_row


def _best_vpp(row, system) -> int:  # noqa: ANN001 - a script
    per = row.layers // row.pp
    options = [v for v in range(1, per + 1) if per % v == 0] if row.pp > 1 else [1]
    m = row.batch // row.dp
    options = [v for v in options if v == 1 or m % row.pp == 0]
    return max(options, key=lambda v: predict_row(row, system, v).model_tflops_per_device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="a file's errors only, no fit")
    parser.add_argument(
        "--device",
        default="h100-sxm",
        help="with --check: the cluster file to check (a built-in name or a TOML path, e.g. "
        "one `ptdp calibrate` wrote on an H100)",
    )
    parser.add_argument("--json", type=Path, help="write the fit and errors here")
    args = parser.parse_args()
    rows = MCORE_H100_WEAK_SCALING
    base = load_system(args.device if args.check else "h100-sxm")
    start = time.perf_counter()
    if args.check:
        dev = base.device
        law = GemmLaw(dev.gemm_efficiency, 0.0, dev.attention_efficiency)
        fitted, errors = base, row_errors_shipped(rows, base)
    else:
        fit = fit_gemm_law(rows, base, progress=lambda law, v: print(f"  {law} rms {v:.4f}"))
        law, errors, fitted = fit.law, fit.errors, fit.law.apply(base)
        print(f"fit: {law}, rms {fit.rms:.4f}, {fit.evaluations} evaluations")
        print("[device.achieved] lines:")
        print(f"gemm_efficiency = {law.e_max}")
        print(f"attention_efficiency = {law.attention}")
        print(f"gemm_curve_flops = [{', '.join(f'{x:.3g}' for x, _ in law.knots())}]")
        print(f"gemm_curve_efficiency = [{', '.join(f'{y}' for _, y in law.knots())}]")
    print(f"\nsource: {SOURCE}\n")
    print("| model | GPUs | t | p | B | v | published TFLOP/s | predicted | error | v fastest |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    out = []
    for row, error in zip(rows, errors):
        predicted = row.tflops * (1 + error)
        best = _best_vpp(row, fitted)
        print(
            f"| {row.name} | {row.gpus} | {row.tp} | {row.pp} | {row.batch} | {row.vpp} | "
            f"{row.tflops} | {predicted:.1f} | {error * 100:+.1f}% | {best} |"
        )
        out.append({"row": row.name, "published": row.tflops, "predicted": predicted})
    print(f"\n{time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"law": str(law), "rows": out}, indent=1))


def row_errors_shipped(rows, system) -> tuple[float, ...]:  # noqa: ANN001 - a script
    """Errors of the file as shipped (its knots, not a law)."""
    return tuple(predict_row(r, system).model_tflops_per_device / r.tflops - 1 for r in rows)


if __name__ == "__main__":
    main()
