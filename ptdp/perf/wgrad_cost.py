"""What the zero-bubble split of a backward costs on this device: ptdp's B (input gradients,
the linear layers' weight-gradient GEMMs kept) then W (those GEMMs, `ptdp.parallel.wgrad`)
against autograd's fused backward, on a chunk of ptdp's own layers. W reads each layer's
input and output gradient back from memory after B instead of while they are in cache,
and runs its GEMMs from Python: on the 2-vCPU Xeon of BENCHMARKS.md the split took
1.06-1.13 times the fused backward (benchmarks/split_backward.py)."""

from __future__ import annotations

import statistics
import time

import torch

from ptdp.perf.timing import Timing, synchronize

SPLIT_CHUNK = {"hidden_size": 128, "seq_length": 128, "num_heads": 4, "num_layers": 2}
"""Two layers at benchmarks/prediction.py's base size, batch 2: a pipeline stage's chunk
of its zero-bubble cases."""
SPLIT_ROUNDS = 9


def split_backward_ratio(dtype: torch.dtype, device: torch.device, timing: Timing) -> float:
    """(B + W) / fused backward seconds of `SPLIT_CHUNK`, median over rounds of each round's
    ratio (a round runs both, back to back, so a busy spell lands on both)."""
    from ptdp.config import ModelConfig
    from ptdp.model.gpt import GPT
    from ptdp.parallel.wgrad import accumulate_grads

    cfg = ModelConfig(**SPLIT_CHUNK, vocab_size=128, dropout=0.0)
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

    def fused() -> float:
        out = chunk(x)
        return timed(lambda: torch.autograd.backward(out, dy))

    def split() -> float:
        store = chunk.wgrad
        with store.capture():
            out = chunk(x)
        held: list = []

        def backward() -> None:
            with store.deferring(0):
                grads = torch.autograd.grad(out, [x, *params], dy, allow_unused=True)
            held.extend((p, g) for p, g in zip(params, grads[1:]) if g is not None)

        return timed(backward) + timed(lambda: accumulate_grads(held + store.flush(0)))

    ratios = []
    for round_ in range(max(SPLIT_ROUNDS, timing.trials) + 1):  # round 0 warms up
        for p in params:
            p.grad = None
        ratio = split() / fused()
        if round_:
            ratios.append(ratio)
    return statistics.median(ratios)
