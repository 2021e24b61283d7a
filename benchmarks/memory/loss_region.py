"""The loss region (final norm, output layer, cross-entropy): eager against compiled, and
the vocabulary padded (50,257 -> 50,304 rows) against not.

With a GPT-2 vocabulary the loss is the largest activation of the model: its [s, b, v]
logits are v / h = 65 times a layer's [s, b, h] hidden state at h = 768. Run eagerly,
`GPT.loss` writes the logits, the padding mask's copy, the float32 upcast and the
log-softmax, and autograd keeps the float32 log-probabilities for backward. Compiled
(`train.compile`, ptdp/model/compile.py) Inductor fuses mask, upcast and softmax, and keeps
the 16-bit logits instead. Measured per configuration, on ptdp's own `GPT.loss`:

* saved: bytes autograd keeps for backward (`saved_tensors_hooks`, each storage once,
  weights excluded), deterministic;
* peak: `torch.cuda.max_memory_allocated` above the inputs during forward + backward
  (CUDA only; CPU has no allocator statistics);
* ms: median forward + backward time over `--rounds` alternating rounds (compiled runs
  are warmed up first).

    python benchmarks/memory/loss_region.py                      # CPU: --tokens 1024
    python benchmarks/memory/loss_region.py --tokens 16384       # a GPU: 125M-sized microbatch
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ptdp.config.sections import ModelConfig
from ptdp.model.compile import apply_compile
from ptdp.model.gpt import GPT

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(args, padded: bool, compiled: bool, dtype: torch.dtype) -> GPT:
    cfg = ModelConfig(
        num_layers=1,  # only the head is used; one layer keeps the model small
        hidden_size=args.hidden,
        num_heads=max(1, args.hidden // 64),
        seq_length=args.tokens,
        vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=128 if padded else 1,
    )
    model = GPT(cfg, seed=0).to(args.device, dtype)
    if compiled:
        apply_compile([model])
    return model


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step(model: GPT, x: torch.Tensor, labels: torch.Tensor) -> tuple[float, int, float]:
    """One forward + backward: (loss, saved bytes, peak bytes above the start)."""
    device = x.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    # Plain hooks: record_saved_tensors' module hooks would make Dynamo recompile each call.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(x, labels)
    loss.backward()
    peak = torch.cuda.max_memory_allocated(device) - start if device.type == "cuda" else 0
    return loss.item(), sum(saved.values()), peak


def measure(args) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    tokens, batch = args.tokens, 1
    x0 = torch.randn(tokens, batch, args.hidden, generator=gen)
    labels = torch.randint(0, args.vocab_size, (batch, tokens), generator=gen)
    rows = []
    for precision in args.precisions.split(","):
        dtype = DTYPES[precision]
        cases = {
            (padded, compiled): build(args, padded, compiled, dtype)
            for padded in (False, True)
            for compiled in (False, True)
        }
        x = x0.to(args.device, dtype).requires_grad_()
        y = labels.to(args.device)
        got = {key: {"ms": []} for key in cases}
        for key, model in cases.items():  # warm-up: compilation, allocator
            for _ in range(2):
                got[key]["loss"], got[key]["saved"], got[key]["peak"] = step(model, x, y)
                model.zero_grad(set_to_none=True)
        for _ in range(args.rounds):  # alternate, so load on the machine hits every case
            for key, model in cases.items():
                _sync(args.device)
                begin = time.perf_counter()
                step(model, x, y)
                _sync(args.device)
                got[key]["ms"].append(1e3 * (time.perf_counter() - begin))
                model.zero_grad(set_to_none=True)
        base = statistics.median(got[(False, False)]["ms"])
        for (padded, compiled), g in got.items():
            ms = statistics.median(g["ms"])
            rows.append(
                {
                    "precision": precision,
                    "vocab_rows": cases[(padded, compiled)].cfg.padded_vocab_size(),
                    "compiled": compiled,
                    "loss": g["loss"],
                    "saved_mib": g["saved"] / 2**20,
                    "peak_mib": g["peak"] / 2**20,
                    "ms": ms,
                    "speedup": base / ms,
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| precision | vocabulary rows | compiled | loss | saved MiB | peak MiB | ms (median) "
        "| speed-up vs eager unpadded |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        peak = f"{r['peak_mib']:,.1f}" if r["peak_mib"] else "n/a"
        lines.append(
            f"| {r['precision']} | {r['vocab_rows']:,} | {'yes' if r['compiled'] else 'no'} | "
            f"{r['loss']:.5f} | {r['saved_mib']:,.1f} | {peak} | {r['ms']:,.1f} | "
            f"{r['speedup']:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024, help="s * b of one microbatch")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the rows and the machine to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.manual_seed(0)
    rows = measure(args)
    device = args.device
    if device.startswith("cuda"):
        device = torch.cuda.get_device_name()
    machine = f"{device} | {platform.machine()} | torch {torch.__version__}"
    print(f"{machine} | tokens {args.tokens} | h {args.hidden} | v {args.vocab_size}")
    print(table(rows))
    if args.json:
        out = {"machine": machine, "args": vars(args), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2))
    return rows


if __name__ == "__main__":
    main()
