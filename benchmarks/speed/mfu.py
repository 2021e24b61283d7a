"""MFU on one GPU: ptdp's own training step on GPT sizes, against plain PyTorch loops.

The ptdp side is the product: `Trainer` (model chunks, gradient buffers, fp32-master
AdamW, clipping, the fault check) built from a RunConfig, with `train.compile` and bf16;
only the data is synthetic (random tokens written in the indexed format). Each model
trains `--warmup` steps (compilation, allocator warm-up; not timed), then `--steps` timed
steps. Reported per run: parameters, tokens/s, model TFLOP/s (ptdp/perf/cost/flops.py model
FLOPs: forward + backward, recomputation not counted), MFU against the device's dense
bf16 peak, and peak allocated memory; on CUDA also what the process holds beside that peak
(the allocator's cache, the context and libraries), which `--predict` sets beside the
performance model's count and reserve.

With --compare, the same model, batch, sequence length and precision also train through
peers in the same process (benchmarks/speed/peers/, one module each), all in one loop: fp32
weights, bf16 autocast, torch AdamW (fused on CUDA), gradient clipping, the vocabulary as
given (50,257; ptdp pads its rows to 50,304, `--pad-peers` gives the peers the same). With
GPT-2 layers (`--arch gpt`): Hugging Face `GPT2LMHeadModel`, a GPT written in plain PyTorch
(both compiled whole when ptdp compiles; `--no-peer-compile`: eager) and Megatron-Core's
GPTModel; with Llama 3 layers (`--arch llama`, ptdp's Llama layer at the same sizes):
TorchTitan's Llama 3 (its per-block compile, FlexAttention and fp8 converter) and
Megatron-Core. `--fp8 tensorwise,rowwise` adds the same rows with fp8 GEMMs (ptdp's
`train.precision = "fp8"` and `train.fp8_recipe`). A peer that cannot run a row (not
installed, CUDA only, no such recipe) leaves the row with the reason. The ratio ptdp / peer
of tokens/s is printed for each pair of rows at one precision. Model FLOPs (ptdp's count of
the ptdp model, unpadded vocabulary) are the same for every row of a model, and MFU is
against the dense bf16 peak for fp8 rows too, as the peers report it.

    python benchmarks/speed/mfu.py --models 125m,350m,760m,1.3b --compare   # on an H100 / H200
    python benchmarks/speed/mfu.py --arch llama --models 125m,1.3b --compare \\
        --fp8 tensorwise,rowwise
    python benchmarks/speed/mfu.py --fill          # largest GPT that fits with full recomputation
    python benchmarks/speed/mfu.py --device cpu --models tiny --steps 3 --no-compile --compare
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import math
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.mfu_table import against_prediction, format_table, ratios
from benchmarks.speed.peers import (
    ARCHS,
    DEFAULT_PEERS,
    PEERS,
    PeerShape,
    PeerUnavailable,
    build_peer,
)
from ptdp.config.files import apply_updates
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.data.indexed import IndexedWriter
from ptdp.parallel.env import LaunchEnv
from ptdp.perf.cost.flops import dense_peak_flops, device_kind, model_flops_per_iteration
from ptdp.perf.cost.hardware import System
from ptdp.perf.cost.hardware_file import load_system, system_for_device_name
from ptdp.perf.cost.reserve import fit
from ptdp.perf.simulate.simulator import simulate
from ptdp.train.run import prepare
from ptdp.train.step.optim import adamw_kernel
from ptdp.train.step.trainer import Trainer


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch: int
    """Default micro-batch size (halved on out-of-memory)."""


MODELS = {
    "tiny": Shape(2, 64, 4, 64, 4),  # CPU smoke test
    "small": Shape(4, 256, 4, 256, 8),  # CPU: compiled against eager
    "125m": Shape(12, 768, 12, 1024, 16),
    "350m": Shape(24, 1024, 16, 1024, 16),
    "760m": Shape(24, 1536, 16, 1024, 8),
    "1.3b": Shape(24, 2048, 16, 2048, 8),
}
# --fill tries these in order with full recomputation and keeps the largest that trains.
FILL = {
    "2.7b": Shape(32, 2560, 32, 2048, 4),
    "4b": Shape(32, 3072, 24, 2048, 4),
    "6.7b": Shape(32, 4096, 32, 2048, 2),
    "9b": Shape(44, 4096, 32, 2048, 2),
    "13b": Shape(40, 5120, 40, 2048, 1),
}
GPT2_VOCAB = 50257
FP8_RECIPES = ("tensorwise", "rowwise")


# ----------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step: Callable[[], None], warmup: int, steps: int, device: torch.device) -> float:
    """Seconds for `steps` calls of step() after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return time.perf_counter() - start


