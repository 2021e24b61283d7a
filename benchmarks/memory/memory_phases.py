"""Memory on one GPU, phase by phase, against the performance model's count.

For GPT sizes of `benchmarks/speed/mfu.py` (its Trainer path: bf16 weights, fp32 masters and
gradient buffers, fused AdamW, compiled layers), read `torch.cuda` after each phase:
the Trainer built (weights, gradient buffers, masters), the first step (AdamW's moments
appear), and a later step on its own (the steady state and what a step adds on top of
it). Beside each, `ptdp.perf.cost.memory`'s terms for the same run: params + grads +
optimizer (the static part) and activations + working (what a step adds). A model that
runs out of memory says in which phase. CUDA only; writes no tracked file:

    python benchmarks/memory/memory_phases.py --models 125m,1.3b,2.7b,4b
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.speed.mfu import FILL, MODELS, _free, ptdp_config, synthetic_tokens
from ptdp.parallel.env import LaunchEnv
from ptdp.perf.cost.memory import estimate_memory
from ptdp.train.run import prepare
from ptdp.train.step.trainer import Trainer

GIB = 2**30
SHAPES = {**MODELS, **FILL}


def _now(device: torch.device) -> dict:
    torch.cuda.synchronize(device)
    return {
        "allocated": torch.cuda.memory_allocated(device) / GIB,
        "peak": torch.cuda.max_memory_allocated(device) / GIB,
        "reserved": torch.cuda.memory_reserved(device) / GIB,
    }


def predicted(cfg) -> dict:
    m = estimate_memory(cfg, 1)[0]
    return {
        "static": (m.params + m.grads + m.optimizer) / GIB,
        "params": m.params / GIB,
        "grads": m.grads / GIB,
        "optimizer": m.optimizer / GIB,
        "activations": m.activations / GIB,
        "working": m.working / GIB,
        "total": m.total / GIB,
    }


def phases(args, name: str, data: str) -> dict:
    shape = SHAPES[name]
    recompute = "full" if name in FILL else "none"
    micro = args.micro_batch_size or shape.micro_batch
    cfg = ptdp_config(args, shape, micro, data, recompute)
    row = {"model": name, "micro_batch": micro, "recompute": recompute, "model_count": {}}
    device = torch.device(args.device)
    _free(device)
    phase = "build"
    try:
        env = LaunchEnv(0, 1, 0)
        cfg, layout, run_data = prepare(cfg, env)
        row["model_count"] = predicted(cfg)
        with contextlib.redirect_stdout(io.StringIO()):
            trainer = Trainer(cfg, layout, env, run_data)
        row["params"] = trainer.parameter_count(full=True)
        row["built"] = _now(device)
        phase = "step 1"
        torch.cuda.reset_peak_memory_stats(device)
        trainer.train_step()
        row["step1"] = _now(device)
        for _ in range(2):
            trainer.train_step()
        phase = "step 4"
        torch.cuda.reset_peak_memory_stats(device)
        before = _now(device)
        trainer.train_step()
        row["steady"] = {**_now(device), "before": before["allocated"]}
        free, total = torch.cuda.mem_get_info(device)
        row["used"], row["device"] = (total - free) / GIB, total / GIB
        del trainer
    except torch.OutOfMemoryError as e:
        row["out_of_memory"] = phase
        row["at_oom"] = _now(device)
        row["message"] = str(e).splitlines()[0][:300]
    _free(device)
    return row


def show(r: dict) -> str:
    p = r["model_count"]
    head = f"{r['model']} (micro-batch {r['micro_batch']}, recompute {r['recompute']})"
    lines = [head]
    if p:
        lines.append(
            f"  model: static {p['static']:.2f} (params {p['params']:.2f}, grads "
            f"{p['grads']:.2f}, optimizer {p['optimizer']:.2f}), activations "
            f"{p['activations']:.2f}, working {p['working']:.2f}, total {p['total']:.2f}"
        )
    if "built" in r:
        b = r["built"]
        lines.append(
            f"  built: allocated {b['allocated']:.2f}, peak while building {b['peak']:.2f}"
        )
    if "step1" in r:
        s = r["step1"]
        lines.append(f"  step 1: peak {s['peak']:.2f}, allocated after {s['allocated']:.2f}")
    if "steady" in r:
        s = r["steady"]
        lines.append(
            f"  step 4: allocated before {s['before']:.2f}, peak {s['peak']:.2f} (a step adds "
            f"{s['peak'] - s['before']:.2f}), reserved {s['reserved']:.2f}, device used "
            f"{r['used']:.2f} of {r['device']:.2f}"
        )
    if "out_of_memory" in r:
        a = r["at_oom"]
        lines.append(
            f"  OUT OF MEMORY in {r['out_of_memory']}: allocated {a['allocated']:.2f}, "
            f"peak {a['peak']:.2f}, reserved {a['reserved']:.2f}: {r['message']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="125m,1.3b,2.7b,4b", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--micro-batch-size", type=int, default=0, help="0 = the model's default")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    args.vocab_size, args.grad_accum = 50257, 1
    if not torch.cuda.is_available():
        raise SystemExit("memory_phases.py reads torch.cuda's counters: it needs a CUDA device")
    print(torch.cuda.get_device_name(0), "| torch", torch.__version__, "| GiB throughout")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = synthetic_tokens(Path(tmp), args.vocab_size, 64 * 2049)
        for name in [m for m in args.models.split(",") if m]:
            rows.append(phases(args, name, data))
            print(show(rows[-1]), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
