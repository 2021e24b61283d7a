"""Tensor parallelism on CPU ranks (gloo): bytes moved, and ptdp's layers against DTensor.

1. Bytes: one training step of the demo model at tp=2 (sequence parallelism off, then on),
   with every collective of ptdp/parallel/comm.py counted, against the formula (each
   all-reduce carries b*s*h elements, 4 per layer per microbatch).
2. Speed: a stack of the demo model's transformer layers at tp=2, forward + backward,
   built (a) from ptdp's ColumnParallelLinear/RowParallelLinear and (b) from the same
   layers with nn.Linear parallelised by PyTorch's DTensor `parallelize_module`
   (ColwiseParallel for QKV and fc1, RowwiseParallel for proj and fc2), same weights,
   same input, rounds alternating; median step time of each and the ratio.

    python benchmarks/parallelism/tensor_parallel.py [--steps 10 --rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.spawn import spawn
from ptdp.config.files import apply_updates, load_toml
from ptdp.model.gpt import GPT, TPContext, TransformerLayer
from ptdp.model.init import apply_init
from ptdp.parallel import comm
from ptdp.parallel.comm import Group
from ptdp.parallel.grads import reduce_sequence_parallel_grads

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("_all_reduce", "_all_gather", "_reduce_scatter")


def demo_model(vocab: int = 4096):
    cfg = load_toml(ROOT / "configs" / "demo.toml")
    return apply_updates(cfg, {"model": {"vocab_size": vocab}}, "benchmark")


def count_step(tp: Group, sp: bool, micro: int, batch: int) -> list[tuple[str, int]]:
    """(kind, full-tensor elements) of every collective in one step of batch/micro microbatches."""
    cfg = demo_model()
    model = GPT(cfg.model, tp=tp, sequence_parallel=sp)
    seen: list[tuple[str, int]] = []
    originals = {k: getattr(comm, k) for k in KINDS}

    def counting(kind):
        def wrapper(x, *args, **kwargs):
            full = x.numel() * (tp.size if kind == "_all_gather" else 1)
            seen.append((kind.strip("_"), full))
            return originals[kind](x, *args, **kwargs)

        return wrapper

    for kind in KINDS:
        setattr(comm, kind, counting(kind))
    try:
        torch.manual_seed(0)
        s = cfg.model.seq_length
        for _ in range(batch // micro):
            tokens = torch.randint(0, cfg.model.vocab_size, (micro, s + 1))
            (model(tokens[:, :-1], tokens[:, 1:]) / (batch // micro)).backward()
        if sp:
            reduce_sequence_parallel_grads(model, model.roles, tp)
    finally:
        for kind, fn in originals.items():
            setattr(comm, kind, fn)
    return seen


def ring_bytes(kind: str, elements: int, t: int, itemsize: int = 4) -> float:
    """Bytes each rank sends in a ring collective of a full tensor of `elements`."""
    factor = 2 * (t - 1) / t if kind == "all_reduce" else (t - 1) / t
    return factor * elements * itemsize


def describe_counts(seen: list[tuple[str, int]], sp: bool, cfg, t: int) -> str:
    m, tr = cfg.model, cfg.train
    micro = tr.global_batch_size // tr.micro_batch_size
    bsh = tr.micro_batch_size * m.seq_length * m.hidden_size
    big = [k for k, n in seen if n == bsh]
    counts = {k: big.count(k) for k in ("all_reduce", "all_gather", "reduce_scatter")}
    moved = sum(ring_bytes(k, n, t) for k, n in seen)
    layer_formula = 8 * bsh * (t - 1) / t * m.num_layers * micro * 4  # paper, fp32 bytes
    extra_formula = 2 * 2 * bsh * (t - 1) / t * micro * 4  # embedding fwd + output bwd
    return (
        f"| {'on' if sp else 'off'} | {counts['all_reduce']} | {counts['all_gather']} | "
        f"{counts['reduce_scatter']} | {moved / 2**20:.2f} | {layer_formula / 2**20:.2f} | "
        f"{(layer_formula + extra_formula) / 2**20:.2f} |"
    )


def linear_copy(module: nn.Module) -> nn.Linear:
    """An nn.Linear with the weights of a (tp = 1) ColumnParallel/RowParallelLinear."""
    out_f, in_f = module.weight.shape
    linear = nn.Linear(in_f, out_f, bias=module.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(module.weight)
        if module.bias is not None:
            linear.bias.copy_(module.bias)
    return linear


def dtensor_layers(cfg, tp_size: int) -> nn.ModuleList:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (tp_size,))
    layers = nn.ModuleList()
    for i in range(cfg.num_layers):
        layer = TransformerLayer(cfg, TPContext())
        apply_init(layer, seed=i, base_std=0.02, num_layers=cfg.num_layers)
        for parent, name in (
            (layer.attn, "qkv"),
            (layer.attn, "proj"),
            (layer.mlp, "fc1"),
            (layer.mlp, "fc2"),
        ):
            setattr(parent, name, linear_copy(getattr(parent, name)))
        layer.attn.num_heads //= tp_size  # each rank computes its own heads
        layer.attn.groups //= tp_size
        plan = {
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(),
        }
        layers.append(parallelize_module(layer, mesh, plan))
    return layers


def ptdp_layers(cfg, tp: Group) -> nn.ModuleList:
    layers = nn.ModuleList()
    for i in range(cfg.num_layers):
        layer = TransformerLayer(cfg, TPContext(tp))
        apply_init(layer, seed=i, base_std=0.02, num_layers=cfg.num_layers, tp=tp)
        layers.append(layer)
    return layers


def time_layers(layers: nn.ModuleList, x: torch.Tensor, steps: int) -> float:
    """Median seconds of forward + backward through the stack."""
    times = []
    for i in range(steps + 2):
        dist.barrier()
        start = time.perf_counter()
        h = x
        for layer in layers:
            h = layer(h)
        h.float().pow(2).mean().backward()
        dist.barrier()
        if i >= 2:  # the first two are warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(rank: int, world: int, steps: int, rounds: int) -> str:
    """The report's lines (rank 0's are printed)."""
    tp = Group(None, world, rank)
    cfg = demo_model()
    m, t = cfg.model, cfg.train
    lines = [
        f"demo model, tp={world}, one step = {t.global_batch_size // t.micro_batch_size} "
        f"microbatches of b={t.micro_batch_size}, s={m.seq_length}, h={m.hidden_size}, "
        f"L={m.num_layers} (fp32)",
        "| sequence parallel | all-reduces of b*s*h | all-gathers of b*s*h | "
        "reduce-scatters of b*s*h | MiB sent per rank, counted (ring) | layer formula "
        "8bsh(t-1)/t x L x m, MiB | + embedding and output layer, MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for sp in (False, True):
        seen = count_step(tp, sp, t.micro_batch_size, t.global_batch_size)
        lines.append(describe_counts(seen, sp, cfg, world))
    x = torch.randn(m.seq_length, t.micro_batch_size, m.hidden_size)
    dist.broadcast(x, 0)
    ours, theirs = [], []
    ours_layers = ptdp_layers(m, tp)
    their_layers = dtensor_layers(m, world)
    for _ in range(rounds):
        ours.append(time_layers(ours_layers, x, steps))
        theirs.append(time_layers(their_layers, x, steps))
    mo, mt = statistics.median(ours), statistics.median(theirs)
    lines.append(
        f"{m.num_layers} layers h={m.hidden_size} s={m.seq_length} b={t.micro_batch_size}, "
        f"tp={world}, forward+backward: ptdp {mo * 1e3:.1f} ms | DTensor {mt * 1e3:.1f} ms | "
        f"ptdp/DTensor time = {mo / mt:.3f} (rounds: ptdp "
        + ", ".join(f"{v * 1e3:.1f}" for v in ours)
        + "; DTensor "
        + ", ".join(f"{v * 1e3:.1f}" for v in theirs)
        + ")"
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(spawn(worker, 2, args.steps, args.rounds))
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, gloo, 1 thread per rank")


if __name__ == "__main__":
    main()
