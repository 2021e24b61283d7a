"""What the zero-bubble split of a backward costs on this device: ptdp's B (input gradients,
the linear layers' weight-gradient GEMMs kept) then W (those GEMMs, `ptdp.parallel.wgrad`)
against autograd's fused backward, on a chunk of ptdp's own layers. W reads each layer's
input and output gradient back from memory after B instead of while they are in cache,
and runs its GEMMs from Python, and the forward before it keeps the linear layers' inputs
for W: on the 2-vCPU Xeon of BENCHMARKS.md B + W took 1.06-1.22 times the fused backward
(benchmarks/pipeline/split_backward.py), the forward 7% more."""

from __future__ import annotations

import statistics
import time

import torch

from ptdp.perf.calibrate.timing import Timing, synchronize

SPLIT_CHUNK = {"hidden_size": 128, "seq_length": 128, "num_heads": 4, "num_layers": 2}
"""Two layers at benchmarks/perf_model/prediction.py's base size, batch 2: a pipeline stage's chunk
of its zero-bubble cases (CPUs)."""
GPU_SPLIT_CHUNK = {"hidden_size": 2048, "seq_length": 2048, "num_heads": 16, "num_layers": 2}
"""Two layers of the 1.3B GPT (benchmarks/speed/mfu.py's shape), batch 2 (GPUs): on a CPU-sized
chunk a GPU measures its launches, not the GEMMs a real stage runs."""
SPLIT_ROUNDS = 9


def split_chunk(device: torch.device) -> dict[str, int]:
    """The chunk whose split `split_backward_ratio` measures on `device`."""
    return GPU_SPLIT_CHUNK if device.type == "cuda" else SPLIT_CHUNK


def split_backward_ratio(dtype: torch.dtype, device: torch.device, timing: Timing) -> float:
    """1 + what the split costs beyond the fused backward, over the fused backward, on
    `split_chunk(device)`: (F under capture - F) + (B + W - fused backward). The forward counts too:
    under `capture` the linear layers keep their inputs for W (0.23 ms more a forward of the
    chunk, 3.39 against 3.16 ms, on the 2-vCPU Xeon; B + W alone gave 1.12-1.22 there).
    The median over rounds of each round's ratio (a round runs both, back to back, so a
    busy spell lands on both)."""
    from ptdp.config.sections import ModelConfig
    from ptdp.model.gpt import GPT
    from ptdp.parallel.wgrad import accumulate_grads

    cfg = ModelConfig(**split_chunk(device), vocab_size=128, dropout=0.0)
    chunk = GPT(cfg, seed=0, has_embedding=False, has_head=False).to(device=device, dtype=dtype)
    params = list(chunk.parameters())
    shape = (cfg.seq_length, 2, cfg.hidden_size)
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, device=device, dtype=dtype)

    def timed(fn) -> float:
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - start

    def fused() -> tuple[float, float]:
        """(forward, backward) seconds."""
        out: list = []
        forward = timed(lambda: out.append(chunk(x)))
        return forward, timed(lambda: torch.autograd.backward(out[0], dy))

    def split() -> float:
        """Forward under capture + B + W seconds."""
        store = chunk.wgrad
        outs: list = []

        def forward() -> None:
            with store.capture():
                outs.append(chunk(x))

        took = timed(forward)
        out = outs[0]
        held: list = []

        def backward() -> None:
            with store.deferring(0):
                grads = torch.autograd.grad(out, [x, *params], dy, allow_unused=True)
            held.extend((p, g) for p, g in zip(params, grads[1:]) if g is not None)

        return took + timed(backward) + timed(lambda: accumulate_grads(held + store.flush(0)))

    def clear() -> None:
        """Each side assigns its parameters' gradients, as training's buffers leave `.grad`
        empty, rather than one side adding into what the other left."""
        for p in params:
            p.grad = None

    ratios = []
    for round_ in range(max(SPLIT_ROUNDS, timing.trials) + 1):  # round 0 warms up
        clear()
        whole = split()
        clear()
        forward, backward = fused()
        if round_:
            ratios.append((whole - forward) / backward)
    return statistics.median(ratios)
