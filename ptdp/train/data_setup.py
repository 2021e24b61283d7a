"""Resolve a run's data: its tokenizer, the vocabulary the model needs, the two splits.

Runs before any process group exists, so a wrong path or a vocabulary mismatch is a
plain error in the shell rather than a hang on a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ptdp.config import DataConfig, RunConfig
from ptdp.data.dataset import GPTDataset
from ptdp.data.indexed import IndexedDataset, bin_path, idx_path
from ptdp.data.preprocess import read_metadata
from ptdp.errors import ConfigError, DataError

SCAN_TOKENS = 1 << 24
"""Tokens checked against model.vocab_size when the data records no vocabulary."""


@dataclass(frozen=True)
class RunData:
    train: GPTDataset
    valid: GPTDataset | None
    tokenizer_spec: str
    """"bytes", a path to a tokenizer.json, or "" when unknown (data made elsewhere)."""


def tokenizer_spec_for(data: DataConfig) -> str:
    """The tokenizer named in the config, else the one recorded beside the data."""
    if data.tokenizer:
        return data.tokenizer
    meta = read_metadata(data.path)
    if not meta:
        return ""
    if meta["tokenizer"] == "bytes":
        return "bytes"
    return str(Path(data.path).parent / meta["tokenizer"])


def resolve_vocab(cfg: RunConfig) -> RunConfig:
    """Fill model.vocab_size from the data when it is 0; reject a model too small for it."""
    require_data_path(cfg.data)
    meta = read_metadata(cfg.data.path)
    data_vocab = meta["vocab_size"] if meta else 0
    if cfg.data.tokenizer:
        from ptdp.data.tokenizers import load_tokenizer

        tok_vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
        if meta:
            _check_same_tokenizer(cfg.data, meta, tok_vocab)
        data_vocab = data_vocab or tok_vocab
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
    if not meta:
        _check_token_ids(cfg.data.path, vocab)
    return replace(cfg, model=replace(cfg.model, vocab_size=vocab))


def _check_same_tokenizer(data: DataConfig, meta: dict, tok_vocab: int) -> None:
    """data.tokenizer must be the tokenizer the data was made with (its sidecar says which)."""
    recorded = meta["tokenizer"]
    recorded_path = Path(data.path).parent / recorded
    chosen = Path(data.tokenizer)
    if chosen.is_dir():
        chosen = chosen / "tokenizer.json"
    if (recorded == "bytes") != (data.tokenizer == "bytes"):
        same = False
    elif recorded == "bytes":
        same = True
    elif recorded_path.is_file():
        same = recorded_path.read_bytes() == chosen.read_bytes()
    else:
        same = tok_vocab == meta["vocab_size"]
    if not same:
        made_with = "bytes" if recorded == "bytes" else str(recorded_path)
        raise ConfigError(
            f"data.tokenizer = '{data.tokenizer}' (vocabulary {tok_vocab}) is not the "
            f"tokenizer the data at '{data.path}' was made with ({made_with}, vocabulary "
            f"{meta['vocab_size']}); leave --data.tokenizer empty to use the data's, or "
            "re-run `ptdp preprocess` with the tokenizer you want"
        )


def _check_token_ids(prefix: str, vocab: int) -> None:
    """Data made elsewhere records no vocabulary: look at its first tokens for ids the
    model's embedding has no row for (a whole scan would read the corpus on every rank)."""
    indexed = IndexedDataset(prefix)
    head = np.asarray(indexed.tokens[:SCAN_TOKENS])
    if head.size and int(head.max()) >= vocab:
        raise ConfigError(
            f"the data at '{prefix}' holds token id {int(head.max())}, but model.vocab_size = "
            f"{vocab} (ids 0..{vocab - 1}): the data was made with a larger tokenizer; set "
            f"--model.vocab_size {int(head.max()) + 1} or more, or --data.tokenizer to the "
            "tokenizer it was made with"
        )


def require_data_path(data: DataConfig) -> None:
    if not data.path:
        raise ConfigError(
            "data.path is empty; preprocess a corpus with `ptdp preprocess --input FILES "
            "--output-prefix data/NAME --tokenizer bpe` and pass --data.path data/NAME"
        )


def require_data_files(prefix: str) -> None:
    """Name both files a data prefix stands for when neither exists (the usual typo)."""
    files = (bin_path(prefix), idx_path(prefix))
    if any(f.is_file() for f in files):
        return  # one missing, or damaged: IndexedDataset names the file and the problem
    hint = ""
    stem, ext = str(prefix).rsplit(".", 1) if "." in Path(prefix).name else (prefix, "")
    if ext in ("bin", "idx", "json") and bin_path(stem).is_file():
        hint = f" (data.path is a prefix without extension: --data.path {stem})"
    raise DataError(
        f"data.path = '{prefix}': neither {files[0]} nor {files[1]} exists{hint}; pass "
        "--data.path PREFIX of a dataset made by `ptdp preprocess --output-prefix PREFIX`"
    )


def open_data(cfg: RunConfig) -> RunData:
    require_data_path(cfg.data)
    require_data_files(cfg.data.path)
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
    return RunData(train, valid, tokenizer_spec_for(cfg.data))
