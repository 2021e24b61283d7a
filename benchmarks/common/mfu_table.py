"""benchmarks/speed/mfu.py's printed table and the ratios under it (rows as mfu.py records
them: one per model, implementation and precision; a failed row carries `error` in place of
figures). scripts/gpu_check_report.py writes the same ratios into its report."""

from __future__ import annotations


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'model':>6} | {'impl':>13} | {'precision':>14} | {'params':>8} | {'l/h/n/s':>17} | "
        f"{'mbs':>3} | {'tokens/s':>10} | {'TFLOP/s':>7} | {'MFU':>6} | {'peak GiB':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        shape = f"{r['layers']}/{r['hidden']}/{r['heads']}/{r['seq']}"
        left = f"{r['model']:>6} | {r['impl']:>13} | {r.get('precision', ''):>14} | "
        if "error" in r:
            lines.append(f"{left}{'':>8} | {shape:>17} | failed: {r['error']}")
            continue
        mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] is not None else "   n/a"
        lines.append(
            f"{left}{r['params'] / 1e6:7.1f}M | {shape:>17} | "
            f"{r['micro_batch']:>3} | {r['tokens_per_s']:>10,.0f} | {r['tflops']:>7.3g} | "
            f"{mfu} | {r['peak_gib']:>8.2f}"
        )
    return "\n".join(lines)


def ratios(rows: list[dict]) -> list[str]:
    """ptdp / peer tokens/s per model and precision, flagged where an out-of-memory retry
    left the two at different micro-batches (then the ratio compares unequal batches); and
    ptdp's fp8 rows against its own first (bf16) row of the model. Failed rows are left out
    (the table names why)."""
    done = [r for r in rows if "error" not in r]
    ours = {(r["model"], r.get("precision")): r for r in done if r["impl"] == "ptdp"}
    first = {}
    for r in done:
        if r["impl"] == "ptdp":
            first.setdefault(r["model"], r)
    lines = []
    for r in done:
        key = (r["model"], r.get("precision"))
        if r["impl"] == "ptdp":
            base = first[r["model"]]
            if base is not r:
                lines.append(
                    f"{r['model']}: ptdp {r['precision']} / {base['precision']} tokens/s = "
                    f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}"
                )
            continue
        if key not in ours:
            continue
        mine = ours[key]
        fp8 = f" {key[1]}" if key[1] and key[1].startswith("fp8") else ""
        line = f"{r['model']}{fp8}: ptdp / {r['impl']} tokens/s = "
        line += f"{mine['tokens_per_s'] / r['tokens_per_s']:.3f}"
        if mine["micro_batch"] != r["micro_batch"]:
            line += (
                f" (micro-batch {mine['micro_batch']} against {r['micro_batch']}: "
                "not the same batch; pass --micro-batch-size to compare like with like)"
            )
        lines.append(line)
    return lines


def against_prediction(rows: list[dict]) -> list[str]:
    """Measured against the performance model, for each ptdp row that has a prediction."""
    lines = []
    for r in rows:
        if p := r.get("predicted"):
            lines.append(
                f"{r['model']}: measured / predicted on {p['system']} tokens/s = "
                f"{r['tokens_per_s'] / p['tokens_per_s']:.3f} (predicted "
                f"{p['tokens_per_s']:,.0f} tokens/s, MFU {100 * p['mfu']:.1f}%)"
            )
            if "allocator_gib" in r:
                held = r["allocator_gib"] + r["context_gib"]
                lines.append(
                    f"{r['model']}: memory GiB: peak allocated {r['peak_gib']:.2f} against the "
                    f"model's count {p['memory_gib']:.2f}; held beside it {held:.2f} (allocator "
                    f"{r['allocator_gib']:.2f}, context and libraries {r['context_gib']:.2f}) "
                    f"against the reserve {p['reserve_gib']:.2f}; the model: "
                    f"{'fits' if p['fits'] else 'does not fit'}"
                )
    return lines
