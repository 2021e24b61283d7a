"""One MoE layer's forward and backward: today's loop over experts against the grouped
GEMM in bf16 and the experts' GEMMs in float8 (tensorwise and rowwise). UNMEASURED: no GPU
has run this script yet; its figures are not in BENCHMARKS.md.

The layer is `ptdp.model.moe.MoE` (router, dispatch, experts, combine, the balancing loss),
built as benchmarks/speed/moe_gpu.py builds it (SwiGLU, no biases, N(0, 0.02) weights),
at the same two shapes: 64 experts of width 1,408, 8 per token (DeepSeek-MoE's fine-grained
experts), and 8 of width 4,096, 2 per token (Mixtral's layout at h = 2,048), 8,192 tokens.
Rows (`VARIANTS`), each forcing the kernel of every expert product for the layer's whole
forward and backward in this process only (the product code is not changed):

- `bf16 loop`: today's path on a CPU and where grouped_mm has no fused kernel, one GEMM
  per expert, the counts read back to the host (`GemmKernel.LOOP`);
- `bf16 grouped`: one grouped_mm kernel for all experts, no host sync (`GemmKernel.GROUPED`,
  what `choose_gemm` picks on sm90/sm100);
- `fp8 tensorwise loop`: each expert's three GEMMs by torchao's float8 casts and
  `torch._scaled_mm`, one per expert (`ptdp.parallel.fp8_grouped`: the grouped kernel
  takes no per-group tensorwise scale);
- `fp8 rowwise loop` and `fp8 rowwise grouped`: the rowwise recipe per expert, and with
  torchao's Triton casts and one `torch._scaled_grouped_mm` per GEMM (sm90 only).

Reported: median ms of `--reps` forward+backward passes after `--warmup`, each between
device synchronisations; the ratio of the `bf16 loop` row's time to each row's; and each
row's output and input gradient against the `bf16 loop` row's (max |difference| / max
|loop|). A row that cannot run here is printed as skipped, with why. On a CPU (`--device
cpu`, a smoke run of the code paths) a tiny layer runs the loops only (float8 by torchao's
emulation, the float8 values multiplied in float32): its times say nothing of a GPU's.

    python benchmarks/speed/moe_layer.py                        # an H100 / H200
    python benchmarks/speed/moe_layer.py --device cpu --reps 2 --warmup 1   # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import benchmarks.speed.moe_gpu as moe_gpu
from ptdp.config.enums import Fp8Recipe
from ptdp.model.moe import MoE, MoEState
from ptdp.model.parts import TPContext
from ptdp.parallel import fp8_grouped, wgrad
from ptdp.parallel.fp8_grouped import fp8_gemm_for_cuda
from ptdp.parallel.grouped import GemmKernel, gemm_for_cuda


@dataclass(frozen=True)
class Variant:
    name: str
    kernel: GemmKernel
    recipe: Fp8Recipe | None = None
    """None: the experts' GEMMs in bf16 (fp32 on a CPU)."""


VARIANTS = (
    Variant("bf16 loop", GemmKernel.LOOP),
    Variant("bf16 grouped", GemmKernel.GROUPED),
    Variant("fp8 tensorwise loop", GemmKernel.LOOP, Fp8Recipe.TENSORWISE),
    Variant("fp8 rowwise loop", GemmKernel.LOOP, Fp8Recipe.ROWWISE),
    Variant("fp8 rowwise grouped", GemmKernel.GROUPED, Fp8Recipe.ROWWISE),
)


@contextlib.contextmanager
def forced(variant: Variant) -> Iterator[None]:
    """Every expert product run inside uses `variant.kernel`: bf16 products through
    moe_gpu's `forced_kernel`, float8 ones by replacing `choose_fp8_gemm` where
    `grouped_linear` (forward) and `fp8_grouped_wgrad` (a deferred W) ask it."""
    if variant.recipe is None:
        with moe_gpu.forced_kernel(variant.kernel):
            yield
        return
    choose = lambda recipe, x, weight: variant.kernel  # noqa: E731
    with mock.patch.object(wgrad, "choose_fp8_gemm", choose):
        with mock.patch.object(fp8_grouped, "choose_fp8_gemm", choose):
            yield


