"""Activation memory per layer: what autograd saves in ptdp's layer, against Korthikanti et al.

One GPT-2 transformer layer (`ptdp.model.gpt.TransformerLayer`, t = 1, training mode)
runs forward on an [s, b, h] input under `torch.autograd.graph.saved_tensors_hooks`
(`ptdp.perf.cost.activations.record_saved_tensors`): every tensor saved for backward is
recorded, each storage counted once (q, k, v are views of one QKV output), weights
excluded. Then backward runs under the same attention backend (recomputation must pick the
kernel the forward used). Each recompute mode (none / selective / full) is compared with

* paper: Korthikanti et al. 2022 (arXiv 2205.05198), `activation_bytes_per_layer`, at our
  element size (4 bytes fp32, 2 bf16) with the paper's 1-byte dropout masks;
* ours: `ptdp_terms`, the same component list corrected for PyTorch's kernels (it must
  equal the measurement; the last column checks it).

Attention kernels on CPU: with dropout the math kernel (the only one that supports it);
without dropout the default picks the fused flash kernel, or the math kernel is forced
with `sdpa_kernel(SDPBackend.MATH)`. bf16 means bf16 weights under autocast, as
`ptdp train --train.precision bf16` runs.

Why measured and paper differ, term by term (the notes column lists each difference in
bytes per s*b*h element):
* masks: CPU's dropout multiplies by a mask of the input's dtype (4 bytes fp32, 2 bf16);
  the paper assumes 1 byte (CUDA's native_dropout keeps a bool mask).
* LN stats: LayerNorm also saves its mean and 1/std, [s, b] each; the paper omits them
  (they are 1/h of an input).
* q,k copies: the math kernel scales q and k by d^-1/4 before QK^T and saves the scaled
  copies (2 s b h), while Q and K also stay inside the QKV output (next point).
* QKV buffer: q, k, v are views of one [s, b, 3h] QKV output, so saving v (or the
  checkpoint's q, k, v) keeps all of it: 3 s b h, the paper's Q, K, V. In bf16 the CPU math
  kernel computes in fp32 and saves fp32 copies instead (v: 4 bytes x s b h), and the bf16
  buffer is freed.
* s x s in fp32: for the same reason the bf16 softmax output and dropout output are 4 bytes
  per element, not 2; in fp32 they are exactly the paper's terms.
* fused (flash) attention saves q, k, v, its output (= the projection's input, one
  storage) and an fp32 logsumexp [b, a, s]: no s x s tensor at all, so "none" is already
  below the paper and selective recomputation saves only the logsumexp.
* Agreement: GeLU (tanh) saves only its input and fc2 its output, 8 + 8 bytes per sbh in
  16-bit as the paper counts; layer-norm, QKV, projection and fc1 inputs agree; full
  recomputation keeps exactly one tensor, the layer input.

    python benchmarks/memory/activation_memory.py [--seq 256 --batch 2 --hidden 128 --heads 8]
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ptdp.config.enums import Recompute
from ptdp.config.sections import ModelConfig
from ptdp.model.gpt import TPContext, TransformerLayer
from ptdp.perf.cost.activations import (
    Kernels,
    Saved,
    Term,
    activation_bytes_per_layer,
    paper_terms,
    ptdp_terms,
    record_saved_tensors,
)

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (dropout, attention kernel): CPU's fused kernel has no dropout.
CASES = [(True, "math"), (False, "math"), (False, "fused")]
NOTE_GROUPS = {  # note label -> term keys whose paper-vs-ours differences it sums
    "masks": ("attn_mask", "mlp_mask", "score_mask"),
    "LN stats": ("norm_stats",),
    "q,k copies": ("qk_scaled",),
    "QKV buffer": ("qkv",),
    "s x s": ("softmax", "score_dropout"),
    "logsumexp": ("lse",),
}


def measure(args, mode: str, precision: str, dropout: bool, kernel: str) -> list[Saved]:
    dtype = PRECISIONS[precision]
    cfg = ModelConfig(
        hidden_size=args.hidden,
        num_heads=args.heads,
        seq_length=args.seq,
        dropout=0.1 if dropout else 0.0,
    )
    torch.manual_seed(0)
    layer = TransformerLayer(cfg, TPContext(), Recompute(mode)).to(dtype).train()
    x = torch.randn(args.seq, args.batch, args.hidden, dtype=dtype, requires_grad=True)
    backend = sdpa_kernel(SDPBackend.MATH) if kernel == "math" else contextlib.nullcontext()
    with backend, torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out, records = record_saved_tensors(layer, x)
        out.float().sum().backward()  # recomputation happens here, under the same kernel
    return records


def classify(records: list[Saved], args) -> dict[str, int]:
    """Measured bytes per term key, from where each tensor was saved and its shape."""
    s, b, h, a = args.seq, args.batch, args.hidden, args.heads
    out: dict[str, int] = defaultdict(int)
    masks = iter(["attn_mask", "mlp_mask"])
    s2_4d = iter(["softmax", "score_mask"])  # [b, a, s, s]: softmax output, then its mask
    other_3d = iter(["qk_scaled", "qk_scaled", "qkv"])  # math kernel: k, q scaled, then v
    for r in records:
        if r.nbytes == 0:
            continue
        if r.where.endswith("(checkpoint input)"):
            key = "qkv" if r.where.startswith("attn") else "input"
        elif r.where in ("norm1", "norm2"):
            key = "norm_stats" if r.shape[-1] == 1 else "norm_inputs"
        elif r.where == "dropout":
            key = next(masks)
        elif r.where == "attn":
            if r.shape == (b, a, s):
                key = "lse"
            elif r.shape[-2:] == (s, s):
                key = next(s2_4d) if len(r.shape) == 4 else "score_dropout"
            elif len(r.shape) == 4:  # fused kernel: a q/k/v view (whole buffer), or its output
                itemsize = torch.empty(0, dtype=getattr(torch, r.dtype)).element_size()
                key = "qkv" if r.nbytes == 3 * s * b * h * itemsize else "proj_input"
            else:
                key = next(other_3d)
        else:
            key = {
                "attn.qkv": "qkv_input",
                "attn.proj": "proj_input",
                "mlp.fc1": "fc1_input",
                "mlp": "gelu_input",
                "mlp.fc2": "fc2_input",
            }.get(r.where, f"other: {r.where}")
        out[key] += r.nbytes
    return dict(out)


def by_key(terms: list[Term]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for t in terms:
        out[t.key] += t.bytes
    return dict(out)


def notes(ours: dict[str, float], paper: dict[str, float], sbh: int) -> str:
    parts = []
    for label, keys in NOTE_GROUPS.items():
        diff = sum(ours.get(k, 0) - paper.get(k, 0) for k in keys) / sbh
        if diff:
            parts.append(f"{label} {diff:+.4g}")
    return ", ".join(parts) or "agree"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    args = parser.parse_args()
    s, b, h, a = args.seq, args.batch, args.hidden, args.heads
    sbh = s * b * h
    shape = {"seq": s, "micro_batch": b, "hidden": h, "heads": a}
    print(
        f"torch {torch.__version__}, {platform.machine()} CPU; one GPT-2 layer, s={s} b={b} "
        f"h={h} a={a} (d={h // a}, 5as/h={5 * a * s / h:g}), f=4h, t=1; s*b*h={sbh:,}\n"
    )
    header = (
        "| precision | attention | dropout | recompute | measured B/layer | paper B/layer "
        "| measured/paper | ours (model) | notes: ours - paper, bytes per s*b*h |"
    )
    print(header)
    print("|" + "---|" * 4 + "---:|" * 4 + "---|")
    breakdowns = []
    for precision, dtype in PRECISIONS.items():
        e = torch.empty(0, dtype=dtype).element_size()
        for dropout, kernel in CASES:
            for mode in ("none", "selective", "full"):
                records = measure(args, mode, precision, dropout, kernel)
                measured = sum(r.nbytes for r in records)
                common = {**shape, "recompute": mode, "bytes_per_element": e, "dropout": dropout}
                paper = activation_bytes_per_layer(**common)
                kernels = Kernels.cpu(e, fused_attention=kernel == "fused")
                ours = ptdp_terms(**common, kernels=kernels)
                model = sum(t.bytes for t in ours)
                check = "= measured" if model == measured else f"{model:,.0f} (differs!)"
                note = notes(by_key(ours), by_key(paper_terms(**common)), sbh)
                print(
                    f"| {precision} | {kernel} | {'yes' if dropout else 'no'} | {mode} "
                    f"| {measured:,} | {paper:,.0f} | {measured / paper:.3f} | {check} | {note} |"
                )
                if mode == "none":
                    breakdowns.append((precision, kernel, dropout, common, ours, records))
    for precision, kernel, dropout, common, ours, records in breakdowns:
        print(
            f"\nPer term, {precision}, {kernel} attention, dropout {'on' if dropout else 'off'}, "
            "no recompute (bytes per s*b*h):"
        )
        print("| term | paper | ours (model) | measured | ours: what is stored |")
        print("|---|---:|---:|---:|---|")
        paper_b, ours_b = by_key(paper_terms(**common)), by_key(ours)
        measured_b = classify(records, args)
        what = {t.key: t.what for t in ours}
        for key in dict.fromkeys([*paper_b, *ours_b, *measured_b]):
            cells = [f"{d[key] / sbh:.4g}" if key in d else "-" for d in (paper_b, ours_b)]
            got = f"{measured_b[key] / sbh:.4g}" if key in measured_b else "-"
            print(f"| {key} | {cells[0]} | {cells[1]} | {got} | {what.get(key, '(not stored)')} |")
        totals = [sum(d.values()) / sbh for d in (paper_b, ours_b, measured_b)]
        print("| total | " + " | ".join(f"{t:.4g}" for t in totals) + " | |")


if __name__ == "__main__":
    main()
