"""Tensor- and pipeline-parallel generation (gloo on CPU) against one process: the same
greedy tokens, the same cached logits, and the same sampled text from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ptdp.checkpoint import find_checkpoint
from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.model.generate import generate, next_logits
from ptdp.model.gpt import GPT
from ptdp.model.kv_cache import KVCache
from ptdp.model.pipeline_generate import generate_pipelined
from ptdp.parallel.comm import Group
from ptdp.parallel.mesh import MeshShape, ParallelMesh
from ptdp.sample import load_model, sample_from_checkpoint, stage_peers
from ptdp.train.run import train
from tests.dist.harness import run_ranks
from tests.helpers import LLAMA, tiny_config

pytestmark = pytest.mark.dist


def _greedy(rank: int, world_size: int, options: dict) -> None:
    base = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 16}
    cfg = apply_updates(RunConfig(), {"model": {**base, "vocab_size": 51, **options}}, "t").model
    single = GPT(cfg, seed=5)
    sharded = GPT(cfg, seed=5, tp=Group(None, world_size, rank))
    prompt = torch.randint(0, 51, (2, 4), generator=torch.Generator().manual_seed(1))
    # 20 new tokens outgrow the 16-token context: both the cached and the recomputing path.
    expected = generate(single, prompt, 20, temperature=0, use_cache=False)
    assert torch.equal(generate(sharded, prompt, 20, temperature=0), expected)
    cache = KVCache(16)
    with torch.no_grad():
        for t in range(4, 16):
            logits = next_logits(sharded, expected[:, :t], cache)
            torch.testing.assert_close(logits, single(expected[:, :t])[:, -1], rtol=0, atol=1e-5)


WINDOW = {**LLAMA, "qkv_bias": True, "sliding_window": 5}  # Qwen2's bias, Mistral's window
MOE = {**LLAMA, "num_experts": 4, "moe_top_k": 2, "moe_shared_experts": 1}
"""A mixture of experts (SwiGLU experts split over tp like the MLP, a shared expert)."""
MLA = {
    **LLAMA, "attention": "mla", "q_lora_rank": 12, "kv_lora_rank": 10, "qk_nope_head_dim": 6,
    "qk_rope_head_dim": 4, "v_head_dim": 5, "num_query_groups": 0,
}  # fmt: skip
"""Latent attention: heads split over tp, each rank's cache the whole latent and rotary key."""


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="gpt2"),
        pytest.param(LLAMA, id="llama"),
        pytest.param(WINDOW, id="window"),
        pytest.param(MOE, id="moe"),
        pytest.param(MLA, id="mla"),
    ],
)
def test_tp2_greedy_generation_equals_single_process(options: dict) -> None:
    run_ranks(_greedy, 2, options)


def _sample(rank: int, world_size: int, run_dir: Path, expected: list[str]) -> None:
    texts = sample_from_checkpoint(
        run_dir,
        "to be",
        max_new_tokens=12,
        num_samples=2,
        seed=3,
        mesh=ParallelMesh.build(MeshShape(tp=world_size), rank),
    )
    assert texts == expected


def test_tp2_samples_from_a_checkpoint_like_one_process(tiny_data: str, tmp_path: Path) -> None:
    train(tiny_config(tiny_data, tmp_path / "run", train={"steps": 2}, model=LLAMA))
    expected = sample_from_checkpoint(
        tmp_path / "run", "to be", max_new_tokens=12, num_samples=2, seed=3
    )
    run_ranks(_sample, 2, tmp_path / "run", expected)


# Greedy and sampled, with and without the KV cache; 40 new tokens outgrow the 32-token
# context, so the prefill, the cached steps and the recomputed window all cross stages.
PIPELINE_RUNS = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 3},
    "sampled, no cache": {"temperature": 0.9, "seed": 4, "use_cache": False},
}


def _pipeline_ids(run_dir: Path, mesh: ParallelMesh | None) -> dict[str, torch.Tensor]:
    """Token ids [2, 5 + 40] of each run, from one process (no mesh) or this rank's stage."""
    model = load_model(find_checkpoint(run_dir), mesh=mesh)
    prompt = torch.tensor([list(b"to be"), list(b"not a")])
    out = {}
    for name, options in PIPELINE_RUNS.items():
        options = dict(options)
        generator = torch.Generator().manual_seed(options.pop("seed", 0))
        if mesh is None:
            out[name] = generate(model, prompt, 40, generator=generator, **options)
        else:
            peers = stage_peers(mesh)
            out[name] = generate_pipelined(model, peers, prompt, 40, generator=generator, **options)
    return out


def _pipeline(rank: int, world_size: int, tp: int, run_dir: Path, expected: dict) -> None:
    mesh = ParallelMesh.build(MeshShape(tp=tp, pp=world_size // tp), rank)
    ids = _pipeline_ids(run_dir, mesh)
    for name in PIPELINE_RUNS:
        assert torch.equal(ids[name], expected[name]), (name, mesh.coord("pp"))
    texts = sample_from_checkpoint(run_dir, "to be", max_new_tokens=12, num_samples=2, mesh=mesh)
    assert texts == expected["texts"]


@pytest.mark.parametrize(
    "tp,pp,options,layers",
    [  # 3 layers over 2 stages: an uneven split
        pytest.param(1, 2, {}, 3, id="pp2-gpt2"),  # tied embedding: the last stage loads a copy
        pytest.param(2, 2, LLAMA, 3, id="tp2xpp2-llama"),
        pytest.param(1, 2, MOE, 3, id="pp2-moe"),
        pytest.param(2, 2, MLA, 3, id="tp2xpp2-mla"),
        # 0,1,1,0: the embedding alone, then the output layer alone
        pytest.param(1, 4, LLAMA, 2, id="pp4-ends-without-layers"),
    ],
)
def test_pipeline_generation_equals_single_process(
    tiny_data: str, tmp_path: Path, tp: int, pp: int, options: dict, layers: int
) -> None:
    model = {"num_layers": layers, **options}
    train(tiny_config(tiny_data, tmp_path / "run", train={"steps": 2}, model=model))
    expected: dict = _pipeline_ids(tmp_path / "run", None)
    assert not torch.equal(expected["greedy"], expected["sampled"])  # the sampling sampled
    expected["texts"] = sample_from_checkpoint(
        tmp_path / "run", "to be", max_new_tokens=12, num_samples=2
    )
    run_ranks(_pipeline, tp * pp, tp, tmp_path / "run", expected)
