"""Autoregressive sampling from a GPT split into pipeline stages (one chunk per process).

Shapes: b = samples, t = tokens so far, s = tokens a step reads, h = hidden.

Each decoding step runs the stages in order, as one forward pass would: the first stage
embeds the tokens the step reads (the whole prompt at first, in one pass, then the newest
token), every stage runs its layers with its own KV cache (its layers' keys and values
only), sends its hidden states [s, b, h] to the next stage point to point, and the last
stage turns them into logits and picks the next token. That token is broadcast over the
pipeline group, so every stage extends the same text and takes the same next step (same
window, same cache length). Only the last stage draws from the generator, seeded as one
process seeds it, so the samples are one process's. Under tensor parallelism too, each
rank exchanges with the ranks of its own tensor coordinate in the neighbouring stages,
and the last stage's ranks, holding the same gathered logits and generators, draw the
same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ptdp.model.generate import pick_next, step_input
from ptdp.model.gpt import GPT
from ptdp.model.kv_cache import KVCache
from ptdp.parallel.comm import Group, broadcast_, send_recv_async


@dataclass(frozen=True)
class StagePeers:
    """This process's pipeline: its group over the stages (its rank there is its stage)
    and the global rank of every stage's process at its tensor coordinate."""

    pp: Group
    ranks: tuple[int, ...]

    @property
    def stage(self) -> int:
        return self.pp.rank

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp.size - 1


def _post(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
    """Send and receive (tensor, global peer rank) pairs together and wait for all."""
    works = send_recv_async(
        [(t.contiguous(), p, 0) for t, p in sends], [(t, p, 0) for t, p in recvs]
    )
    for work in works:
        work.wait()


def warm_up(peers: StagePeers, device: torch.device) -> None:
    """One tiny exchange around the ring of stages that every process joins: NCCL wants
    every rank in the first batched send/receive, and links each pair once, up front."""
    n = peers.pp.size
    if n == 1:
        return
    after, before = peers.ranks[(peers.stage + 1) % n], peers.ranks[(peers.stage - 1) % n]
    _post([(torch.zeros(1, device=device), after)], [(torch.empty(1, device=device), before)])


@torch.no_grad()
def generate_pipelined(
    chunk: GPT,
    peers: StagePeers,
    tokens: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    stop_token: int | None = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """`generate` for this process's stage `chunk`: extend tokens [b, t] (the same on every
    process) by up to max_new_tokens; every process returns the same tokens."""
    chunk.eval()
    cfg = chunk.cfg
    cache = KVCache(cfg.seq_length) if use_cache else None
    dtype = next(chunk.parameters()).dtype
    warm_up(peers, tokens.device)
    for _ in range(max_new_tokens):
        inputs, step_cache = step_input(tokens, cfg.seq_length, cache)
        x = inputs
        if not peers.is_first:
            b, s = inputs.shape
            x = torch.empty(s, b, cfg.hidden_size, dtype=dtype, device=tokens.device)
            _post([], [(x, peers.ranks[peers.stage - 1])])
        out = chunk(x, cache=step_cache)  # hidden [s, b, h]; logits [b, s, v] on the last
        nxt = torch.empty(tokens.shape[0], 1, dtype=tokens.dtype, device=tokens.device)
        if peers.is_last:
            logits = out[:, -1, :].float()
            nxt.copy_(pick_next(logits, temperature, top_k, top_p, generator))
        else:
            _post([(out, peers.ranks[peers.stage + 1])], [])
        broadcast_(nxt, peers.pp, peers.pp.size - 1)
        tokens = torch.cat([tokens, nxt], dim=1)
        if stop_token is not None and bool((nxt == stop_token).all()):
            break
    return tokens
