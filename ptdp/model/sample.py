"""Load a checkpoint with its tokenizer and sample text from it (`ptdp generate`)."""

from __future__ import annotations

from pathlib import Path

import torch

from ptdp.data.tokenizers import load_tokenizer
from ptdp.errors import CheckpointError
from ptdp.model.generate import generate
from ptdp.model.gpt import GPT
from ptdp.train import checkpoint as ckpt


def load_model(step_dir: Path, device: str = "cpu") -> GPT:
    cfg = ckpt.load_config(step_dir)
    state = ckpt.load_checkpoint(step_dir)
    model = GPT(cfg.model, seed=cfg.train.seed)
    model.load_state_dict(state["model"])
    return model.to(device)


def sample_from_checkpoint(
    path: Path,
    prompt: str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 0.95,
    num_samples: int = 1,
    seed: int = 0,
    device: str = "cpu",
) -> list[str]:
    step_dir = ckpt.find_checkpoint(path)
    entry = ckpt.load_checkpoint(step_dir).get("tokenizer", "")
    if not entry:
        raise CheckpointError(
            f"{step_dir} records no tokenizer (its data was preprocessed elsewhere); "
            "train with --data.tokenizer PATH/tokenizer.json to make it self-contained"
        )
    tokenizer = load_tokenizer("bytes" if entry == "bytes" else str(step_dir / entry))
    model = load_model(step_dir, device)
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eod_id]
    tokens = torch.tensor([ids] * num_samples, device=device)
    out = generate(
        model,
        tokens,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=torch.Generator().manual_seed(seed),
        stop_token=None,
    )
    return [tokenizer.decode(row.tolist()) for row in out]
