"""Resolve a run's data: its tokenizer, the vocabulary the model needs, the two splits.

Runs before any process group exists, so a wrong path or a vocabulary mismatch is a
plain error in the shell rather than a hang on a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ptdp.config import RunConfig
from ptdp.data.dataset import GPTDataset
from ptdp.data.preprocess import read_metadata
from ptdp.errors import ConfigError


@dataclass(frozen=True)
class RunData:
    train: GPTDataset
    valid: GPTDataset | None
    tokenizer_spec: str
    """"bytes", a path to a tokenizer.json, or "" when unknown (data made elsewhere)."""


def tokenizer_spec_for(cfg: RunConfig) -> str:
    """The tokenizer named in the config, else the one recorded beside the data."""
    if cfg.data.tokenizer:
        return cfg.data.tokenizer
    meta = read_metadata(cfg.data.path)
    if not meta:
        return ""
    if meta["tokenizer"] == "bytes":
        return "bytes"
    return str(Path(cfg.data.path).parent / meta["tokenizer"])


def resolve_vocab(cfg: RunConfig) -> RunConfig:
    """Fill model.vocab_size from the data when it is 0; reject a model too small for it."""
    require_data_path(cfg)
    meta = read_metadata(cfg.data.path)
    data_vocab = meta["vocab_size"] if meta else 0
    if cfg.data.tokenizer and not data_vocab:
        from ptdp.data.tokenizers import load_tokenizer

        data_vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
    vocab = cfg.model.vocab_size or data_vocab
    if not vocab:
        raise ConfigError(
            f"model.vocab_size = 0 but the data at '{cfg.data.path}' records no tokenizer "
            "(was it preprocessed elsewhere?); set --model.vocab_size or --data.tokenizer"
        )
    if data_vocab and vocab < data_vocab:
        raise ConfigError(
            f"model.vocab_size = {vocab} is smaller than the data's vocabulary of {data_vocab} "
            f"tokens ({cfg.data.path}); set --model.vocab_size {data_vocab} or 0 (automatic)"
        )
    return replace(cfg, model=replace(cfg.model, vocab_size=vocab))


def require_data_path(cfg: RunConfig) -> None:
    if not cfg.data.path:
        raise ConfigError(
            "data.path is empty; preprocess a corpus with `ptdp preprocess --input FILES "
            "--output-prefix data/NAME --tokenizer bpe` and pass --data.path data/NAME"
        )


def open_data(cfg: RunConfig) -> RunData:
    require_data_path(cfg)
    d, s, seed = cfg.data, cfg.model.seq_length, cfg.train.seed
    train = GPTDataset(d.path, s, "train", valid_fraction=d.valid_fraction, seed=seed)
    valid = None
    if cfg.train.eval_interval:
        valid = GPTDataset(d.path, s, "valid", valid_fraction=d.valid_fraction, seed=seed)
        if len(valid) == 0:
            raise ConfigError(
                f"the validation split of {d.path} (data.valid_fraction = {d.valid_fraction}) "
                f"holds no window of {s + 1} tokens; raise data.valid_fraction or set "
                "--train.eval_interval 0"
            )
    return RunData(train, valid, tokenizer_spec_for(cfg))
