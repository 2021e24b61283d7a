"""Where the time of one Table 1 layer goes at micro-batch 1, against first-principles floors.

For the paper's 7.5B (h 4096, t 4) and 18.4B (h 6144, t 8) rows at b = 1 (a100-80gb,
megatron-2021, full recomputation) the model's per-layer terms, one microbatch, in µs, next to
what each cannot be faster than on an A100-SXM4-80GB:
- GEMMs (linear layers and the unfused attention core): their FLOPs at 267.9 TFLOP/s, the
  maximum achievable bf16 matmul measured on one A100-SXM (S. Bekman, "Machine Learning
  Engineering", table "Maximum Achievable Matmul FLOPS": 85.9% of 312, 6912x16384x2048, CUDA 12.1);
- memory-bound kernels: the bytes of Megatron-LM 2021's kernels (its fused LayerNorm, fused
  scale-mask-softmax, fused bias-GeLU and bias-dropout-add, dropout on the probabilities with
  a byte mask) at the datasheet's 2039 GB/s;
- tensor-parallel all-reduces (6 a layer under full recomputation) and the data-parallel one:
  a ring's 2 (n-1)/n N bytes per GPU at the link's datasheet rate (NVLink 3 300 GB/s a
  direction; 25 GB/s a HDR card, k cards of a group on a node);
- the gradient accumulation pass: 6 bytes a parameter (16-bit gradient read, buffer read and
  written) at 2039 GB/s.
Model-only; no GPU runs.

    python benchmarks/perf_model/table1_breakdown.py                  # about 2 s
    python benchmarks/perf_model/table1_breakdown.py --roofline-core  # and Table 1 with it
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from unittest.mock import patch

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ptdp.config.enums import Precision, Recompute
from ptdp.perf.cost.collectives import all_reduce_seconds, group_link
from ptdp.perf.cost.costs import (
    Compute,
    Gemm,
    Passes,
    accumulation_seconds,
    attention_core,
    layer_gemms,
    layer_seconds,
)
from ptdp.perf.cost.hardware import System
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.layer_bytes import layer_activation_bytes
from ptdp.perf.cost.parameters import parameters_per_rank
from ptdp.perf.cost.software import MEGATRON_2021, PTDP, Software
from ptdp.perf.validate.paper import TABLE_1, Table1Row, paper_run, preset
from ptdp.perf.validate.validation import check_row

MATMUL = 267.9e12  # A100-SXM bf16, maximum achievable matmul (Bekman, above)
HBM = 2039e9  # A100-SXM4-80GB datasheet
NVLINK = 300e9  # per GPU per direction through NVSwitch
CARD = 25e9  # HDR InfiniBand, per card per direction


def kernel_bytes(n: int, h: int, heads: int, s: int, t: int) -> tuple[float, float]:
    """Forward and backward HBM bytes of Megatron-LM 2021's memory-bound kernels, one layer,
    n tokens (2-byte activations, 1-byte dropout masks): two LayerNorms, fused
    scale-mask-softmax, dropout on the probabilities, fused bias-GeLU, two fused
    bias-dropout-adds and the copy that lays the attention output out again."""
    e, scores, mlp = 2, heads // t * s * n, 4 * h // t * n
    forward = (
        2 * 2 * n * h * e  # LayerNorms: read, write
        + 2 * scores * e  # softmax: read, write
        + scores * (2 * e + 1)  # dropout: read, write, mask
        + 2 * mlp * e  # bias-GeLU: read, write
        + 2 * n * h * (3 * e + 1)  # bias-dropout-add: input, residual, output, mask
        + 2 * n * h // t * e  # context layer made contiguous
    )
    backward = (
        2 * 3 * n * h * e  # LayerNorms: input, gradient in, gradient out
        + 3 * scores * e  # softmax: output, gradient in, out
        + scores * (2 * e + 1)  # dropout
        + 3 * mlp * e  # GeLU: input, gradient in, out
        + 2 * n * h * (2 * e + 1)  # dropout-add: gradient, mask, gradient out
        + 2 * 3 * n * h * e  # the residual branches' gradients summed
        + 2 * n * h // t * e
    )
    return forward, backward


Term = tuple[str, float, float]
"""A term of one layer's time: its name, the model's seconds, the floor's seconds."""


