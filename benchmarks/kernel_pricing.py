"""The memory-bound term of a layer, priced one kernel at a time, against a profile.

Issue 22, items 2 and 5: why the one-process rows of benchmarks/prediction.py were over-
predicted by up to 30%. For each one-process configuration of that benchmark, ptdp's GPT
runs a forward and backward of one microbatch under torch.profiler (one thread), and the
self time of its memory-bound ops (norms, activations, adds, copies, fills, sums: the
`MEMORY_OPS` below; not the GEMMs, attention, the loss or the embedding) is set beside what
the model charges the layers for them from a calibration file:

- "median term": `Software.elementwise_traffic` x the bytes a layer stores, at the median
  kernel's bandwidth past the caches (the model before kernels.py, still used for files
  without `[device.achieved.memory_kernels]`);
- "per kernel": `ptdp.perf.kernels.layer_traffic`, each kernel at its own measured bandwidth
  for the bytes it moves.

    python benchmarks/kernel_pricing.py --calibration runs/benchmarks/calibration.toml

Prints a markdown table; writes nothing.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from ptdp.config import ModelConfig, Precision
from ptdp.model.gpt import GPT
from ptdp.perf.costs import PTDP, Compute
from ptdp.perf.hardware import load_system
from ptdp.perf.kernels import layer_traffic
from ptdp.perf.memory import layer_activation_bytes

try:
    from benchmarks.prediction import BASE, CASES
except ModuleNotFoundError:  # run as `python benchmarks/x.py`
    from prediction import BASE, CASES

MEMORY_OPS = {
    "aten::native_layer_norm", "aten::native_layer_norm_backward", "aten::_fused_rms_norm",
    "aten::gelu", "aten::gelu_backward", "aten::silu", "aten::silu_backward",
    "aten::add", "aten::add_", "aten::mul", "aten::copy_", "aten::fill_", "aten::sum",
    "aten::clone", "aten::cat", "aten::zero_",
}  # fmt: skip
"""Memory-bound ops of a layer pass as the profiler names them."""


def _layer_sized(shapes: list, tokens: int, hidden: int) -> bool:
    """An op on activations (its first input holds at least one [tokens, hidden] tensor's
    elements), not on parameters, scalars or the head's logits."""
    first = shapes[0] if shapes else []
    return bool(first) and math.prod(first) >= tokens * hidden


def measured_ms(model: ModelConfig, micro_batch: int, repeats: int = 5) -> float:
    """Median over `repeats` of the layer-sized memory-bound ops' self time in one forward +
    backward of the layers (the head's and embedding's are left out: at most 2 of each)."""
    torch.manual_seed(0)
    gpt = GPT(model)
    tokens = torch.randint(0, model.vocab_size, (micro_batch, model.seq_length))
    n = micro_batch * model.seq_length
    runs = []
    for i in range(repeats + 2):
        gpt.zero_grad(set_to_none=True)
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
        ) as prof:
            gpt(tokens, tokens).backward()
        ops = prof.key_averages(group_by_input_shape=True)
        total = sum(
            e.self_cpu_time_total
            for e in ops
            if e.key in MEMORY_OPS and _layer_sized(e.input_shapes, n, model.hidden_size)
        )
        if i >= 2:  # two warm-up passes
            runs.append(total / 1e3)
    return statistics.median(runs)


def modelled_ms(model: ModelConfig, micro_batch: int, calibration: str) -> tuple[float, float]:
    """(median term, per kernel) ms of the layers' memory-bound work, forward + backward."""
    system = load_system(calibration)
    c = Compute(system, Precision.FP32, PTDP)
    stored = layer_activation_bytes(model, micro_batch=micro_batch, precision=Precision.FP32)
    single = c.stream(PTDP.elementwise_traffic * stored) * (1 + PTDP.backward_traffic_ratio)
    f, b = layer_traffic(
        model, micro_batch=micro_batch, tp=1, sequence_parallel=False, e=4, device=system.device
    )
    return 1e3 * model.num_layers * single, 1e3 * model.num_layers * (f + b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibration", required=True, help="a `ptdp calibrate` file")
    args = parser.parse_args()
    if not load_system(args.calibration).device.memory_kernels:
        raise SystemExit(f"{args.calibration} has no [device.achieved.memory_kernels]: rerun "
                         "`ptdp calibrate` (this version) to measure each kernel")  # fmt: skip
    torch.set_num_threads(1)
    print("| config | measured ms | median term ms | error | per kernel ms | error |")
    print("|---|---:|---:|---:|---:|---:|")
    for case in (c for c in CASES if c.world == 1 and not c.parallel):
        model = ModelConfig(**{**BASE["model"], **case.model, "vocab_size": 256})
        b = case.train.get("micro_batch_size", BASE["train"]["micro_batch_size"])
        got = measured_ms(model, b)
        single, kernels = modelled_ms(model, b, args.calibration)
        print(
            f"| {case.name} | {got:.2f} | {single:.2f} | {100 * (single / got - 1):+.0f}% "
            f"| {kernels:.2f} | {100 * (kernels / got - 1):+.0f}% |",
            flush=True,
        )


if __name__ == "__main__":
    main()
