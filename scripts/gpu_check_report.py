"""Helpers of scripts/gpu-check.sh: find the CUDA-only tests, write the results table.

    python scripts/gpu_check_report.py cuda-tests       # node ids, one a line
    python scripts/gpu_check_report.py peer-pins PINS   # of PINS, what to install here
    python scripts/gpu_check_report.py report DIR       # DIR/BENCHMARKS-snippet.md, printed

A test is CUDA-only when a `skipif` whose condition mentions cuda marks it: directly, through
a module-level name (`needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), ...)`),
or as the module's `pytestmark`. Found by reading the sources (ast), so nothing is imported.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PEERS = ("torchtitan", "megatron-core", "torchao")
"""Installed from the wheels at the fetched version whatever this machine has."""


def peer_pins(pins: list[str], peers: tuple[str, ...] = PEERS) -> list[str]:
    """Of scripts/fetch-peers.sh's `name==version` lines, those to install here: the peers,
    and each other package this Python does not have (its own versions are kept)."""
    chosen = []
    for pin in (line.strip() for line in pins):
        name = re.split(r"[=<>]", pin, maxsplit=1)[0]
        if not name:
            continue
        try:
            metadata.version(name)
            have = True
        except metadata.PackageNotFoundError:
            have = False
        if name in peers or not have:
            chosen.append(pin)
    return chosen


def _is_cuda_skip(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return "skipif" in text and "cuda" in text.lower()


def cuda_only_tests(root: Path = ROOT / "tests") -> list[str]:
    ids = []
    for path in sorted(root.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        marks = {
            t.id
            for node in tree.body
            if isinstance(node, ast.Assign) and _is_cuda_skip(node.value)
            for t in node.targets
            if isinstance(t, ast.Name)
        }
        whole = "pytestmark" in marks
        rel = path.relative_to(ROOT)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                decorated = any(
                    _is_cuda_skip(d) or ast.unparse(d) in marks for d in node.decorator_list
                )
                if whole or decorated:
                    ids.append(f"{rel}::{node.name}")
    return ids


def _calibration_rows(path: Path) -> list[str]:
    if not path.is_file():
        return ["| calibration | not run | |"]
    data = tomllib.loads(path.read_text())
    dev, ach = data["device"], data["device"]["achieved"]
    cal = data.get("calibration", {})
    gemm = cal.get("gemm", {})
    rows = [
        f"| device | {dev['name']} ({cal.get('sweep', '?')} sweep, {cal.get('date', '?')}) | |",
        f"| GEMM efficiency, smallest to largest | {ach['gemm_curve_efficiency'][0]:.2f} .. "
        f"{ach['gemm_efficiency']:.2f} | of the dense peak |",
        f"| best GEMM | {max(gemm.get('tflops', [0])):.4g} TFLOP/s | {len(gemm.get('tflops', []))} "
        "shapes of a transformer layer |",
        f"| fused attention forward | {ach['attention_efficiency']:.2f} of peak | backward / "
        f"forward {ach['attention_backward_ratio']:.2f} |",
        f"| memory-bound kernels | {dev['memory_bandwidth_gb_s'] * ach['memory_efficiency']:.4g}"
        " GB/s | "
        + ", ".join(f"{k} {v:.3g}" for k, v in cal.get("memory_gb_s", {}).items())
        + " |",
        f"| kernel launch | {ach['kernel_overhead_us']:.3g} us | |",
    ]
    return rows


def _mfu_rows(path: Path) -> list[str]:
    """benchmarks/speed/mfu.py's rows, one per model, implementation and precision; a row that
    could not run (a peer not installed, no such recipe) gives its error text instead."""
    if not path.is_file():
        return []
    rows = json.loads(path.read_text()).get("rows", [])
    lines = [
        "",
        f"| model ({path.name}) | impl | precision | micro-batch | tokens/s | TFLOP/s | MFU | "
        "peak GiB | predicted tokens/s | model's GiB | held beside the peak: allocator + context "
        "= measured (reserve) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        model = f"{r['model']} {r['arch']}" if r.get("arch") else r["model"]
        left = f"| {model} | {r['impl']} | {r.get('precision', '')} |"
        if "error" in r:
            error = r["error"].replace("|", "/").replace("\n", " ")
            lines.append(f"{left} failed: {error} | | | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
        pred = r.get("predicted") or {}
        predicted = f"{pred['tokens_per_s']:,.0f}" if pred else ""
        counted = f"{pred['memory_gib']:.1f}" if pred else ""
        held = ""
        if "allocator_gib" in r:  # CUDA: what the process holds beside its tensors' peak
            allocator, context = r["allocator_gib"], r["context_gib"]
            held = f"{allocator:.2f} + {context:.2f} = {allocator + context:.2f}"
            held += f" ({pred['reserve_gib']:.2f})" if "reserve_gib" in pred else ""
        lines.append(
            f"{left} {r['micro_batch']} | {r['tokens_per_s']:,.0f} | "
            f"{r['tflops']:.3g} | {mfu} | {r['peak_gib']:.1f} | {predicted} | {counted} | {held} |"
        )
    pairs = _ratios(rows)
    return lines + (["", *(f"- {line}" for line in pairs)] if pairs else [])


def _ratios(rows: list[dict]) -> list[str]:
    """benchmarks/speed/mfu.py's ptdp / peer (and ptdp fp8 / bf16) tokens/s lines."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.common.mfu_table import ratios

    return ratios(rows)


