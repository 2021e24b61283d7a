"""Context parallelism: each rank of a cp group holds a part of every sequence.

Shapes: b = micro-batch, n = local query heads, g = local key/value groups, d = head size,
S = the full window, s = S/c its local part, c = the cp size.

The split is load-balanced for causal attention: the window is cut into 2c chunks and
rank i keeps chunks i and 2c-1-i (`local_index`), so every rank holds one early and one
late chunk and does the same attention work. Tokens keep their original positions
(`TokenPositions.index`), which decide the mask; document ids travel with them.

Attention over the whole window is assembled from blocks, one per source rank of the
keys. A block's mask (`TokenPositions.allowed`) is trimmed to its rows and columns that
have any allowed pair: a block with none is skipped, and under the balanced split with
no documents every other block becomes a full (unmasked) half-block and the own block a
plain causal one, which PyTorch's fused kernels take (`ptdp.parallel.blocks` computes a
block and says which kernel runs it). Partial results merge through the log-sum-exp:
out = sum_j exp(lse_j - lse) out_j with lse = log sum_j exp(lse_j). The blocks (or the
all-gather's mask) are planned once per microbatch, by its first attention layer.

- ring (`parallel.cp_comm = ring`): keys/values rotate around the group, the transfer of
  the next block posted before the current one is computed; the backward rotates them
  again, with their gradients travelling along and arriving home after c shifts.
- allgather: keys/values (g heads, before the GQA repeat) are all-gathered, attention runs
  once against the whole window; the backward reduce-scatters their gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from ptdp.config.enums import CpComm
from ptdp.model.positions import TokenPositions
from ptdp.parallel.blocks import Block, Kind, block_backward, block_forward
from ptdp.parallel.comm import Group, gather_from_cp, ring_shift_async


def local_index(seq_length: int, cp: int, rank: int) -> torch.Tensor:
    """[S/c] long: the window offsets rank `rank` keeps, chunks rank and 2c-1-rank."""
    if seq_length % (2 * cp):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2*cp = {2 * cp}")
    chunk = seq_length // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def split_sequence(
    tokens: torch.Tensor, labels: torch.Tensor, positions: TokenPositions | None, cp: Group
) -> tuple[torch.Tensor, torch.Tensor, TokenPositions | None]:
    """This rank's part of a microbatch ([b, S] -> [b, S/c]); positions stay the window's."""
    if cp.size == 1:
        return tokens, labels, positions
    seq = tokens.shape[1]
    full = TokenPositions.contiguous(seq, tokens.device) if positions is None else positions
    # Every rank loads the whole window, so each knows every rank's part: no gather needed.
    parts = tuple(
        full.select(local_index(seq, cp.size, r).to(tokens.device)) for r in range(cp.size)
    )
    local = local_index(seq, cp.size, cp.rank).to(tokens.device)
    return tokens[:, local], labels[:, local], replace(parts[cp.rank], keys=parts)


# ----------------------------------------------------------------------------- blocks


def _sorted(index: torch.Tensor) -> bool:
    return bool((index[1:] > index[:-1]).all())


def _plan_causal(q: torch.Tensor, k: torch.Tensor) -> Block | None:
    """Causal order only, both indices increasing: the rows reading anything are a suffix,
    the keys read a prefix, found from the indices alone (no s x s mask at long context)."""
    r0 = int(torch.searchsorted(q, k[0]))  # first query at or after the first key
    c1 = int(torch.searchsorted(k, q[-1], right=True))  # keys up to the last query
    if r0 == len(q) or c1 == 0:
        return None
    r, c = slice(r0, len(q)), slice(0, c1)
    if k[c1 - 1] <= q[r0]:  # every such query reads every such key
        return Block(r, c, Kind.FULL)
    if len(q) - r0 == c1 and bool((q[r] == k[c]).all()):  # the same tokens: lower triangle
        return Block(r, c, Kind.CAUSAL)
    return Block(r, c, Kind.MASKED, (k[None, None, c] <= q[None, r, None])[:, None])


def plan_block(queries: TokenPositions, keys: TokenPositions, window: int) -> Block | None:
    """The trimmed block of `keys` read by `queries`; None if no query reads any key."""
    plain = not window and queries.document is None and keys.document is None
    if plain and _sorted(queries.index) and _sorted(keys.index):
        return _plan_causal(queries.index, keys.index)
    mask = queries.allowed(keys, window)
    rows = mask.any(dim=3).any(dim=0)[0].nonzero()
    if rows.numel() == 0:
        return None
    cols = mask.any(dim=2).any(dim=0)[0].nonzero()
    r, c = slice(int(rows[0]), int(rows[-1]) + 1), slice(int(cols[0]), int(cols[-1]) + 1)
    sub = mask[:, :, r, c]
    if bool(sub.all()):
        return Block(r, c, Kind.FULL)
    causal = torch.ones(sub.shape[-2:], dtype=torch.bool, device=sub.device).tril()
    if sub.shape[-1] == sub.shape[-2] and bool((sub == causal).all()):
        return Block(r, c, Kind.CAUSAL)
    return Block(r, c, Kind.MASKED, sub)


def _repeat(x: torch.Tensor, n: int) -> torch.Tensor:
    """[b, g, s, d] -> [b, n, s, d]: each group serves n/g consecutive query heads."""
    return x if x.shape[1] == n else x.repeat_interleave(n // x.shape[1], dim=1)


def _fold(grad: torch.Tensor, g: int) -> torch.Tensor:
    """[b, n, s, d] -> [b, g, s, d]: sum the gradients of the heads sharing a group."""
    b, n, s, d = grad.shape
    return grad if n == g else grad.view(b, g, n // g, s, d).sum(2)


def _merge(out, lse, part_out, part_lse, rows: slice) -> None:
    """Fold a block's partial result into the running (out, lse) rows, in place."""
    old = lse[..., rows]
    new = torch.logaddexp(old, part_lse)
    a = torch.exp(old - new).nan_to_num(0.0)[..., None]  # both -inf: nothing yet, weight 0
    b = torch.exp(part_lse - new).nan_to_num(0.0)[..., None]
    out[..., rows, :] = out[..., rows, :] * a + part_out * b
    lse[..., rows] = new


