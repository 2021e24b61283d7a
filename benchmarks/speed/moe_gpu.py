"""Mixture-of-experts on one GPU: grouped GEMM against a loop over experts, and MoE MFU.

1. One MoE layer (`ptdp.model.moe.MoE`: router, dispatch, experts, combine, the balancing
   loss) forward and backward in bf16, its expert products computed by one grouped kernel
   for all experts (`GemmKernel.GROUPED`: grouped_mm, no host sync) and by one GEMM per
   expert (`GemmKernel.LOOP`: the counts read back to the host). Each kernel is forced for
   the layer's whole forward and backward by replacing ptdp's `choose_gemm` in this process
   only (`forced_kernel`); the product code is not changed. Two shapes (`LAYERS`, 8,192
   tokens): 64 experts of width 1,408, 8 per token (DeepSeek-MoE's fine-grained experts)
   and 8 experts of width 4,096, 2 per token (Mixtral's layout at h = 2,048), SwiGLU, no
   biases. Timed for the whole layer and for its experts alone (the routing fixed): median
   ms of `--reps` forward+backward passes after `--warmup`, each between
   torch.cuda.synchronize calls; the ratio loop / grouped; TFLOP/s of the expert GEMMs
   alone (3 x 2 n (2 f h + f h) FLOPs for n = tokens x k rows); and how far the grouped
   kernel's output and input gradient are from the loop's (max |difference| / max |loop|).
   Without CUDA a tiny layer in fp32 runs the loop only: there is no fused grouped kernel
   on a CPU (torch's CPU grouped_mm is a loop of its own, whose time says nothing of the
   GPU kernel), and the GROUPED row is named as skipped.
2. MFU of a small MoE model beside the dense model of the same active size: GPT h = 1,024,
   24 layers, seq 1,024 (benchmarks/speed/mfu.py's 350m) with its MLP of width 4,096, against
   the same GPT whose MLPs are 8 experts of width 2,048, 2 per token (the same MLP
   parameters per token, plus a router), the Switch balancing loss at 0.01. Both train
   through ptdp's own Trainer (mfu.py's RunConfig, synthetic tokens) in bf16 without
   torch.compile: an MoE model compiles with graph breaks around its routing, so both
   run eager for a like-for-like pair. Reported: total and active parameters
   (`ptdp.perf.cost.parameters`), tokens/s, model TFLOP/s (`model_flops_per_iteration`,
   which counts the k experts a token goes through and the router), MFU against the
   device's dense peak as mfu.py reads it, and peak allocated memory. On out-of-memory
   the micro-batch is halved.

Prints markdown tables; `--json PATH` writes the rows. Writes no tracked file.

    python benchmarks/speed/moe_gpu.py --json runs/moe.json      # on an H100 / H200
    python benchmarks/speed/moe_gpu.py --parts layer --reps 50    # the kernels only
    python benchmarks/speed/moe_gpu.py --device cpu --steps 2 --warmup 1   # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import benchmarks.speed.mfu as mfu
from ptdp.config.enums import Activation, Normalization
from ptdp.config.files import apply_updates
from ptdp.config.sections import ModelConfig
from ptdp.model.dispatch import plan_dispatch
from ptdp.model.moe import MoE, MoEState
from ptdp.model.parts import TPContext
from ptdp.parallel import grouped, wgrad
from ptdp.parallel.env import LaunchEnv
from ptdp.parallel.grouped import GemmKernel, gemm_for_cuda
from ptdp.perf.cost.flops import model_flops_per_iteration
from ptdp.perf.cost.parameters import model_size
from ptdp.train.run import prepare
from ptdp.train.step.trainer import Trainer


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    experts: int
    ffn: int
    """One expert's inner width (SwiGLU: fc1 has twice its rows)."""
    top_k: int
    tokens: int
    """Tokens of one microbatch (s * b)."""