def layer_terms(row: Table1Row, system: System) -> tuple[list[Term], float]:
    """The model's terms of one layer and microbatch at b = 1 with their floors, and the
    model's whole layer (with the accumulation pass) they should add up to."""
    c = Compute(system, Precision.BF16, MEGATRON_2021)
    m, t = paper_run(row, micro_batch=1, vpp=1).model, row.tp
    n, h, s = m.seq_length, m.hidden_size, m.seq_length
    gemms = layer_gemms(m, 1, t)
    lin, core = c.linears(gemms), attention_core(m, 1, t, c)
    kw = dict(micro_batch=1, tp=t, sequence_parallel=False, precision=c.precision)
    stored = layer_activation_bytes(m, recompute=Recompute.NONE, fused_attention=False, **kw)
    sw = c.software
    mem_f = c.stream(sw.elementwise_traffic * stored)
    mem_b = sw.backward_traffic_ratio * mem_f
    ar = all_reduce_seconds(n * h * c.e, t, group_link(system, t, 1))
    params = sum(g.n * g.k for g in gemms)
    acc = accumulation_seconds(params, len(gemms), c)
    total = layer_seconds(
        m, micro_batch=1, tp=t, sequence_parallel=False, recompute=Recompute.FULL, c=c
    )
    flops_lin = sum(g.flops for g in gemms) * 4  # F, recomputed F, dgrad, wgrad
    heads = m.num_heads // t
    flops_core = 4 * 2 * s * s * m.head_dim * heads * 2  # QK^T and PV: F, F again, 2 in B
    kf, kb = kernel_bytes(n, h, m.num_heads, s, t)
    rows = [
        ("linear GEMMs (F, F again, B, W)", 2 * lin.f + lin.b + lin.w, flops_lin / MATMUL),
        ("attention core GEMMs", 2 * core.f + core.b, flops_core / MATMUL),
        ("memory-bound kernels", 2 * mem_f + mem_b, (2 * kf + kb) / HBM),
        ("tp all-reduces (6)", 6 * ar, 6 * 2 * (t - 1) / t * n * h * c.e / NVLINK),
        ("accumulation pass", acc, 6 * params / HBM),
    ]
    return rows, total.f + total.b + total.w + acc