def _suite_rows(out: Path) -> list[str]:
    """`gpu-check.sh --suite`: the CPU test suite's counts under this machine's torch."""
    path = out / "suite.xml"
    if not path.is_file():
        return []
    torch = (out / "torch.txt").read_text().split() if (out / "torch.txt").is_file() else []
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    seconds = 0.0
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        seconds += float(suite.get("time", 0))
    failed = counts["failures"] + counts["errors"]
    passed = counts["tests"] - failed - counts["skipped"]
    version = f"torch {torch[0]}, Python {torch[1]}" if len(torch) >= 2 else "torch ?"
    return [
        "",
        "| test suite | passed | failed | skipped | seconds |",
        "|---|---|---|---|---|",
        f"| {version} | {passed} | {failed} | {counts['skipped']} | {seconds:.0f} |",
    ]


def _memory_rows(path: Path) -> list[str]:
    """benchmarks/memory/memory_phases.py's rows: measured GiB after each phase beside the count."""
    if not path.is_file():
        return []
    lines = [
        "",
        "| model (memory phases) | static: built + AdamW's moments (count) | a step adds "
        "(count: activations + working) | reserved at the peak | device used | out of memory |",
        "|---|---|---|---|---|---|",
    ]
    for r in json.loads(path.read_text()):
        count = r.get("model_count") or {}
        static = f"({count['static']:.2f})" if count else ""
        adds = f"({count['activations'] + count['working']:.2f})" if count else ""
        measured_static = measured_adds = reserved = used = ""
        if "steady" in r:
            s = r["steady"]
            measured_static = f"{s['before']:.2f} "
            measured_adds = f"{s['peak'] - s['before']:.2f} "
            reserved, used = f"{s['reserved']:.2f}", f"{r['used']:.2f} of {r['device']:.2f}"
        lines.append(
            f"| {r['model']} (b {r['micro_batch']}, recompute {r['recompute']}) | "
            f"{measured_static}{static} | {measured_adds}{adds} | {reserved} | {used} | "
            f"{r.get('out_of_memory', '')} |"
        )
    return lines


def _moe_rows(path: Path) -> list[str]:
    """benchmarks/speed/moe_gpu.py's rows: one MoE layer's grouped kernel against the loop over
    experts, and the MoE model's MFU beside the dense one of the same active size."""
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    rows = data.get("rows", [])
    layers = [r for r in rows if r["part"] == "layer"]
    models = [r for r in rows if r["part"] == "model"]
    return (_moe_layer_rows(layers, data.get("skipped", [])) if layers else []) + (
        _moe_model_rows(models) if models else []
    )


def _moe_layer_rows(rows: list[dict], skipped: list[dict]) -> list[str]:
    lines = [
        "",
        "| MoE layer (e x f, top-k; tokens) | scope | kernel | ms fwd+bwd | expert GEMM TFLOP/s "
        "| loop / grouped |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['loop_over_grouped']:.2f}" if r.get("loop_over_grouped") else ""
        lines.append(
            f"| {r['experts']} x {r['ffn']}, top-{r['top_k']}; {r['tokens']} | {r['scope']} | "
            f"{r['kernel']} | {r['ms']:.3g} | {r['expert_tflops']:.3g} | {ratio} |"
        )
    lines += [f"| {s['layer']} | | {s['kernel']} | skipped: {s['reason']} | | |" for s in skipped]
    return lines


def _moe_model_rows(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "| model, no compile (MoE against dense) | params total / active | micro-batch "
        "| tokens/s | TFLOP/s | MFU | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
        experts = f", {r['num_experts']} x {r['moe_ffn']} top-{r['top_k']}" if r["top_k"] else ""
        lines.append(
            f"| {r['model']} ({r['layers']} x {r['hidden']}{experts}) | "
            f"{r['total_params'] / 1e6:,.1f}M / {r['active_params'] / 1e6:,.1f}M | "
            f"{r['micro_batch']} | {r['tokens_per_s']:,.0f} | {r['tflops']:.3g} | {mfu} | "
            f"{r['peak_gib']:.1f} |"
        )
    return lines


def report(out: Path) -> str:
    status = {}
    if (out / "status.tsv").is_file():
        for line in (out / "status.tsv").read_text().splitlines():
            part, _, result = line.partition("\t")
            status[part] = result
    lines = [
        f"### GPU check ({out.name})",
        "",
        "| part | result | note |",
        "|---|---|---|",
        *(f"| {part} | {result} | |" for part, result in status.items()),
        *_calibration_rows(out / "calibration.toml"),
        *_mfu_rows(out / "mfu.json"),
        *_mfu_rows(out / "mfu-gpt.json"),
        *_suite_rows(out),
        *_memory_rows(out / "memory.json"),
        *_moe_rows(out / "moe.json"),
        "",
        f"Commands and logs: `{out}` (run by `bash scripts/gpu-check.sh`).",
    ]
    text = "\n".join(lines) + "\n"
    (out / "BENCHMARKS-snippet.md").write_text(text)
    return text


def main(argv: list[str]) -> int:
    if argv[:1] == ["cuda-tests"]:
        print("\n".join(cuda_only_tests()))
        return 0
    if argv[:1] == ["peer-pins"] and len(argv) == 2:
        print("\n".join(peer_pins(Path(argv[1]).read_text().splitlines())))
        return 0
    if argv[:1] == ["report"] and len(argv) == 2:
        print(report(Path(argv[1])), end="")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