def _free(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()  # each model recompiles from scratch: no recompile limit hit
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def _held_gib(device: torch.device, peak_gib: float) -> dict:
    """What the process holds beside the peak of its tensors, read after the timed steps:
    the caching allocator's segments past that peak, and the device memory in use past the
    allocator's (the CUDA context, cuBLAS/cuDNN workspaces and handles); `ptdp.perf.cost.reserve`
    predicts their sum."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    reserved, used = torch.cuda.memory_reserved(device) / 2**30, (total - free) / 2**30
    return {
        "allocator_gib": reserved - peak_gib,
        "context_gib": used - reserved,
        "device_gib": total / 2**30,
    }


# ----------------------------------------------------------------------------- ptdp


def synthetic_tokens(directory: Path, vocab: int, tokens: int) -> str:
    """Random tokens in the indexed format (throughput does not depend on the text)."""
    prefix = directory / f"synthetic-{vocab}"
    if not Path(f"{prefix}.idx").exists():
        rng = np.random.default_rng(0)
        with IndexedWriter(prefix, np.uint16 if vocab < 2**16 else np.int32) as writer:
            for _ in range(8):
                writer.add_document(rng.integers(0, vocab, tokens // 8))
    return str(prefix)


LLAMA_KEYS = {
    "position_embedding": "rope",
    "normalization": "rmsnorm",
    "activation": "swiglu",
    "tie_embeddings": False,
    "bias": False,
    "rope_theta": 500000.0,
}
"""--arch llama: Llama 3's layer (ptdp/config/presets.py) at the GPT sizes of MODELS."""


def model_keys(args, shape: Shape) -> dict:
    """ptdp's `model` keys for this shape and --arch (also what every row's FLOPs count)."""
    keys = {
        "num_layers": shape.layers,
        "hidden_size": shape.hidden,
        "num_heads": shape.heads,
        "seq_length": shape.seq,
        "vocab_size": args.vocab_size,
        "dropout": 0.0,
    }
    return keys | (LLAMA_KEYS if getattr(args, "arch", "gpt") == "llama" else {})


def model_config(args, shape: Shape) -> ModelConfig:
    """The checked ModelConfig of model_keys (names such as "swiglu" become their enums)."""
    return apply_updates(RunConfig(), {"model": model_keys(args, shape)}, "mfu.py").model


def ptdp_updates(args, shape: Shape, micro_batch: int, data: str, recompute: str, precision: str):
    """The overrides of ptdp's RunConfig for one row; an fp8 row sets `train.precision =
    "fp8"` and `train.fp8_recipe` (tensorwise or rowwise), which a ptdp without fp8 training
    refuses by name (the row then says so)."""
    train = {
        "micro_batch_size": micro_batch,
        "global_batch_size": micro_batch * args.grad_accum,
        "steps": 10**6,
        "eval_interval": 0,
        "progress": False,
        "device": args.device,
        "precision": precision,
        "compile": args.compile,
        "run_dir": str(Path(data).parent / "run"),
    }
    if precision.startswith("fp8-"):
        train |= {"precision": "fp8", "fp8_recipe": precision.removeprefix("fp8-")}
    return {
        "model": model_keys(args, shape),
        "parallel": {"recompute": recompute},
        "data": {"path": data, "valid_fraction": 0.01},
        "optim": {"warmup_steps": 1},
        "train": train,
    }


def ptdp_config(
    args, shape: Shape, micro_batch: int, data: str, recompute: str, precision: str = ""
) -> RunConfig:
    updates = ptdp_updates(args, shape, micro_batch, data, recompute, precision or args.precision)
    return apply_updates(RunConfig(), updates, "benchmarks/speed/mfu.py")


def run_ptdp(
    args, shape: Shape, micro_batch: int, data: str, recompute: str, precision: str
) -> dict:
    cfg = ptdp_config(args, shape, micro_batch, data, recompute, precision)
    env = LaunchEnv(0, 1, 0)
    cfg, layout, run_data = prepare(cfg, env)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(cfg, layout, env, run_data)
    try:
        seconds = timed_steps(trainer.train_step, args.warmup, args.steps, trainer.device)
        params = trainer.parameter_count(full=True)
        peak = _peak_gib(trainer.device)
        held = _held_gib(trainer.device, peak)
    finally:
        del trainer
    return {"params": params, "seconds": seconds, "peak_gib": peak, **held}


def predict(args, shape: Shape, micro_batch: int, recompute: str) -> dict:
    """ptdp's performance model (ptdp/perf, as `ptdp simulate`) for the same run on one
    device of `args.predict`: what the measurement should come close to."""
    cfg = ptdp_config(args, shape, micro_batch, "unused", recompute)
    p = simulate(cfg, args.system, 1)
    gib = p.memory[0].total / 2**30
    need, usable = fit(p.memory, args.system.device)  # the model's count and the reserve
    return {
        "system": args.system.name,
        "tokens_per_s": p.tokens_per_second,
        "mfu": p.mfu,
        "seconds_per_step": p.iteration_seconds,
        "memory_gib": gib,
        "reserve_gib": p.memory[0].reserved / 2**30,
        "fits": need <= usable,
    }


# ----------------------------------------------------------------------------- peers


def peer_shape(args, shape: Shape, precision: str) -> PeerShape:
    """The peer's copy of ptdp's row: the same layers, widths, heads, sequence, vocabulary
    (padded as ptdp's with --pad-peers) and precision."""
    model = model_config(args, shape)
    return PeerShape(
        arch=args.arch,
        layers=shape.layers,
        hidden=shape.hidden,
        heads=shape.heads,
        ffn=model.ffn_size,
        seq=shape.seq,
        vocab=model.padded_vocab_size() if args.pad_peers else args.vocab_size,
        precision=precision,
        rope_theta=model.rope_theta,
    )


def run_peer(args, name: str, shape: Shape, micro_batch: int, precision: str) -> dict:
    """A hand-written loop: fp32 weights, bf16 autocast, AdamW, clipping, accumulation."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    # tokens stay below args.vocab_size
    forward = build_peer(name, peer_shape(args, shape, precision), device, args.peer_compile)
    params = [p for p in forward.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
        **adamw_kernel(params),
    )
    dtype = {"fp16": torch.float16, "fp32": None}.get(precision, torch.bfloat16)
    autocast = (
        (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
    )
    gen = torch.Generator(device=device).manual_seed(0)
    batch = torch.randint(
        0, args.vocab_size, (micro_batch, shape.seq + 1), device=device, generator=gen
    )

    def step() -> None:
        for _ in range(args.grad_accum):
            with autocast():
                logits = forward(batch[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            (loss / args.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = timed_steps(step, args.warmup, args.steps, device)
    count = sum(p.numel() for p in {id(p): p for p in params}.values())
    return {"params": count, "seconds": seconds, "peak_gib": _peak_gib(device)}


# ----------------------------------------------------------------------------- report


def _shape_fields(args, name: str, impl: str, shape: Shape, precision: str) -> dict:
    return {
        "model": name,
        "impl": impl,
        "arch": args.arch,
        "precision": precision,
        "layers": shape.layers,
        "hidden": shape.hidden,
        "heads": shape.heads,
        "seq": shape.seq,
    }


def error_row(args, name: str, impl: str, shape: Shape, precision: str, error: str) -> dict:
    """The row of a run that could not train: its shape and why, in place of figures."""
    return _shape_fields(args, name, impl, shape, precision) | {"error": error}


def measure(
    args, name: str, impl: str, shape: Shape, data: str, recompute: str, precision: str = ""
) -> dict:
    """One row; on CUDA out-of-memory the micro-batch is halved and the run retried."""
    precision = precision or args.precision
    device = torch.device(args.device)
    micro_batch = args.micro_batch_size or shape.micro_batch
    while True:
        _free(device)
        try:
            if impl == "ptdp":
                got = run_ptdp(args, shape, micro_batch, data, recompute, precision)
            else:
                got = run_peer(args, impl, shape, micro_batch, precision)
            break
        except torch.OutOfMemoryError:
            said = ""
            if impl == "ptdp" and args.system and precision == args.precision:
                p = predict(args, shape, micro_batch, recompute)
                fits = "fits" if p["fits"] else "does not fit"
                said = f" (the model: {fits}, {p['memory_gib']:.1f} + {p['reserve_gib']:.1f} GiB)"
            if micro_batch == 1:
                print(f"  {name} {impl}: out of memory at micro-batch 1{said}")
                raise
            micro_batch //= 2
            print(f"  {name} {impl}: out of memory{said}, retrying with micro-batch {micro_batch}")
    _free(device)
    model = model_config(args, shape)
    batch = micro_batch * args.grad_accum
    flops_per_step = model_flops_per_iteration(model, batch)
    seconds = got["seconds"]
    tflops = flops_per_step * args.steps / seconds / 1e12
    return _shape_fields(args, name, impl, shape, precision) | {
        "micro_batch": micro_batch,
        "global_batch": batch,
        "recompute": recompute,
        "params": got["params"],
        "steps": args.steps,
        "seconds": seconds,
        "flops_per_step": flops_per_step,
        "tokens_per_s": batch * shape.seq * args.steps / seconds,
        "tflops": tflops,
        "peak_tflops": args.peak_tflops,
        "mfu": tflops / args.peak_tflops if args.peak_tflops else None,
        "peak_gib": got["peak_gib"],
        **{k: got[k] for k in ("allocator_gib", "context_gib", "device_gib") if k in got},
        "predicted": (
            predict(args, shape, micro_batch, recompute)
            if impl == "ptdp" and args.system and precision == args.precision
            else None
        ),
    }


def resolve_peak(args) -> float | None:
    """Dense bf16 (or fp16/fp32) TFLOP/s of the device: --peak-tflops, else by its name."""
    if args.peak_tflops:
        return args.peak_tflops
    if args.device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(args.device))
        kind = device_kind(name)
        if kind is None:
            raise SystemExit(f"unknown GPU {name!r}: pass --peak-tflops (dense bf16 TFLOP/s)")
        return dense_peak_flops(kind, args.precision) / 1e12
    return None  # CPU: no table entry; MFU is left out unless --peak-tflops is given


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="125m,350m,760m,1.3b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--fill", action="store_true", help="also find the largest GPT that fits")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    p.add_argument("--micro-batch-size", type=int, default=0, help="0 = per-model default")
    p.add_argument("--grad-accum", type=int, default=1, help="microbatches per step")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--compare", action="store_true", help="also train the peers")
    p.add_argument(
        "--peers",
        help=f"of {', '.join(PEERS)}; default: "
        + "; ".join(f"--arch {a}: {v}" for a, v in DEFAULT_PEERS.items()),
    )
    p.add_argument(
        "--arch",
        default="gpt",
        choices=ARCHS,
        help="gpt: GPT-2 layers; llama: Llama 3 layers (RoPE, RMSNorm, SwiGLU, no biases, "
        "untied output layer) at the same sizes, as TorchTitan trains",
    )
    p.add_argument(
        "--fp8",
        default="",
        help="comma-separated fp8 recipes (tensorwise, rowwise): after the bf16 rows, the same "
        "rows again with fp8 GEMMs; MFU stays against the dense bf16 peak, as the peers count it",
    )
    p.add_argument(
        "--fp8-models", default="", help="the models of the fp8 rows (default: --models)"
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        help="seconds for all rows: a row that would end past it (judged by the longest so "
        "far) is recorded as not run, so a caller's hard limit does not cut one midway",
    )
    p.add_argument(
        "--peer-compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the peers (whole model, as nanoGPT does); default: as --compile, "
        "so both sides get the compiler",
    )
    p.add_argument(
        "--pad-peers",
        action="store_true",
        help="give the peers a vocabulary padded to a multiple of 128, as nanoGPT's 50304 "
        "(ptdp pads by default: model.make_vocab_size_divisible_by)",
    )
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--vocab-size", type=int, default=GPT2_VOCAB)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="override the device peak")
    p.add_argument(
        "--predict",
        metavar="SYSTEM",
        help="performance-model system for the predicted column (a100-80gb, h100-sxm, h200 "
        "or a hardware TOML); default: the GPU's own, none on CPU",
    )
    p.add_argument(
        "--predict-only", action="store_true", help="print the predictions, train nothing"
    )
    p.add_argument("--json", help="write the rows and the machine to this file")
    return p.parse_args(argv)


def resolve_system(args) -> System | None:
    """The performance-model system to predict for: --predict, else the GPU's own."""
    if args.predict:
        return load_system(args.predict)
    if args.device.startswith("cuda"):
        return system_for_device_name(torch.cuda.get_device_name(torch.device(args.device)))
    return None


def prediction_table(args, names: list[str]) -> list[dict]:
    """--predict-only: the model's figures for each model's default micro-batch."""
    rows = []
    print(f"predicted by ptdp/perf on one {args.system.device.name} ({args.precision}):")
    for name in names:
        shape = MODELS.get(name) or FILL[name]
        recompute = "full" if name in FILL else "none"
        micro_batch = args.micro_batch_size or shape.micro_batch
        got = predict(args, shape, micro_batch, recompute)
        rows.append({"model": name, "micro_batch": micro_batch, "recompute": recompute} | got)
        fits = "fits" if got["fits"] else "does not fit"
        print(
            f"{name:>6} | mbs {micro_batch:>2} | recompute {recompute:>4} | "
            f"{got['tokens_per_s']:>10,.0f} tokens/s | MFU {100 * got['mfu']:5.1f}% | "
            f"{got['memory_gib']:6.1f} GiB ({fits})"
        )
    return rows


def run_rows(args, names: list[str], peers: list[str], data: str, record) -> None:
    """Every row, the most wanted first (a run cut short keeps them): ptdp, then each peer,
    at the base precision, then the same at each fp8 recipe; then --fill. A peer's failure
    (not installed, needs CUDA, its library's version) and a ptdp row that fails become rows
    with the error text, and the rest still run; main() exits non-zero after the report if
    a ptdp row at the base precision failed (that is a bug of ptdp's, not a missing peer)."""
    fp8_names = [m for m in args.fp8_models.split(",") if m] or names
    precisions = [args.precision] + [f"fp8-{r}" for r in args.fp8.split(",") if r]
    start, longest = time.perf_counter(), 0.0
    for precision in precisions:
        for impl in ["ptdp", *peers]:
            for name in names if precision == args.precision else fp8_names:
                began = time.perf_counter()
                if args.time_limit and began - start + longest > args.time_limit:
                    said = f"not run: --time-limit {args.time_limit:g} s would pass during it"
                    record(error_row(args, name, impl, MODELS[name], precision, said))
                    continue
                try:
                    record(measure(args, name, impl, MODELS[name], data, "none", precision))
                except Exception as e:  # noqa: BLE001 -- reported in its row; main() judges
                    said = str(e) if isinstance(e, PeerUnavailable) else f"{type(e).__name__}: {e}"
                    record(error_row(args, name, impl, MODELS[name], precision, said))
                    _free(torch.device(args.device))
                longest = max(longest, time.perf_counter() - began)
    if args.fill:
        for name, shape in FILL.items():
            try:
                record(measure(args, name, "ptdp", shape, data, "full"))
            except torch.OutOfMemoryError:
                print(f"fill: {name} does not fit; the largest that does is above it")
                _free(torch.device(args.device))
                break


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    args.system = resolve_system(args)
    if args.predict_only:
        if args.system is None:
            raise SystemExit("--predict-only needs --predict SYSTEM on a machine without a GPU")
        names = [m for m in args.models.split(",") if m] + (list(FILL) if args.fill else [])
        rows = prediction_table(args, names)
        if args.json:
            Path(args.json).write_text(json.dumps({"predicted": rows}, indent=2))
        return rows
    args.peak_tflops = resolve_peak(args)
    if args.peer_compile is None:
        args.peer_compile = args.compile
    names = [m for m in args.models.split(",") if m]
    every = names + [m for m in args.fp8_models.split(",") if m]
    peers = (args.peers or DEFAULT_PEERS[args.arch]).split(",") if args.compare else []
    peers = [p for p in peers if p]
    recipes = [r for r in args.fp8.split(",") if r]
    for given, known in ((every, MODELS), (peers, PEERS), (recipes, FP8_RECIPES)):
        if unknown := [x for x in given if x not in known]:
            raise SystemExit(f"unknown {unknown}; known: {', '.join(known)}")
    device = args.device
    if device.startswith("cuda"):
        device = torch.cuda.get_device_name(torch.device(device))
    machine = f"{device} | {platform.machine()} | torch {torch.__version__} | {args.precision}"
    rows: list[dict] = []

    def record(row: dict) -> None:
        """Print the row and rewrite the JSON at once: a run cut short keeps what it has."""
        rows.append(row)
        print(format_table(rows[-1:]).splitlines()[-1], flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        longest = max([MODELS[m].seq for m in every] + ([2048] if args.fill else []))
        data = synthetic_tokens(Path(tmp), args.vocab_size, 64 * (longest + 1))
        run_rows(args, names, peers, data, record)
    compiled = f"compile {'on' if args.compile else 'off'}"
    if peers:
        compiled += f" (peers {'on' if args.peer_compile else 'off'})"
    print(f"\n{machine} | {compiled} | steps {args.steps} "
          f"(+{args.warmup} warm-up) | peak {args.peak_tflops or 'n/a'} TFLOP/s")  # fmt: skip
    print(format_table(rows))
    for line in ratios(rows):
        print(line)
    for line in against_prediction(rows):
        print(line)
    for r in rows:
        assert "error" in r or (math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0)
    ours = [r for r in rows if r["impl"] == "ptdp" and r["precision"] == args.precision]
    failed = [f"{r['model']}: {r['error']}" for r in ours if "error" in r]
    if failed := [f for f in failed if ": not run: " not in f]:
        raise SystemExit("ptdp failed: " + "; ".join(failed))
    return rows


if __name__ == "__main__":
    main()