LAYERS = {
    "e64-f1408-k8": LayerShape(2048, 64, 1408, 8, 8192),  # DeepSeek-MoE's fine-grained experts
    "e8-f4096-k2": LayerShape(2048, 8, 4096, 2, 8192),  # Mixtral's layout at h = 2048
    "tiny": LayerShape(64, 4, 32, 2, 128),  # CPU
}
GPU_LAYERS = ("e64-f1408-k8", "e8-f4096-k2")

DENSE = mfu.Shape(24, 1024, 16, 1024, 8)  # benchmarks/speed/mfu.py's 350m, micro-batch 8
TINY = mfu.Shape(2, 64, 4, 64, 4)  # CPU
MOE = {"num_experts": 8, "moe_top_k": 2, "moe_aux_loss_coeff": 0.01}
"""The MoE model's keys; moe_ffn_hidden_size = 2h, so that 2 experts a token = the 4h MLP."""


# ----------------------------------------------------------------------------- 1. one layer


@contextlib.contextmanager
def forced_kernel(kernel: GemmKernel) -> Iterator[None]:
    """Every grouped product run inside (forward, and the backward of what forward ran)
    uses `kernel`: `grouped_linear` asks `choose_gemm` once per forward and its backward
    reuses the answer, so replacing `choose_gemm` forces the whole layer."""
    choose = lambda x, weight: kernel  # noqa: E731
    with mock.patch.object(wgrad, "choose_gemm", choose):
        with mock.patch.object(grouped, "choose_gemm", choose):
            yield


def layer_config(shape: LayerShape) -> ModelConfig:
    """A one-layer model config whose MLP is the MoE layer of `shape` (SwiGLU, no biases)."""
    return ModelConfig(
        num_layers=1,
        hidden_size=shape.hidden,
        num_heads=max(1, shape.hidden // 128),
        seq_length=shape.tokens,
        vocab_size=128,
        activation=Activation.SWIGLU,
        normalization=Normalization.RMSNORM,
        bias=False,
        num_experts=shape.experts,
        moe_top_k=shape.top_k,
        moe_ffn_hidden_size=shape.ffn,
        moe_aux_loss_coeff=0.01,
    )


def build_layer(shape: LayerShape, device: torch.device, dtype: torch.dtype) -> MoE:
    """The MoE block of `shape`, weights drawn N(0, 0.02) on `device` from seed 0, in
    training mode."""
    torch.manual_seed(0)
    with torch.device(device):  # allocated and drawn there: no host copy of 0.5B weights
        block = MoE(layer_config(shape), TPContext(), layer=0, state=MoEState())
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block.to(device=device, dtype=dtype).train()


def layer_inputs(shape: LayerShape, device: torch.device, dtype: torch.dtype):
    """(x [tokens, 1, h] that wants its gradient, the output gradient dy), seed 1."""
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(shape.tokens, 1, shape.hidden, device=device, dtype=dtype, generator=gen)
    dy = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)
    return x.requires_grad_(), dy