def row_table(name: str) -> None:
    row = next(r for r in TABLE_1 if r.name == name)
    system = load_system("a100-80gb")
    rows, layer = layer_terms(row, system)
    m, t, h = paper_run(row, micro_batch=1, vpp=1).model, row.tp, row.hidden
    sw = MEGATRON_2021
    kernels = sw.elementwise_kernels * (2 + sw.backward_traffic_ratio)
    launches = kernels * system.device.kernel_overhead
    check = check_row(row, system, micro_batch=1)
    p = check.option.prediction
    print(f"\n{row.name} (h {h}, t {t}, b 1): predicted {check.predicted:.1f} TFLOP/s, "
          f"published {row.tflops:.0f} ({100 * check.error:+.1f}%)")  # fmt: skip
    print("| term, one layer, one microbatch | model µs | floor µs | model / floor |")
    print("|---|---:|---:|---:|")
    for label, model_s, floor_s in rows:
        print(f"| {label} | {1e6 * model_s:.0f} | {1e6 * floor_s:.0f} | {model_s / floor_s:.2f} |")
    floors = sum(r[2] for r in rows)
    print(f"| layer (the model's; its launches, {1e6 * launches:.0f} µs, hidden) | "
          f"{1e6 * layer:.0f} | {1e6 * floors:.0f} | {layer / floors:.2f} |")  # fmt: skip
    d = row.gpus // (t * row.pp)
    grads = 2 * max(parameters_per_rank(m, t, row.pp))  # fp16 gradients of a rank
    cards = max(1, system.gpus_per_node // t)  # a dp group's GPUs (and cards) on a node
    floor = 2 * (d - 1) / d * grads / (cards * CARD)
    print(f"step {p.iteration_seconds:.3f} s: data-parallel all-reduce {p.dp_seconds:.3f} s "
          f"(d {d}; floor {floor:.3f} s), optimizer {p.optimizer_seconds:.3f} s")  # fmt: skip


def tp_speedups() -> None:
    """One layer of h 2048 (16 heads, s 2048, ptdp's software, no recomputation) at
    t = 1..8: the model's speed-up, and how many kernels a layer runs one after another
    (each GEMM, the fused attention, the memory-bound kernels, the collectives), which a
    fixed gap between dependent kernels would charge once each."""
    system = load_system("a100-80gb")
    c = Compute(system, Precision.BF16, PTDP)
    m = replace(paper_run(TABLE_1[0], micro_batch=1, vpp=1).model, hidden_size=2048)
    m = replace(m, num_heads=16)
    memory_bound = round(PTDP.elementwise_kernels * (2 + PTDP.backward_traffic_ratio))
    serial = 3 * 4 + 2 + memory_bound
    print(
        f"\none layer, h 2048, a 16, s 2048 (ptdp, a100-80gb): {serial} kernels in series"
        f" (12 GEMMs, 2 attention, {memory_bound} memory-bound), and 4 all-reduces at t > 1"
    )
    print("| b | t = 1 µs | speed-up at t = 2 / 4 / 8 | t = 8 µs |")
    print("|---:|---:|---|---:|")
    for b in (1, 2, 4):
        times = []
        for t in (1, 2, 4, 8):
            layer = layer_seconds(
                m, micro_batch=b, tp=t, sequence_parallel=False, recompute=Recompute.NONE, c=c
            )
            times.append(layer.f + layer.b + layer.w)
        ups = " / ".join(f"{times[0] / x:.2f}" for x in times[1:])
        print(f"| {b} | {1e6 * times[0]:.0f} | {ups} | {1e6 * times[-1]:.0f} |")


def roofline_core(model, micro_batch: int, tp: int, c: Compute) -> Passes:  # noqa: ANN001
    """The unfused attention core with each batched GEMM at the slower of its math and its
    HBM traffic (a roofline), where the model adds the two: the variant `--roofline-core`
    weighs."""
    if c.software.fused_attention:
        return attention_core(model, micro_batch, tp, c)
    s, d = model.seq_length, model.head_dim
    heads = micro_batch * model.num_heads // tp
    scores, values = Gemm(s, s, d, heads), Gemm(s, d, s, heads)
    eff = c.system.device.gemm_efficiency

    def run(g: Gemm) -> float:
        return max(g.flops / (c.peak * eff), g.nbytes(c.e) / c.bandwidth)

    forward = run(scores) + run(values)
    backward = sum(run(g.dgrad()) + run(g.wgrad()) for g in (scores, values))
    return Passes(forward, backward, 0.0)


def korthikanti_layer(sw: Software) -> tuple[float, float]:
    """Milliseconds of the 22B layer (h 6144, 64 heads, t 8, b 4, no recomputation) that
    calibrates the memory-bound terms: forward, and backward less the two all-reduces its code
    hid (Korthikanti et al., Table 4: 7.7 and 11.9 ms; tests/unit/test_perf_simulator.py)."""
    system = load_system("a100-80gb")
    c = Compute(system, Precision.BF16, sw)
    layer = layer_seconds(
        preset("gpt-22b"), micro_batch=4, tp=8, sequence_parallel=False,
        recompute=Recompute.NONE, c=c,
    )  # fmt: skip
    hidden = 2 * all_reduce_seconds(4 * 2048 * 6144 * 2, 8, group_link(system, 8, 1))
    return 1e3 * layer.f, 1e3 * (layer.b + layer.w - hidden)


def refit(target: tuple[float, float]) -> Software:
    """MEGATRON_2021 with `elementwise_traffic`, then `backward_traffic_ratio`, bisected
    until the 22B layer takes `target` again (under whatever core is patched in)."""
    sw = MEGATRON_2021
    for field, index in (("elementwise_traffic", 0), ("backward_traffic_ratio", 1)):
        low, high = 0.5, 4.0
        for _ in range(40):
            mid = (low + high) / 2
            fast = korthikanti_layer(replace(sw, **{field: mid}))[index] < target[index]
            low, high = (mid, high) if fast else (low, mid)
        sw = replace(sw, **{field: low})
    return sw


def table_1(note: str) -> None:
    system = load_system("a100-80gb")
    print(f"\nTable 1, {note}:")
    print("| model | b = 1 | planner's b |")
    print("|---|---|---|")
    for row in TABLE_1:
        one, free = check_row(row, system, micro_batch=1), check_row(row, system)
        b = free.option.config.train.micro_batch_size
        print(f"| {row.name} | {one.predicted:.1f} ({100 * one.error:+.1f}%) | "
              f"{b}: {free.predicted:.1f} ({100 * free.error:+.1f}%) |")  # fmt: skip


def roofline_variants() -> None:
    """Table 1 with the core at its roofline, the memory-bound terms as they are and
    re-calibrated on the 22B layer (their source), so the layer keeps its measured time."""
    target = korthikanti_layer(MEGATRON_2021)
    with patch("ptdp.perf.cost.costs.attention_core", roofline_core):
        moved = korthikanti_layer(MEGATRON_2021)
        table_1(
            f"the unfused attention core at its roofline; the 22B layer {moved[0]:.2f} / "
            f"{moved[1]:.2f} ms (the model: {target[0]:.2f} / {target[1]:.2f})"
        )
        sw = refit(target)
        with patch("ptdp.perf.validate.validation.MEGATRON_2021", sw):
            table_1(
                "and the memory-bound terms re-calibrated on the 22B layer: elementwise_traffic "
                f"{sw.elementwise_traffic:.3f}, backward_traffic_ratio "
                f"{sw.backward_traffic_ratio:.3f} (the model: {MEGATRON_2021.elementwise_traffic}"
                f", {MEGATRON_2021.backward_traffic_ratio})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--roofline-core", action="store_true",
        help="also Table 1 with the unfused attention core's GEMMs at their roofline",
    )  # fmt: skip
    args = parser.parse_args()
    for name in ("gpt-7.5b", "gpt-18.4b", "gpt-145.6b"):
        row_table(name)
    tp_speedups()
    if args.roofline_core:
        roofline_variants()


if __name__ == "__main__":
    main()
