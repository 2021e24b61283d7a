"""Context parallelism on CPU ranks (gloo): activation memory, bytes moved, step time.

1. Activation memory per rank against the sequence length at cp = 1, 2, 4: what autograd
   saves in one GPT-2 layer of the demo width (h = 256, 8 heads) running its part of the
   window (`ptdp.perf.cost.activations.record_saved_tensors`), against cp = 1's bytes / cp
   (every saved tensor is per local token: ring attention keeps only q, k, v, its output
   and the log-sum-exp, no s x s matrix). From the bytes per token: the longest window
   whose layer activations fit a budget (--budget-mib) at each cp.
2. Bytes each rank sends per layer, ring against all-gather, counted at the calls
   (ring: every tensor handed to `ring_shift_async`; all-gather: (c-1) x its input,
   reduce-scatter: (c-1)/c x its input, the ring algorithms' per-rank traffic) against
   the formula with s = S/c, g key/value heads of size d, e bytes per element:
   ring forward (c-1) 2bgsd e, backward (c-1) 2bgsd e + c 2bgsd 4 (gradients in fp32);
   all-gather forward (c-1) 2bgsd e, backward (c-1) 2bgsd e.
3. Step time of cp = 2 against dp = 2 at the same global batch (forward, backward and the
   gradient all-reduce of a 2-layer model of the demo width), 2 ranks with one thread
   each, alternating rounds, medians; and the fraction of the ring's transfer time hidden
   behind block compute: 1 - (time waiting on transfers inside attention) / (time of the
   same transfers alone).

    python benchmarks/parallelism/context.py [--seqs 1024,2048,4096,8192 --part 1|2|3|all]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ptdp.parallel.context as context
from benchmarks.common.spawn import spawn
from ptdp.config.enums import CpComm
from ptdp.config.sections import ModelConfig
from ptdp.model.gpt import GPT, TPContext, TransformerLayer
from ptdp.model.positions import TokenPositions
from ptdp.parallel import comm
from ptdp.parallel.mesh import MeshShape, ParallelMesh
from ptdp.perf.cost.activations import record_saved_tensors

WIDTH = {"hidden_size": 256, "num_heads": 8, "num_layers": 2, "vocab_size": 4096}


def _model_cfg(seq: int, **extra) -> ModelConfig:
    return ModelConfig(**WIDTH, seq_length=seq, **extra)


def _positions(seq: int, cp: comm.Group) -> TokenPositions:
    return TokenPositions.contiguous(seq).select(context.local_index(seq, cp.size, cp.rank))


# ------------------------------------------------------------------------------- 1: memory


def _memory(rank: int, world: int, seqs: list[int], batch: int) -> dict:
    mesh = ParallelMesh.build(MeshShape(cp=world), rank)
    cp = mesh.axis("cp")
    out = {}
    for seq in seqs:
        cfg = _model_cfg(seq)
        layer = TransformerLayer(cfg, TPContext(cp=cp))
        x = torch.randn(seq // world, batch, cfg.hidden_size, requires_grad=True)
        pos = _positions(seq, cp) if world > 1 else None
        run = lambda x, layer=layer, pos=pos: layer(x, positions=pos)  # noqa: E731
        y, saved = record_saved_tensors(layer, x, forward=run)
        out[seq] = sum(s.nbytes for s in saved)
        del y, saved
    return out


def part_memory(seqs: list[int], batch: int, budget_mib: float) -> None:
    print(f"## 1. activation bytes per rank of one layer (h=256, b={batch}, fp32)\n")
    measured = {cp: spawn(_memory, cp, seqs, batch) if cp > 1 else None for cp in (1, 2, 4)}
    measured[1] = _memory_single(seqs, batch)
    print("| S | cp=1 MiB | cp=2 MiB | x2 / cp=1 | cp=4 MiB | x4 / cp=1 |")
    print("|---:|---:|---:|---:|---:|---:|")
    mib = 2**20
    for seq in seqs:
        one, two, four = (measured[c][str(seq)] for c in (1, 2, 4))
        print(
            f"| {seq} | {one / mib:.2f} | {two / mib:.2f} | {2 * two / one:.3f} | "
            f"{four / mib:.2f} | {4 * four / one:.3f} |"
        )
    per_token = measured[1][str(seqs[-1])] / seqs[-1]
    fits = {cp: int(budget_mib * mib * cp / per_token) for cp in (1, 2, 4)}
    print(
        f"\nbytes per token of the window at cp=1: {per_token:.0f}; longest window whose "
        f"layer activations fit {budget_mib:.0f} MiB per rank: "
        + ", ".join(f"cp={cp}: {n:,} tokens" for cp, n in fits.items())
        + "\n"
    )


def _memory_single(seqs: list[int], batch: int) -> dict:
    out = {}
    for seq in seqs:
        cfg = _model_cfg(seq)
        layer = TransformerLayer(cfg, TPContext())
        x = torch.randn(seq, batch, cfg.hidden_size, requires_grad=True)
        _, saved = record_saved_tensors(layer, x)
        out[str(seq)] = sum(s.nbytes for s in saved)
    return out


# ------------------------------------------------------------------------------- 2: bytes


def _counting(sent: list[int]):
    """Wrap the context-parallel transfers to count the bytes each rank sends."""
    shift, gather, scatter = context.ring_shift_async, comm._all_gather, comm._reduce_scatter

    def ring(send, recv, g):
        sent.append(send.numel() * send.element_size())
        return shift(send, recv, g)

    def all_gather(x, g, dim):
        sent.append((g.size - 1) * x.numel() * x.element_size())
        return gather(x, g, dim)

    def reduce_scatter(x, g, dim):
        sent.append((g.size - 1) * x.numel() * x.element_size() // g.size)
        return scatter(x, g, dim)

    context.ring_shift_async, comm._all_gather, comm._reduce_scatter = (
        ring,
        all_gather,
        reduce_scatter,
    )
    return lambda: (
        setattr(context, "ring_shift_async", shift),
        setattr(comm, "_all_gather", gather),
        setattr(comm, "_reduce_scatter", scatter),
    )


def _bytes(rank: int, world: int, seq: int, batch: int, groups: int) -> dict:
    cp = ParallelMesh.build(MeshShape(cp=world), rank).axis("cp")
    s, n, d = seq // world, 8, 32
    q = torch.randn(batch, n, s, d, requires_grad=True)
    k, v = (torch.randn(batch, groups, s, d, requires_grad=True) for _ in range(2))
    pos = _positions(seq, cp)
    out = {}
    for how in CpComm:
        for phase in ("forward", "backward"):
            sent: list[int] = []
            restore = _counting(sent)
            if phase == "forward":
                y = context.context_attention(q, k, v, pos, cp, comm=how)
            else:
                y.sum().backward()
            restore()
            # the key positions' all-gather (index ids, S/c longs) is not key/value traffic
            ids = (world - 1) * s * 8 if phase == "forward" else 0
            out[f"{how.value} {phase}"] = sum(sent) - ids
    return out


def part_bytes(seq: int, batch: int) -> None:
    print(f"## 2. bytes each rank sends per layer (S={seq}, b={batch}, d=32, fp32)\n")
    print("| cp | g | how | phase | counted | formula | counted / formula |")
    print("|---:|---:|---|---|---:|---:|---:|")
    for world in (2, 4):
        for groups in (8, 2):
            got = spawn(_bytes, world, seq, batch, groups)
            s, e = seq // world, 4
            kv = 2 * batch * groups * s * 32
            formula = {
                "ring forward": (world - 1) * kv * e,
                "ring backward": (world - 1) * kv * e + world * kv * 4,
                "allgather forward": (world - 1) * kv * e,
                "allgather backward": (world - 1) * kv * e,
            }
            for name, expect in formula.items():
                how, phase = name.split()
                print(
                    f"| {world} | {groups} | {how} | {phase} | {got[name]:,} | {expect:,} | "
                    f"{got[name] / expect:.3f} |"
                )
    print()


# ------------------------------------------------------------------------------- 3: time


class _Timed:
    """A transfer's works, with the time spent waiting on them recorded."""

    def __init__(self, works, waits: list[float]):
        self.works, self.waits = works, waits

    def wait(self):
        start = time.perf_counter()
        for w in self.works:
            w.wait()
        self.waits.append(time.perf_counter() - start)


