"""Which launch-overhead cure each model size gains from: tokens/s of ptdp's GPT trained
with each of

  eager          no compile, torch's foreach AdamW (one multi-tensor op per AdamW step)
  fused-adamw    no compile, torch's fused AdamW (one kernel for all tensors; what ptdp's
                 optimizer asks for on CUDA)
  compile        ptdp's regional compile (`ptdp.model.compile`: each layer and the loss,
                 Inductor fusing the norms, bias + GeLU, the loss' upcast and softmax),
                 fused AdamW
  cuda-graphs    the same regions in CUDA graphs (torch.compile's "reduce-overhead",
                 train.cuda_graphs), fused AdamW

on one device, one process, bf16 autocast over fp32 weights, batch `micro_batch` of the
model's sequence, the same seeded weights and batch in every mode. A small model's step is
bound by kernel launches and Python (many small kernels), a large one's by its GEMMs: the
table says where each cure pays. A mode the device cannot run (CUDA graphs and fused AdamW
on a CPU, compile without --compile-on-cpu) is a row with its reason, not a gap.

`--profile DIR` then runs two more steps of each measured row under PyTorch's profiler and
writes DIR/trace_<model>_<mode>.json.gz (Chrome trace: open in https://ui.perfetto.dev;
host-side gaps show as idle stretches of the CUDA stream) and DIR/top_<model>_<mode>.txt
(the operators by device time, then by CPU time): where a 1.3B step goes, by kernel
(GEMMs, attention, the optimizer, elementwise).

    python benchmarks/speed/small_model_speed.py --models 125m,1.3b --json out.json   # a GPU
    python benchmarks/speed/small_model_speed.py --models 1.3b --modes compile --profile out/
    python benchmarks/speed/small_model_speed.py --device cpu --models tiny --steps 2 # smoke

Writes only the `--json` file and the `--profile` folder. scripts/gpu-check.sh runs it on a
lent GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.speed.mfu import MODELS  # the same shapes as the MFU benchmark
from ptdp.config.sections import ModelConfig
from ptdp.model.compile import apply_compile, mark_step
from ptdp.model.gpt import GPT

MODES = ("eager", "fused-adamw", "compile", "cuda-graphs")
VOCAB = 50304


def refusal(mode: str, device: torch.device, compile_on_cpu: bool) -> str | None:
    """Why `mode` cannot run on `device`, or None."""
    cuda = device.type == "cuda"
    if mode == "cuda-graphs" and not cuda:
        return "CUDA graphs need a CUDA device"
    if mode == "fused-adamw" and not cuda:
        return "ptdp asks for fused AdamW on CUDA only (foreach on a CPU)"
    if mode == "compile" and not (cuda or compile_on_cpu):
        return "compile on a CPU is slow to build; pass --compile-on-cpu"
    return None


def measure(name: str, mode: str, args: argparse.Namespace) -> dict:
    """One row: `mode` on model `name`, tokens/s over `args.steps` after `args.warmup`."""
    shape, device = MODELS[name], torch.device(args.device)
    row = {"model": name, "mode": mode, **asdict(shape)}
    why = refusal(mode, device, args.compile_on_cpu)
    if why:
        return {**row, "skipped": why}
    vocab = args.vocab or VOCAB
    cfg = ModelConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_heads=shape.heads,
        seq_length=shape.seq,
        vocab_size=vocab,
        dropout=0.0,
    )
    model = GPT(cfg, seed=0).to(device)
    graphs = mode == "cuda-graphs"
    if mode in ("compile", "cuda-graphs"):
        apply_compile([model], cuda_graphs=graphs)
    fused = {"fused": True} if mode != "eager" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, vocab, (shape.micro_batch, shape.seq + 1), generator=g).to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    losses = []

    def step() -> None:
        mark_step(graphs)
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    for _ in range(args.warmup):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = time.perf_counter() - start
    if args.profile:
        profile(step, device, Path(args.profile), f"{name}_{mode}")
    tokens = shape.micro_batch * shape.seq * args.steps
    return {
        **row,
        "steps": args.steps,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "last_loss": float(losses[-1]),
    }


def profile(step, device: torch.device, out: Path, tag: str) -> None:
    """Two steps of `step` under the profiler: the trace and the operator tables."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    out.mkdir(parents=True, exist_ok=True)
    with profiler(activities=activities, record_shapes=True) as prof:
        for _ in range(2):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(out / f"trace_{tag}.json.gz"))
    table = prof.key_averages()
    keys = ["self_device_time_total"] if device.type == "cuda" else []
    text = [table.table(sort_by=key, row_limit=30) for key in [*keys, "self_cpu_time_total"]]
    (out / f"top_{tag}.txt").write_text("\n\n".join(text))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="125m,1.3b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vocab", type=int, default=0, help="0 = 50304 (GPT-2's, padded)")
    p.add_argument("--compile-on-cpu", action="store_true")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--profile", help="folder for a profiler trace of each measured row")
    args = p.parse_args(argv)
    rows: list[dict] = []
    machine = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print("| model | mode | tokens/s | vs the first mode |\n|---|---|---:|---:|")
    for name in args.models.split(","):
        base = None
        for mode in args.modes.split(","):
            row = measure(name, mode, args)
            rows.append(row)
            if args.json:  # after every row: a time limit that cuts the run keeps the rest
                record = {"device": machine, "torch": torch.__version__, "rows": rows}
                with open(args.json, "w") as f:
                    json.dump(record, f, indent=1)
            if "skipped" in row:
                print(f"| {name} | {mode} | skipped: {row['skipped']} | |", flush=True)
                continue
            base = base or row["tokens_per_s"]
            gain = row["tokens_per_s"] / base
            print(f"| {name} | {mode} | {row['tokens_per_s']:,.0f} | {gain:.2f}x |", flush=True)
    return rows


if __name__ == "__main__":
    main()