# ----------------------------------------------------------------------------- ring


class _RingAttention(torch.autograd.Function):
    """Ring attention: c steps, step t computing the keys of rank (i - t) mod c while the
    next block's transfer runs. The key/value gradients accumulate on a buffer that
    travels with the keys and reaches their owner after c shifts."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, cp: Group, scale: float):
        b, n, s, _ = q.shape
        # Laid out [b, s, n, dv] as the fused kernels lay theirs: the layer's [s, b, n*dv]
        # view of it then needs no copy (b = 1).
        out = torch.zeros(b, s, n, v.shape[-1], dtype=torch.float32, device=q.device)
        out = out.transpose(1, 2)
        lse = torch.full((b, n, s), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], -1)  # one buffer travels: [b, g, s, d + dv]
        dk = k.shape[-1]
        runs: list = [None] * cp.size  # per source: the kernel and what its backward needs
        for step in range(cp.size):
            works, nxt = [], None
            if step < cp.size - 1:  # posted before computing: the transfer overlaps
                nxt = torch.empty_like(kv)
                works = ring_shift_async(kv, nxt, cp)
            source = (cp.rank - step) % cp.size
            block = blocks[source]
            if block is not None:
                kb, vb = (_repeat(x, n) for x in kv[:, :, block.cols].split([dk, v.shape[-1]], -1))
                part_out, part_lse, runs[source] = block_forward(
                    q[:, :, block.rows], kb, vb, block, scale
                )
                _merge(out, lse, part_out, part_lse, block.rows)
            for work in works:
                work.wait()
            kv = nxt if nxt is not None else kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.runs, ctx.cp, ctx.scale = blocks, runs, cp, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, n, g = ctx.cp, q.shape[1], k.shape[1]
        dout = dout.float()
        delta = (dout * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, dk = torch.cat([k, v], -1), k.shape[-1]
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        incoming: list = []  # the accumulator of this step's keys, on its way from rank i-1
        for step in range(cp.size):
            works, nxt = [], None
            if step < cp.size - 1:
                nxt = torch.empty_like(kv)
                works = ring_shift_async(kv, nxt, cp)
            source = (cp.rank - step) % cp.size
            block = ctx.blocks[source]
            grads = None
            if block is not None:  # computed while both transfers run
                r, c = block.rows, block.cols
                kb, vb = (_repeat(x, n) for x in kv[:, :, c].split([dk, v.shape[-1]], -1))
                grads = block_backward(
                    dout[:, :, r], q[:, :, r], kb, vb, out[:, :, r], lse[:, :, r],
                    delta[:, :, r], block, ctx.scale, ctx.runs[source],
                )  # fmt: skip
                dq[:, :, r] += grads[0]
            for work in incoming:
                work.wait()
            if grads is not None:
                dkv[:, :, c, :dk] += _fold(grads[1], g)
                dkv[:, :, c, dk:] += _fold(grads[2], g)
            arrived = torch.empty_like(dkv)
            incoming = ring_shift_async(dkv, arrived, cp)  # on to the next rank
            for work in works:
                work.wait()
            sending = dkv  # kept alive until `incoming` (its send too) is waited on
            dkv, kv = arrived, (nxt if nxt is not None else kv)
        for work in incoming:  # after c shifts: this rank's own keys' gradients
            work.wait()
        del sending
        dk_, dv_ = dkv[..., :dk].to(k.dtype), dkv[..., dk:].to(v.dtype)
        return dq.to(q.dtype), dk_, dv_, None, None, None


# ----------------------------------------------------------------------------- entry point


def _planned(positions: TokenPositions, key: tuple, plan: Callable[[], Any]) -> Any:
    """`plan()` made once per microbatch, kept on its positions: every attention layer (and
    a recomputed forward) reads the same blocks or mask, which depend on positions alone."""
    if key not in positions.plans:
        positions.plans[key] = plan()
    return positions.plans[key]


def _window_mask(positions: TokenPositions, window: int) -> torch.Tensor:
    """Bool [b or 1, 1, s, S]: what this rank's queries may read of the whole window."""
    keys = positions.keys
    every = TokenPositions(
        torch.cat([p.index for p in keys]),
        None,
        None if positions.document is None else torch.cat([p.document for p in keys], 1),
    )
    return positions.allowed(every, window)


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: TokenPositions,
    cp: Group,
    *,
    comm: CpComm = CpComm.RING,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries q [b, n, s, d] over the keys and values of the
    whole window, k [b, g, s, d] and v [b, g, s, dv] being this rank's (g divides n: GQA;
    dv = d but for latent attention). `positions` are this rank's tokens' facts from
    `split_sequence`, with every rank's part as `keys`; returns [b, n, s, dv]. `scale`:
    the softmax's, default 1 / sqrt(d)."""
    scale = scale if scale is not None else 1.0 / q.shape[-1] ** 0.5
    keys = positions.keys
    if len(keys) != cp.size:
        raise ValueError("context attention needs the positions of `split_sequence` (their keys)")
    if comm is CpComm.ALLGATHER:
        k_all, v_all = (_repeat(gather_from_cp(x, cp, dim=2), q.shape[1]) for x in (k, v))
        mask = _planned(positions, (comm, window), lambda: _window_mask(positions, window))
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)
    blocks = _planned(
        positions, (comm, window), lambda: [plan_block(positions, key, window) for key in keys]
    )
    with torch.autocast(q.device.type, enabled=False):  # blocks keep fp32 statistics
        return _RingAttention.apply(q, k, v, blocks, cp, scale)
