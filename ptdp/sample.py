"""Load a checkpoint with its tokenizer and sample text from it (`ptdp generate`).

Checkpoints hold full-shape tensors, so any of them loads into a model split over a
tensor-parallel group of any size that divides its heads, key/value groups and MLP width
(`tp=`; every rank then returns the same texts).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ptdp.checkpoint import find_checkpoint, load_checkpoint, load_config, load_full_model_state
from ptdp.config import ParallelConfig
from ptdp.data.tokenizers import load_tokenizer
from ptdp.errors import CheckpointError, ConfigError
from ptdp.layout import validate
from ptdp.model.generate import generate
from ptdp.model.gpt import GPT
from ptdp.parallel.comm import Group
from ptdp.parallel.env import LaunchEnv, init_process_group, pick_device


def load_model(step_dir: Path, device: str = "cpu", tp: Group | None = None) -> GPT:
    """The checkpoint's model, whole or (with `tp`) this rank's tensor-parallel part."""
    cfg = load_config(step_dir)
    state = load_checkpoint(step_dir)
    if tp is None or tp.size == 1:  # full tensors; the model pads its vocabulary rows
        model = GPT(cfg.model, seed=cfg.train.seed)
        load_full_model_state([model], state["model"], Group.single())
        return model.to(device)
    try:  # only the tensor-parallel rules can fail: the run trained with this model
        validate(dataclasses.replace(cfg, parallel=ParallelConfig(tp=tp.size, dp=1)), tp.size)
    except ConfigError as exc:
        raise ConfigError(
            f"cannot split {step_dir}'s model over {tp.size} tensor-parallel processes "
            f"(parallel.tp below means the process count): {exc}"
        ) from None
    model = GPT(cfg.model, seed=cfg.train.seed, tp=tp).to(device)
    load_full_model_state([model], state["model"], tp)
    return model


def launched_tensor_group(device: str) -> tuple[Group | None, str]:
    """Under torchrun or srun, one tensor-parallel group of all processes and this rank's device;
    (None, device) for one process."""
    env = LaunchEnv.from_environ()
    if env.world_size == 1:
        return None, device
    picked = pick_device(device, env.local_rank)
    init_process_group(env, picked)
    return Group(None, env.world_size, env.rank), str(picked)


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
    use_cache: bool = True,
    tp: Group | None = None,
) -> list[str]:
    step_dir = find_checkpoint(path)
    entry = load_checkpoint(step_dir).get("tokenizer", "")
    if not entry:
        raise CheckpointError(
            f"{step_dir} records no tokenizer (its data was preprocessed elsewhere); "
            "train with --data.tokenizer PATH/tokenizer.json to make it self-contained"
        )
    tokenizer = load_tokenizer("bytes" if entry == "bytes" else str(step_dir / entry))
    model = load_model(step_dir, device, tp)
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
        use_cache=use_cache,
    )
    return [tokenizer.decode(row.tolist()) for row in out]
