"""train.attention_backend: which kernel `scaled_dot_product_attention` runs.

PyTorch picks a kernel by a fixed priority (flash, then memory-efficient, then cuDNN or the
math reference, depending on the version), not by speed; on H100s cuDNN's attention can be
faster than flash for some head sizes and sequence lengths, slower for others. `auto`
times the fused CUDA kernels once, forward and backward on the run's own attention shape
and dtype, and keeps the fastest that runs. The kept (or named) kernel goes first in
PyTorch's priority order, the others stay behind it, so a call it refuses (a masked block:
flash takes no mask; an fp32 run) takes the next that accepts it, not the math reference.
On a CPU `auto` leaves PyTorch's own choice (its flash kernel or the reference: nothing to
time).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ptdp.config.enums import AttentionBackend

KERNELS = {
    AttentionBackend.FLASH: SDPBackend.FLASH_ATTENTION,
    AttentionBackend.CUDNN: SDPBackend.CUDNN_ATTENTION,
    AttentionBackend.EFFICIENT: SDPBackend.EFFICIENT_ATTENTION,
    AttentionBackend.MATH: SDPBackend.MATH,
}
CANDIDATES = (AttentionBackend.FLASH, AttentionBackend.CUDNN, AttentionBackend.EFFICIENT)
"""What `auto` times on CUDA (the math reference is never the fastest there)."""

Shape = tuple[int, int, int, int]
"""[b, n, s, d]: batch, heads, sequence, head size."""
Timer = Callable[[AttentionBackend, Shape, torch.dtype, torch.device], "float | None"]


def time_kernel(
    backend: AttentionBackend,
    shape: Shape,
    dtype: torch.dtype,
    device: torch.device,
    reps: int = 5,
) -> float | None:
    """Median seconds of one causal forward and backward on q, k, v of `shape` [b, n, s, d]
    with only `backend` allowed; None where it refuses the inputs or the GPU."""
    q, k, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for _ in "qkv")
    times = []
    try:
        with sdpa_kernel([KERNELS[backend]]):
            for rep in range(reps + 1):  # the first warms up
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
                torch.cuda.synchronize(device)
                if rep:
                    times.append(time.perf_counter() - start)
    except RuntimeError:  # "No available kernel" and the kernels' own refusals
        return None
    return statistics.median(times)


def pick_backend(
    choice: AttentionBackend,
    *,
    shape: Shape,
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer = time_kernel,
    value_dim: int = 0,
) -> AttentionBackend | None:
    """The kernel the run asks for; None leaves PyTorch's own choice (`auto` off CUDA, or
    where no fused kernel ran the shape). `value_dim`: the values' width where it is not
    the queries' (latent attention): FlashAttention then runs nothing and is not timed; the
    others are timed at the queries' width."""
    if choice is not AttentionBackend.AUTO:
        return choice
    if device.type != "cuda":
        return None
    candidates = list(CANDIDATES)
    if value_dim and value_dim != shape[-1]:
        candidates.remove(AttentionBackend.FLASH)
    ran = {c: t for c in candidates if (t := timer(c, shape, dtype, device)) is not None}
    return min(ran, key=ran.__getitem__) if ran else None


def unequal_widths_note(query_dim: int, value_dim: int) -> str:
    """Why FlashAttention does not run latent attention's heads (none where it can)."""
    if query_dim == value_dim:
        return ""
    return (
        f"attention: queries and keys {query_dim} wide, values {value_dim}: FlashAttention "
        "needs one width, so the memory-efficient or cuDNN kernel runs (on a CPU, PyTorch's "
        "reference)"
    )


FALLBACK = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.MATH,
)
"""Behind the chosen kernel, in this order: the math reference last."""


def priority(backend: AttentionBackend) -> list[SDPBackend]:
    """`backend` first, then every other kernel (each call takes the first that accepts it)."""
    return list(dict.fromkeys([KERNELS[backend], *FALLBACK]))


def attention_context(backend: AttentionBackend | None) -> contextlib.AbstractContextManager:
    """Around a forward and backward: `backend` first in PyTorch's priority order."""
    if backend is None:
        return contextlib.nullcontext()
    return sdpa_kernel(priority(backend), set_priority=True)