def skip_reason(variant: Variant, device: torch.device, shape: moe_gpu.LayerShape) -> str:
    """Why `variant` does not run here ("" when it does)."""
    if variant.recipe is not None:
        try:
            import torchao  # noqa: F401
        except ImportError:
            return "torchao is not installed (pip install -e '.[fp8]')"
    if device.type != "cuda":
        if variant.kernel is GemmKernel.GROUPED:
            return "no CUDA: no fused grouped kernel on a CPU"
        return ""
    capability = torch.cuda.get_device_capability(device)
    if variant.recipe is not None and capability < (8, 9):
        return f"sm{capability[0]}{capability[1]} has no float8 tensor cores"
    if variant.kernel is GemmKernel.GROUPED:
        if variant.recipe is None:
            fits = gemm_for_cuda(torch.bfloat16, capability, (shape.hidden, shape.ffn))
            return "" if fits is GemmKernel.GROUPED else "no fused bf16 grouped_mm here"
        dims = (shape.hidden, shape.ffn)
        fits = fp8_gemm_for_cuda(variant.recipe, torch.bfloat16, capability, dims)
        return "" if fits is GemmKernel.GROUPED else "torchao's fp8 grouped GEMM needs sm90"
    return ""


def build(shape: moe_gpu.LayerShape, device: torch.device, dtype, recipe) -> MoE:
    """moe_gpu's layer of `shape`, its GEMMs in float8 by `recipe` (None: in `dtype`)."""
    fp8 = None
    if recipe is not None:
        from ptdp.parallel.fp8 import Fp8Gemms

        fp8 = Fp8Gemms.build(recipe)
    torch.manual_seed(0)
    with torch.device(device):
        block = MoE(moe_gpu.layer_config(shape), TPContext(fp8=fp8), layer=0, state=MoEState())
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block.to(device=device, dtype=dtype).train()


def rows_for(args, name: str) -> tuple[list[dict], list[dict]]:
    """(timed rows, skipped rows) of layer `name`, every variant."""
    shape, device = moe_gpu.LAYERS[name], torch.device(args.device)
    dtype = torch.bfloat16
    x, dy = moe_gpu.layer_inputs(shape, device, dtype)
    rows, skipped, reference = [], [], None
    for v in VARIANTS:
        if reason := skip_reason(v, device, shape):
            skipped.append({"layer": name, "variant": v.name, "reason": reason})
            continue
        block = build(shape, device, dtype, v.recipe)
        with forced(v):
            out = moe_gpu.run_pass(block, x, dy, v.kernel)
            ms = moe_gpu.median_ms(
                moe_gpu.passes(block, x, dy, "layer"), args.warmup, args.reps, device
            )
        reference = reference or (out, ms)
        diff = [
            ((g.float() - a.float()).abs().max() / a.float().abs().max()).item()
            for a, g in zip(reference[0], out)
        ]
        rows.append({
            "layer": name, "variant": v.name, "hidden": shape.hidden, "experts": shape.experts,
            "ffn": shape.ffn, "top_k": shape.top_k, "tokens": shape.tokens, "reps": args.reps,
            "ms": ms, "loop_over_this": reference[1] / ms, "diff_output": diff[0],
            "diff_input_grad": diff[1],
        })  # fmt: skip
        del block
    return rows, skipped


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| MoE layer (h, e x f, top-k, tokens) | experts' GEMMs | ms fwd+bwd | bf16 loop / this "
        "| diff from bf16 loop (output, input grad) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        shape = f"{r['layer']} ({r['hidden']}, {r['experts']} x {r['ffn']}, top-{r['top_k']}, "
        lines.append(
            f"| {shape}{r['tokens']}) | {r['variant']} | {r['ms']:.3g} | "
            f"{r['loop_over_this']:.2f} | {r['diff_output']:.1e}, {r['diff_input_grad']:.1e} |"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=20, help="timed passes per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed passes first")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", default="", help="comma-separated LAYERS names; default: by device")
    p.add_argument("--json", help="write the rows and the machine to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    device = torch.cuda.get_device_name(torch.device(args.device)) if on_gpu else args.device
    machine = f"{device} | {platform.machine()} | torch {torch.__version__} | bf16"
    names = args.layers.split(",") if args.layers else moe_gpu.GPU_LAYERS if on_gpu else ["tiny"]
    result: dict = {"machine": machine, "unmeasured": True, "rows": [], "skipped": []}
    print(machine)
    print("UNMEASURED: no GPU has run benchmarks/speed/moe_layer.py; CPU times are a smoke run")
    for name in names:
        rows, skipped = rows_for(args, name)
        result["rows"] += rows
        result["skipped"] += skipped
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    print("\n" + "\n".join(table(result["rows"])))
    for s in result["skipped"]:
        print(f"{s['layer']}: {s['variant']} skipped: {s['reason']}")
    return result


if __name__ == "__main__":
    main()
