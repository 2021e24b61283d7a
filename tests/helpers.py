"""Test helpers: a tiny generated corpus, a tiny run config built on it, and the check that
two runs agree."""

from __future__ import annotations

import importlib
import random
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ptdp import checkpoint as ckpt
from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig

LLAMA = {
    "position_embedding": "rope",
    "normalization": "rmsnorm",
    "activation": "swiglu",
    "num_query_groups": 2,
    "tie_embeddings": False,
    "bias": False,
}
"""Model options that make the GPT a Llama-style model (with grouped-query attention)."""

PERF_MODEL = {
    "num_layers": 8, "hidden_size": 4096, "num_heads": 32, "seq_length": 2048, "vocab_size": 32000,
}  # fmt: skip
"""A model the performance-model tests simulate (never built): 8 layers of a ~6B shape."""
WORDS = (
    "to be or not that is the question whether tis nobler in mind suffer slings and "
    "arrows of outrageous fortune take arms against a sea troubles by opposing end them"
).split()


def make_corpus(directory: Path, docs: int = 12, seed: int = 0) -> list[Path]:
    rnd = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(docs):
        lines = [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(4, 10))) for _ in range(30)]
        path = directory / f"doc{i:02d}.txt"
        path.write_text("\n".join(lines) + "\n")
        files.append(path)
    return files


def tiny_config(data_path: str, run_dir: Path, **sections: dict) -> RunConfig:
    """A 2-layer, h=32 model on the tiny corpus; `sections` override any field."""
    base = {
        "model": {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 32},
        "data": {"path": data_path, "valid_fraction": 0.1},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
        "train": {
            "micro_batch_size": 4,
            "global_batch_size": 8,
            "steps": 6,
            "log_interval": 1,
            "eval_interval": 0,
            "run_dir": str(run_dir),
            "progress": False,
            "device": "cpu",
        },
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return apply_updates(RunConfig(), base, "a test")


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<group>/<name>.py, `name` = "group/name", imported as the module
    benchmarks.group.name (so spawned ranks can unpickle its workers by name)."""
    return importlib.import_module("benchmarks." + name.replace("/", "."))


def assert_same_run(single: Path, parallel: Path, losses: dict[int, float], other: dict) -> None:
    """Two runs' losses (`losses` of `single`, `other` of `parallel`) and final model weights
    agree to float32 rounding: the equivalence check of every layout against one process."""
    for step, loss in losses.items():
        assert other[step] == pytest.approx(loss, rel=1e-5), step
    a = ckpt.load_checkpoint(ckpt.find_checkpoint(single))["model"]
    b = ckpt.load_checkpoint(ckpt.find_checkpoint(parallel))["model"]
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


def save_tiny_hf(directory: Path, family: str, *, vocab_size: int = 257, positions: int = 64):
    """A random 2-layer, h=32 `transformers` GPT-2, Llama (grouped-query), Qwen2 (Llama's
    shape with QKV biases, tied embeddings), Mixtral or Qwen3-MoE (Llama's shape with 4
    experts of width 16, 2 per token; Qwen3-MoE's first layer dense) model saved in
    `directory` (no dropout, weights far from init so a misplaced tensor shows); the byte
    vocabulary by default. Returns the model."""
    import transformers

    if family == "gpt2":
        config = transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, n_positions=positions, vocab_size=vocab_size,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    elif family == "qwen2":
        config = transformers.Qwen2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=positions, vocab_size=vocab_size,
            rms_norm_eps=1e-5, tie_word_embeddings=True,
        )  # fmt: skip
        model = transformers.Qwen2ForCausalLM(config)
    elif family in ("mixtral", "qwen3_moe"):
        shape = dict(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=positions, vocab_size=vocab_size, rms_norm_eps=1e-5,
            num_experts_per_tok=2,
        )  # fmt: skip
        if family == "mixtral":
            config = transformers.MixtralConfig(**shape, intermediate_size=16, num_local_experts=4)
            model = transformers.MixtralForCausalLM(config)
        else:
            config = transformers.Qwen3MoeConfig(
                **shape, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                norm_topk_prob=True, mlp_only_layers=[0],
            )  # fmt: skip
            model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=positions, vocab_size=vocab_size,
            rms_norm_eps=1e-5,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(directory)
    return model
