"""Tensor-parallel generation (gloo on CPU) against one process: the same greedy tokens,
the same cached logits, and the same sampled text from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ptdp.config import RunConfig, apply_updates
from ptdp.model.generate import generate, next_logits
from ptdp.model.gpt import GPT
from ptdp.model.kv_cache import KVCache
from ptdp.parallel.comm import Group
from ptdp.sample import sample_from_checkpoint
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


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="gpt2"),
        pytest.param(LLAMA, id="llama"),
        pytest.param(WINDOW, id="window"),
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
        tp=Group(None, world_size, rank),
    )
    assert texts == expected


def test_tp2_samples_from_a_checkpoint_like_one_process(tiny_data: str, tmp_path: Path) -> None:
    train(tiny_config(tiny_data, tmp_path / "run", train={"steps": 2}, model=LLAMA))
    expected = sample_from_checkpoint(
        tmp_path / "run", "to be", max_new_tokens=12, num_samples=2, seed=3
    )
    run_ranks(_sample, 2, tmp_path / "run", expected)