def _step_time(rank: int, world: int, seq: int, batch: int, steps: int, rounds: int) -> dict:
    """cp=2 and dp=2 alternate on the same 2 ranks: the same tokens per rank."""
    ring_mesh = ParallelMesh.build(MeshShape(cp=world), rank)
    dp_mesh = ParallelMesh.build(MeshShape(dp=world), rank)
    cfg = _model_cfg(seq)
    cp = ring_mesh.axis("cp")
    models = {"cp": GPT(cfg, cp=cp), "dp": GPT(cfg)}
    tokens = torch.randint(0, cfg.vocab_size, (batch * world, seq), generator=torch.Generator())
    cp_tok = tokens[:, context.local_index(seq, world, rank)]
    dp_tok = tokens[rank * batch : (rank + 1) * batch]
    pos = _positions(seq, cp)
    waits: list[float] = []
    shift = context.ring_shift_async

    def step(name: str) -> None:
        model = models[name]
        x = cp_tok if name == "cp" else dp_tok
        loss = model(x, x, positions=pos if name == "cp" else None)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        comm.all_reduce_tensors_(
            grads, (ring_mesh if name == "cp" else dp_mesh).axis("dp_cp"), average=True
        )
        for p in model.parameters():
            p.grad = None

    times: dict[str, list[float]] = {"cp": [], "dp": []}
    for r in range(rounds):
        for name in ("cp", "dp") if r % 2 == 0 else ("dp", "cp"):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step(name)
            times[name].append((time.perf_counter() - start) / steps)
    # Waiting inside attention, then the same transfers alone.
    context.ring_shift_async = lambda send, recv, g: [_Timed(shift(send, recv, g), waits)]
    sizes: list[tuple[torch.Size, torch.dtype]] = []
    record = context.ring_shift_async
    context.ring_shift_async = lambda send, recv, g: (
        sizes.append((send.shape, send.dtype)) or record(send, recv, g)
    )
    dist.barrier()
    step("cp")
    context.ring_shift_async = shift
    exposed = sum(waits)
    dist.barrier()
    start = time.perf_counter()
    for shape, dtype in sizes:
        a, b = torch.zeros(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        for w in shift(a, b, cp):
            w.wait()
    alone = time.perf_counter() - start
    return {
        "cp": statistics.median(times["cp"]),
        "dp": statistics.median(times["dp"]),
        "exposed": exposed,
        "alone": alone,
        "transfers": len(sizes),
    }


def part_time(seq: int, batch: int, steps: int, rounds: int) -> None:
    got = spawn(_step_time, 2, seq, batch, steps, rounds, timeout_s=1800)
    print(f"## 3. step time, 2 layers of h=256, S={seq}, {2 * batch} sequences per step\n")
    print("| layout | median s/step |")
    print("|---|---:|")
    print(f"| dp=2 ({batch} sequences per rank) | {got['dp']:.3f} |")
    print(f"| cp=2 ({2 * batch} half-sequences per rank) | {got['cp']:.3f} |")
    print(f"| ratio cp / dp | **{got['cp'] / got['dp']:.3f}** |")
    hidden = 1 - got["exposed"] / got["alone"] if got["alone"] else float("nan")
    print(
        f"\nring transfers in one step: {got['transfers']}; alone {got['alone'] * 1e3:.1f} ms, "
        f"waited on inside attention {got['exposed'] * 1e3:.1f} ms: hidden fraction "
        f"{max(hidden, 0.0):.2f}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1024,2048,4096,8192")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget-mib", type=float, default=1024.0)
    parser.add_argument("--time-seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--part", default="all", choices=["1", "2", "3", "all"])
    args = parser.parse_args()
    torch.manual_seed(0)
    seqs = [int(x) for x in args.seqs.split(",")]
    if args.part in ("1", "all"):
        part_memory(seqs, args.batch, args.budget_mib)
    if args.part in ("2", "all"):
        part_bytes(seqs[0], args.batch)
    if args.part in ("3", "all"):
        part_time(args.time_seq, args.batch, args.steps, args.rounds)


if __name__ == "__main__":
    main()
