"""The attention's linear layers as a model config implies them, in one place for the rules
(float8's widths), the performance model (weights, GEMMs, FLOPs, bytes) and the planner.

Multi-head attention has two: the fused QKV [h -> a d + 2 g d] (column-parallel) and the
projection [a d -> h] (row-parallel). Multi-head latent attention (model.attention = mla,
`ptdp.model.latent_attention`) has five: the queries' down-projection [h -> q_lora]
(replicated; absent at q_lora_rank = 0), their up-projection [q_lora or h -> a (p + r)]
(column), the keys' and values' down-projection [h -> c + r] (replicated), their
up-projection [c -> a (p + dv)] (column) and the projection [a dv -> h] (row).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ptdp.config.sections import ModelConfig


class Split(Enum):
    """How tensor parallelism splits a linear layer."""

    COLUMN = "column"  # output features over t
    ROW = "row"  # input features over t
    NONE = "none"  # replicated


@dataclass(frozen=True)
class Linear:
    """One linear layer: `inputs` -> `outputs` features, split as `split` says."""

    name: str
    inputs: int
    outputs: int
    split: Split

    def local_inputs(self, tp: int) -> int:
        return self.inputs // tp if self.split is Split.ROW else self.inputs

    def local_outputs(self, tp: int) -> int:
        return self.outputs // tp if self.split is Split.COLUMN else self.outputs

    @property
    def weights(self) -> int:
        return self.inputs * self.outputs


def attention_linears(model: ModelConfig) -> list[Linear]:
    """The attention's linear layers in the order the forward runs them (module doc)."""
    h, a = model.hidden_size, model.num_heads
    if not model.is_mla:
        q = a * model.head_dim
        qkv = q + 2 * model.query_groups * model.head_dim
        return [Linear("qkv", h, qkv, Split.COLUMN), Linear("proj", q, h, Split.ROW)]
    qr, c, r = model.q_lora_rank, model.kv_lora_rank, model.qk_rope_head_dim
    p, dv = model.qk_nope_head_dim, model.v_head_dim
    linears = [Linear("q_down", h, qr, Split.NONE)] if qr else []
    return linears + [
        Linear("q_up", qr or h, a * (p + r), Split.COLUMN),
        Linear("kv_down", h, c + r, Split.NONE),
        Linear("kv_up", c, a * (p + dv), Split.COLUMN),
        Linear("proj", a * dv, h, Split.ROW),
    ]


def attention_split_weights(model: ModelConfig) -> int:
    """Weights of the attention's tensor-parallel linears (all ranks together)."""
    return sum(x.weights for x in attention_linears(model) if x.split is not Split.NONE)


def attention_replicated_weights(model: ModelConfig) -> int:
    """Weights of the attention's replicated linears (MLA's down-projections), per rank."""
    return sum(x.weights for x in attention_linears(model) if x.split is Split.NONE)


def latent_widths(model: ModelConfig) -> int:
    """Features of MLA's down-projections' outputs (each the input of a replicated norm and
    of an up-projection): q_lora + c + r; 0 for multi-head attention. Their biases and the
    norms' gains are this wide, less the rotary key's r for the norms."""
    if not model.is_mla:
        return 0
    return model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim
