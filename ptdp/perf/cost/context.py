"""Context parallelism in the performance model: each sequence split over cp ranks.

A cp rank holds 2 of the sequence's 2 cp chunks (i and 2 cp - 1 - i), s/cp tokens, so
everything token-wise (the linears, norms, MLP, the stored activations, the pipeline
boundary, the output layer) is the model at s/cp tokens (`local_model`), while causal
attention is balanced: each rank computes 1/cp of the s x s causal score blocks, cp times
what an s/cp-token sequence would.

Bytes. One K/V block is the keys and values of one rank's tokens, on its g/t key/value
heads (g = query groups, d = head size, e = bytes per element):

    kv = 2 b (s/cp) g d e / t

Ring (`parallel.cp_comm = ring`), per layer and microbatch, each rank sends
    forward   (cp - 1) kv        the blocks pass around the ring, one hop per step
    backward  (2 cp - 1) kv      the blocks again, cp - 1 hops, and their gradients dK/dV,
                                 cp hops (each gradient travels the whole ring, back home)
Each step's transfer runs while the block in hand is computed (posted ahead), so the
exposed time is max(0, transfer - block) per step, a block being 1/cp of the rank's
attention; in the backward a step moves a K/V block and a dK/dV block, and the last hop of
the gradients is exposed.

All-gather (`allgather`, Llama 3's choice): the forward all-gathers K/V (each rank
receives (cp - 1) kv) and the attention runs over the whole sequence's K/V, which autograd
keeps for the backward; the backward reduce-scatters dK/dV ((cp - 1) kv sent). Attention
waits for both, so both are exposed.

Recomputation (selective or full) reruns the attention forward in the backward, its
transfers included.

Memory. Activations are those of the s/cp-token model; all-gather also keeps the gathered
K/V, (cp - 1) kv more per layer (none under full recomputation, which keeps only the layer
input). Transient (`working_bytes`): the ring holds two K/V blocks (in hand and arriving)
and two dK/dV blocks, 4 kv; all-gather the gathered dK/dV before the reduce-scatter, cp kv.

Links. Ranks are ordered tp, cp, dp, pp: a cp group is cp ranks tp apart. It stays on
NVLink while tp cp <= GPUs per node; past that its ring crosses the network, and every
hop is as slow as the slowest, one GPU's own card (`ring_link`); the all-gather is a ring
collective over the group (`collectives.group_link`).

Gradients. Parameters are replicated over cp; their gradients are reduced over the dp cp
ranks (tp apart) in one collective, and ZeRO shards the model state over that group.
"""

from __future__ import annotations

from dataclasses import replace

from ptdp.config.enums import CpComm, Recompute
from ptdp.config.sections import ModelConfig


def local_model(model: ModelConfig, cp: int) -> ModelConfig:
    """The model as one cp rank sees it token-wise: s/cp tokens."""
    return model if cp == 1 else replace(model, seq_length=model.seq_length // cp)


def kv_block_bytes(model: ModelConfig, *, micro_batch: int, tp: int, cp: int, e: int) -> float:
    """kv: keys and values of one rank's s/cp tokens on its g/t key/value heads (module doc);
    under mla every head's key (p + r) and value (dv): the ring exchanges them, not latents."""
    tokens = micro_batch * model.seq_length // cp
    width = model.qk_head_dim + model.value_head_dim
    return 1.0 * tokens * model.query_groups * width * e / tp


def ring_bytes(kv: float, cp: int) -> tuple[float, float]:
    """Bytes one rank sends per layer and microbatch in the ring: (forward, backward)."""
    if cp == 1:
        return 0.0, 0.0
    return (cp - 1) * kv, (2 * cp - 1) * kv


def allgather_bytes(kv: float, cp: int) -> tuple[float, float]:
    """Bytes one rank sends per layer and microbatch with all-gather: (forward, backward)."""
    return (cp - 1) * kv, (cp - 1) * kv


def stored_bytes_per_layer(
    model: ModelConfig,
    *,
    micro_batch: int,
    tp: int,
    cp: int,
    comm: CpComm,
    recompute: Recompute,
    e: int,
) -> float:
    """Stored for backward beyond the s/cp-token layer's activations: all-gather's K/V."""
    if cp == 1 or comm is not CpComm.ALLGATHER or recompute is Recompute.FULL:
        return 0.0
    return (cp - 1) * kv_block_bytes(model, micro_batch=micro_batch, tp=tp, cp=cp, e=e)


def working_bytes(
    model: ModelConfig, *, micro_batch: int, tp: int, cp: int, comm: CpComm, e: int
) -> float:
    """Transient bytes of a layer's attention under cp: blocks in flight (module doc)."""
    if cp == 1:
        return 0.0
    kv = kv_block_bytes(model, micro_batch=micro_batch, tp=tp, cp=cp, e=e)
    return cp * kv if comm is CpComm.ALLGATHER else 4 * kv
