"""ParamRoles (ptdp/parallel/roles.py): the record a GPT chunk builds of its tied copy and
its sequence-parallel parameters, and how a rank's records merge."""

from __future__ import annotations

from dataclasses import replace

import torch

from ptdp.config.enums import Normalization
from ptdp.config.sections import ModelConfig
from ptdp.model.gpt import GPT
from ptdp.parallel.comm import Group
from ptdp.parallel.roles import NO_ROLES, ParamRoles, rank_roles

CFG = ModelConfig(num_layers=4, hidden_size=16, num_heads=2, seq_length=8, vocab_size=20)


def test_lookups_prefix_and_merge() -> None:
    roles = ParamRoles(
        tied={"output.weight": "embedding.weight"}, sequence_parallel=frozenset({"n.w"})
    )
    assert roles.is_tied_copy("output.weight") and not roles.is_tied_copy("embedding.weight")
    assert roles.original("output.weight") == "embedding.weight"
    assert roles.original("layers.0.mlp.fc1.weight") == "layers.0.mlp.fc1.weight"
    assert roles.is_sequence_parallel("n.w") and not NO_ROLES.is_sequence_parallel("n.w")
    inner = roles.prefixed("0")
    assert inner.original("0.output.weight") == "0.embedding.weight"
    assert inner.is_sequence_parallel("0.n.w") and not inner.is_sequence_parallel("n.w")
    merged = ParamRoles.merge([roles, ParamRoles(sequence_parallel=frozenset({"m.b"}))])
    assert merged.tied == roles.tied and merged.sequence_parallel == {"n.w", "m.b"}


def test_gpt_chunks_name_their_tied_copy_and_sequence_parallel_weights() -> None:
    first = GPT(CFG, layers=range(0, 2), has_head=False)
    last = GPT(CFG, layers=range(2, 4), has_embedding=False)
    whole = GPT(CFG)  # tied to its own embedding: no copy
    assert last.roles.tied == {"output.weight": "embedding.weight"}
    assert first.roles == whole.roles == NO_ROLES
    assert rank_roles([first, last]).tied == last.roles.tied
    # A tied copy starts as its original.
    assert torch.equal(last.output.weight, first.embedding.weight)

    sp = GPT(CFG, tp=Group.single(), sequence_parallel=True)
    expected = {"position.weight", "final_norm.weight", "final_norm.bias"} | {
        f"layers.{i}.{name}"
        for i in range(4)
        for name in ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias")
        + ("attn.proj.bias", "mlp.fc2.bias")
    }
    assert sp.roles.sequence_parallel == expected
    assert not GPT(CFG, sequence_parallel=True).roles.sequence_parallel  # no tensor group
    llama = replace(CFG, normalization=Normalization.RMSNORM, bias=False, tie_embeddings=False)
    names = GPT(llama, tp=Group.single(), sequence_parallel=True).roles.sequence_parallel
    assert "final_norm.weight" in names and not any(n.endswith("bias") for n in names)
