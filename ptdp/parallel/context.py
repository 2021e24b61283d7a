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
plain causal one, which PyTorch's fused kernels take. Partial results merge through the
log-sum-exp: out = sum_j exp(lse_j - lse) out_j with lse = log sum_j exp(lse_j).

- ring (`parallel.cp_comm = ring`): keys/values rotate around the group, the transfer of
  the next block posted before the current one is computed; the backward rotates them
  again, with their gradients travelling along and arriving home after c shifts.
- allgather: keys/values (g heads, before the GQA repeat) are all-gathered, attention runs
  once against the whole window; the backward reduce-scatters their gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

import torch
import torch.nn.functional as F

from ptdp.config import CpComm
from ptdp.model.positions import TokenPositions
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


class Kind(Enum):
    FULL = "full"
    CAUSAL = "causal"
    MASKED = "masked"


@dataclass(frozen=True)
class Block:
    """The part of one source's keys that this rank's queries read."""

    rows: slice
    cols: slice
    kind: Kind
    mask: torch.Tensor | None = None
    """Bool [b or 1, 1, rows, cols] for MASKED."""


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


def _fused(block: Block, q: torch.Tensor) -> bool:
    """PyTorch's CPU flash kernel returns the log-sum-exp and takes it back in backward;
    it serves unmasked and causal blocks. Elsewhere (masks, CUDA) the reference path."""
    return block.kind is not Kind.MASKED and q.device.type == "cpu"


def _scores(q, k, block: Block, scale: float) -> torch.Tensor:
    """fp32 [b, n, r, c] scaled scores, -inf where the block's mask forbids."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if block.kind is Kind.CAUSAL:
        forbid = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(forbid, float("-inf"))
    elif block.kind is Kind.MASKED:
        s = s.masked_fill(~block.mask, float("-inf"))
    return s


def block_forward(q, k, v, block: Block, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out fp32 [b, n, r, d], lse fp32 [b, n, r]) of q [b, n, r, d] against k, v [b, n, c, d];
    rows that read nothing get out 0 and lse -inf."""
    if _fused(block, q):
        q, k, v = (x.contiguous() for x in (q, k, v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, block.kind is Kind.CAUSAL, scale=scale
        )
        return out.float(), lse.float()
    s = _scores(q, k, block, scale)
    lse = s.logsumexp(-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v.float(), lse


def block_backward(dout, q, k, v, out, lse, delta, block: Block, scale: float):
    """(dq, dk, dv) fp32 of one block, given the merged `out`, `lse` and delta =
    rowsum(dout * out) of its rows: the block's softmax is exp(scores - lse)."""
    if _fused(block, q):
        q, k, v, dout, out, lse = (
            x.contiguous() for x in (q, k, v, dout.to(q.dtype), out.to(q.dtype), lse)
        )
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, block.kind is Kind.CAUSAL, scale=scale
        )
        return tuple(g.float() for g in grads)
    p = torch.exp(_scores(q, k, block, scale) - lse[..., None])  # masked -> 0
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ v.float().transpose(-1, -2) - delta[..., None])
    return (ds @ k.float()) * scale, (ds.transpose(-1, -2) @ q.float()) * scale, dv


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
        b, n, s, d = q.shape
        # Laid out [b, s, n, d] as the fused kernels lay theirs: the layer's [s, b, n*d]
        # view of it then needs no copy (b = 1).
        out = torch.zeros(b, s, n, d, dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full((b, n, s), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp.size):
            works, nxt = [], None
            if step < cp.size - 1:  # posted before computing: the transfer overlaps
                nxt = torch.empty_like(kv)
                works = ring_shift_async(kv, nxt, cp)
            block = blocks[(cp.rank - step) % cp.size]
            if block is not None:
                kb, vb = (_repeat(x[:, :, block.cols], n) for x in kv)
                part = block_forward(q[:, :, block.rows], kb, vb, block, scale)
                _merge(out, lse, *part, block.rows)
            for work in works:
                work.wait()
            kv = nxt if nxt is not None else kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.cp, ctx.scale = blocks, cp, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, n, g = ctx.cp, q.shape[1], k.shape[1]
        dout = dout.float()
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(out)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        incoming: list = []  # the accumulator of this step's keys, on its way from rank i-1
        for step in range(cp.size):
            works, nxt = [], None
            if step < cp.size - 1:
                nxt = torch.empty_like(kv)
                works = ring_shift_async(kv, nxt, cp)
            block = ctx.blocks[(cp.rank - step) % cp.size]
            grads = None
            if block is not None:  # computed while both transfers run
                r, c = block.rows, block.cols
                kb, vb = (_repeat(x[:, :, c], n) for x in kv)
                grads = block_backward(
                    dout[:, :, r], q[:, :, r], kb, vb, out[:, :, r], lse[:, :, r],
                    delta[:, :, r], block, ctx.scale,
                )  # fmt: skip
                dq[:, :, r] += grads[0]
            for work in incoming:
                work.wait()
            if grads is not None:
                dkv[0, :, :, c] += _fold(grads[1], g)
                dkv[1, :, :, c] += _fold(grads[2], g)
            arrived = torch.empty_like(dkv)
            incoming = ring_shift_async(dkv, arrived, cp)  # on to the next rank
            for work in works:
                work.wait()
            sending = dkv  # kept alive until `incoming` (its send too) is waited on
            dkv, kv = arrived, (nxt if nxt is not None else kv)
        for work in incoming:  # after c shifts: this rank's own keys' gradients
            work.wait()
        del sending
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


# ----------------------------------------------------------------------------- entry point


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: TokenPositions,
    cp: Group,
    *,
    comm: CpComm = CpComm.RING,
    window: int = 0,
) -> torch.Tensor:
    """Attention of this rank's queries q [b, n, s, d] over the keys and values of the
    whole window, k, v [b, g, s, d] being this rank's (g divides n: GQA). `positions`
    are this rank's tokens' facts from `split_sequence`, with every rank's part as `keys`;
    returns [b, n, s, d]."""
    scale = 1.0 / q.shape[-1] ** 0.5
    keys = positions.keys
    if len(keys) != cp.size:
        raise ValueError("context attention needs the positions of `split_sequence` (their keys)")
    if comm is CpComm.ALLGATHER:
        k_all, v_all = (_repeat(gather_from_cp(x, cp, dim=2), q.shape[1]) for x in (k, v))
        every = TokenPositions(
            torch.cat([p.index for p in keys]),
            None,
            None if positions.document is None else torch.cat([p.document for p in keys], 1),
        )
        mask = positions.allowed(every, window)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)
    blocks = [plan_block(positions, key, window) for key in keys]
    with torch.autocast(q.device.type, enabled=False):  # blocks keep fp32 statistics
        return _RingAttention.apply(q, k, v, blocks, cp, scale)