def expert_inputs(block: MoE, x: torch.Tensor):
    """The experts' own inputs under the layer's routing of x: (rows [n, h] that want their
    gradient, counts [e], expert [n], an output gradient [n, h])."""
    with torch.no_grad():
        tokens = x.reshape(-1, x.shape[-1])
        plan = plan_dispatch(block.router(tokens), block.num_experts)
        rows = tokens.index_select(0, plan.choice // block.top_k)
        gen = torch.Generator(device=x.device).manual_seed(2)
        dy = torch.randn(rows.shape, device=x.device, dtype=x.dtype, generator=gen)
    return rows.detach().requires_grad_(), plan.counts, plan.expert, dy


def passes(block: MoE, x: torch.Tensor, dy: torch.Tensor, scope: str) -> Callable[[], None]:
    """One forward and backward of the whole layer (`scope` "layer") or its experts alone."""
    if scope == "experts":
        rows, counts, expert, dy_rows = expert_inputs(block, x)

        def step() -> None:
            rows.grad = None
            block.zero_grad(set_to_none=True)
            block.experts(rows, counts, expert).backward(dy_rows)

        return step

    def step() -> None:
        x.grad = None
        block.zero_grad(set_to_none=True)
        block(x).backward(dy)

    return step


def median_ms(step: Callable[[], None], warmup: int, reps: int, device: torch.device) -> float:
    """Median ms of `reps` calls of step(), each between device synchronisations."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        mfu._sync(device)
        start = time.perf_counter()
        step()
        mfu._sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def expert_gemm_flops(shape: LayerShape) -> float:
    """FLOPs of the expert GEMMs of one forward+backward: n = tokens x k rows through fc1
    [2f, h] (SwiGLU) and fc2 [h, f], three GEMMs each (forward, input and weight grads)."""
    rows = shape.tokens * shape.top_k
    return 3 * 2 * rows * (2 * shape.ffn * shape.hidden + shape.ffn * shape.hidden)


def run_pass(block: MoE, x: torch.Tensor, dy: torch.Tensor, kernel: GemmKernel):
    """(output, input gradient) of one forward and backward under `kernel`."""
    x.grad = None
    block.zero_grad(set_to_none=True)
    with forced_kernel(kernel):
        out = block(x)
        out.backward(dy)
    return out.detach(), x.grad.detach().clone()


def kernel_difference(block: MoE, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """How far GROUPED's output and input gradient are from LOOP's: max |g - l| / max |l|."""
    loop = run_pass(block, x, dy, GemmKernel.LOOP)
    fused = run_pass(block, x, dy, GemmKernel.GROUPED)
    rel = [(g.float() - a.float()).abs().max() / a.float().abs().max() for a, g in zip(loop, fused)]
    return {"output": rel[0].item(), "input_grad": rel[1].item()}


def grouped_skip_reason(device: torch.device, dtype: torch.dtype, shape: LayerShape) -> str:
    """Why GROUPED is not timed here ("" when it is)."""
    if device.type != "cuda":
        return (
            "no CUDA: there is no fused grouped kernel on a CPU (torch's CPU grouped_mm is "
            "a loop of its own, whose time says nothing of the GPU kernel)"
        )
    capability = torch.cuda.get_device_capability(device)
    if gemm_for_cuda(dtype, capability, (shape.hidden, shape.ffn)) is not GemmKernel.GROUPED:
        return f"ptdp picks LOOP on sm{capability[0]}{capability[1]} for {dtype} (choose_gemm)"
    return ""


def layer_rows(args, name: str, skipped: list[dict]) -> list[dict]:
    """Rows for layer `name`: LOOP and (where it runs) GROUPED, whole layer and experts."""
    shape, device = LAYERS[name], torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mfu._free(device)
    block = build_layer(shape, device, dtype)
    x, dy = layer_inputs(shape, device, dtype)
    reason = grouped_skip_reason(device, dtype, shape)
    kernels = [GemmKernel.LOOP] + ([GemmKernel.GROUPED] if not reason else [])
    if reason:
        skipped.append({"part": "layer", "layer": name, "kernel": "grouped", "reason": reason})
    diff = kernel_difference(block, x, dy) if not reason else None
    flops = expert_gemm_flops(shape)
    rows = []
    for scope in ("layer", "experts"):
        step = passes(block, x, dy, scope)
        ms = {}
        for kernel in kernels:
            with forced_kernel(kernel):
                ms[kernel] = median_ms(step, args.warmup, args.reps, device)
            rows.append({
                "part": "layer", "layer": name, "scope": scope, "kernel": kernel.value,
                "hidden": shape.hidden, "experts": shape.experts, "ffn": shape.ffn,
                "top_k": shape.top_k, "tokens": shape.tokens, "dtype": str(dtype).split(".")[-1],
                "reps": args.reps, "ms": ms[kernel], "expert_gemm_flops": flops,
                "expert_tflops": flops / (ms[kernel] / 1e3) / 1e12,
                "loop_over_grouped": None, "max_rel_diff": None,
            })  # fmt: skip
        if GemmKernel.GROUPED in ms:
            rows[-1]["loop_over_grouped"] = ms[GemmKernel.LOOP] / ms[GemmKernel.GROUPED]
            rows[-1]["max_rel_diff"] = diff if scope == "layer" else None
    del block, x, dy
    mfu._free(device)
    return rows


# ----------------------------------------------------------------------------- 2. MFU


def train_config(args, shape: mfu.Shape, micro_batch: int, data: str, moe: bool):
    """benchmarks/speed/mfu.py's RunConfig for `shape`, with MoE MLPs of width 2h when `moe`."""
    cfg = mfu.ptdp_config(args, shape, micro_batch, data, "none")
    if moe:
        keys = MOE | {"moe_ffn_hidden_size": 2 * shape.hidden}
        cfg = apply_updates(cfg, {"model": keys}, "benchmarks/speed/moe_gpu.py")
    return cfg


def _train(args, shape: mfu.Shape, micro_batch: int, data: str, moe: bool) -> dict:
    cfg = train_config(args, shape, micro_batch, data, moe)
    env = LaunchEnv(0, 1, 0)
    cfg, layout, run_data = prepare(cfg, env)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(cfg, layout, env, run_data)
    try:
        seconds = mfu.timed_steps(trainer.train_step, args.warmup, args.steps, trainer.device)
        params = trainer.parameter_count(full=True)
        peak = mfu._peak_gib(trainer.device)
    finally:
        del trainer
    return {"model_cfg": cfg.model, "params": params, "seconds": seconds, "peak_gib": peak}


def model_row(args, shape: mfu.Shape, data: str, moe: bool) -> dict:
    """One training run; on CUDA out-of-memory the micro-batch is halved and it reruns."""
    device = torch.device(args.device)
    micro_batch = args.micro_batch_size or shape.micro_batch
    name = "moe" if moe else "dense"
    while True:
        mfu._free(device)
        try:
            got = _train(args, shape, micro_batch, data, moe)
            break
        except torch.OutOfMemoryError:
            if micro_batch == 1:
                print(f"  {name}: out of memory at micro-batch 1")
                raise
            micro_batch //= 2
            print(f"  {name}: out of memory, retrying with micro-batch {micro_batch}")
    mfu._free(device)
    m = got["model_cfg"]
    size = model_size(m)
    flops_per_step = model_flops_per_iteration(m, micro_batch)
    tflops = flops_per_step * args.steps / got["seconds"] / 1e12
    return {
        "part": "model", "model": name, "layers": m.num_layers, "hidden": m.hidden_size,
        "heads": m.num_heads, "seq": m.seq_length, "ffn": m.ffn_size,
        "num_experts": m.num_experts, "top_k": m.moe_top_k if moe else 0,
        "moe_ffn": m.moe_ffn_size if moe else 0, "micro_batch": micro_batch,
        "params": got["params"], "total_params": size.total, "active_params": size.active,
        "compile": False, "steps": args.steps, "seconds": got["seconds"],
        "flops_per_step": flops_per_step,
        "tokens_per_s": micro_batch * m.seq_length * args.steps / got["seconds"],
        "tflops": tflops, "peak_tflops": args.peak_tflops,
        "mfu": tflops / args.peak_tflops if args.peak_tflops else None,
        "peak_gib": got["peak_gib"],
    }  # fmt: skip


# ----------------------------------------------------------------------------- report


def layer_table(rows: list[dict]) -> list[str]:
    lines = [
        "| MoE layer (h, e x f, top-k, tokens) | scope | kernel | ms fwd+bwd | expert GEMM "
        "TFLOP/s | loop / grouped | max diff from loop (output, input grad) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = f"{r['layer']} ({r['hidden']}, {r['experts']} x {r['ffn']}, top-{r['top_k']}, "
        shape += f"{r['tokens']}, {r['dtype']})"
        ratio = f"{r['loop_over_grouped']:.2f}" if r.get("loop_over_grouped") else ""
        d = r.get("max_rel_diff")
        diff = f"{d['output']:.1e}, {d['input_grad']:.1e}" if d else ""
        lines.append(
            f"| {shape} | {r['scope']} | {r['kernel']} | {r['ms']:.3g} | "
            f"{r['expert_tflops']:.3g} | {ratio} | {diff} |"
        )
    return lines


def model_table(rows: list[dict]) -> list[str]:
    lines = [
        "| model (no compile) | params total / active | micro-batch | tokens/s | TFLOP/s | MFU "
        "| peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        what = f"MoE, {r['num_experts']} x {r['moe_ffn']} top-{r['top_k']}"
        what = f"dense, MLP {r['ffn']}" if r["model"] == "dense" else what
        shape = f"{r['layers']} x {r['hidden']}, seq {r['seq']}"
        share = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
        lines.append(
            f"| {r['model']} ({shape}; {what}) | {r['total_params'] / 1e6:,.1f}M / "
            f"{r['active_params'] / 1e6:,.1f}M | {r['micro_batch']} | {r['tokens_per_s']:,.0f} "
            f"| {r['tflops']:.3g} | {share} | {r['peak_gib']:.2f} |"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="layer,model", help="of layer, model")
    p.add_argument("--reps", type=int, default=20, help="timed passes per layer and kernel")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per model")
    p.add_argument("--warmup", type=int, default=3, help="untimed passes / steps first")
    p.add_argument("--micro-batch-size", type=int, default=0, help="0 = the model's default")
    p.add_argument("--vocab-size", type=int, default=mfu.GPT2_VOCAB)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="override the device peak")
    p.add_argument("--json", help="write the rows and the machine to this file")
    args = p.parse_args(argv)
    # What benchmarks/speed/mfu.py's ptdp_config reads: no compilation (both eager, a pair).
    on_gpu = args.device.startswith("cuda")
    args.compile, args.grad_accum, args.precision = False, 1, "bf16" if on_gpu else "fp32"
    if unknown := set(args.parts.split(",")) - {"layer", "model"}:
        raise SystemExit(f"unknown parts {sorted(unknown)}; known: layer, model")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.peak_tflops = mfu.resolve_peak(args)
    parts = args.parts.split(",")
    on_gpu = args.device.startswith("cuda")
    device = torch.cuda.get_device_name(torch.device(args.device)) if on_gpu else args.device
    machine = f"{device} | {platform.machine()} | torch {torch.__version__} | {args.precision}"
    result: dict = {"machine": machine, "rows": [], "skipped": []}

    def save() -> None:  # after each part: a run cut short keeps what it has
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))

    print(machine)
    if "layer" in parts:
        for name in GPU_LAYERS if on_gpu else ("tiny",):
            result["rows"] += layer_rows(args, name, result["skipped"])
            save()
        print("\n" + "\n".join(layer_table([r for r in result["rows"] if r["part"] == "layer"])))
        for s in result["skipped"]:
            print(f"{s['layer']}: GROUPED skipped: {s['reason']}")
    if "model" in parts:
        shape = DENSE if on_gpu else TINY
        with tempfile.TemporaryDirectory() as tmp:
            data = mfu.synthetic_tokens(Path(tmp), args.vocab_size, 64 * (shape.seq + 1))
            for moe in (False, True):
                result["rows"].append(model_row(args, shape, data, moe))
                save()
        print("\n" + "\n".join(model_table([r for r in result["rows"] if r["part"] == "model"])))
        print(
            f"both without torch.compile (a like-for-like pair); "
            f"steps {args.steps} (+{args.warmup} warm-up); peak {args.peak_tflops or 'n/a'} TFLOP/s"
        )
    return result


if __name__ == "__main__":
    main()
