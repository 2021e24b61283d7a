"""Resolve a run's data: its tokenizer, the vocabulary the model needs, the two splits.

Runs before any process group exists, so a wrong path or a vocabulary mismatch is a
plain error in the shell rather than a hang on a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ptdp.config.sections import DataConfig, RunConfig
from ptdp.data.blend import BlendedDataset, parse_blend
from ptdp.data.dataset import GPTDataset
from ptdp.data.documents import require_documents
from ptdp.data.indexed import IndexedDataset, bin_path, idx_path
from ptdp.data.preprocess import load_data_tokenizer, read_metadata, sidecar_path
from ptdp.data.token_range import token_range
from ptdp.data.tokenizers import Tokenizer, load_tokenizer, same_tokenizer
from ptdp.errors import ConfigError, DataError


@dataclass(frozen=True)
class RunData:
    train: GPTDataset | BlendedDataset
    valid: GPTDataset | BlendedDataset | None
    tokenizer_spec: str
    """"bytes", a path to a tokenizer.json, or "" when unknown (data made elsewhere)."""


def data_blend(data: DataConfig) -> list[tuple[float, str]]:
    """(weight, prefix) of each dataset: data.path alone, or the blend data.paths names."""
    if data.path and data.paths:
        raise ConfigError(
            f"data.path = '{data.path}' and data.paths are both set; use data.path for one "
            "dataset or data.paths for a weighted blend, not both"
        )
    if data.paths:
        return parse_blend(data.paths)
    require_data_path(data)
    return [(1.0, data.path)]


def _first_prefix(data: DataConfig) -> str:
    return data_blend(data)[0][1]


def tokenizer_spec_for(data: DataConfig) -> str:
    """The tokenizer named in the config, else the one recorded beside the data."""
    if data.tokenizer:
        return data.tokenizer
    prefix = _first_prefix(data)
    meta = read_metadata(prefix)
    if not meta:
        return ""
    if meta["tokenizer"] == "bytes":
        return "bytes"
    return str(Path(prefix).parent / meta["tokenizer"])


def check_shared_tokenizer(prefixes: list[str]) -> None:
    """Every dataset of a blend must be made with one tokenizer (ids mean the same tokens)."""
    first = prefixes[0]
    first_tok = load_data_tokenizer(first)
    for other in prefixes[1:]:
        tok = load_data_tokenizer(other)
        if first_tok is None and tok is None:
            continue
        if first_tok is None or tok is None or not same_tokenizer(first_tok, tok):
            raise ConfigError(
                f"data.paths: '{first}' and '{other}' were not made with the same tokenizer "
                f"({_made_with(first, first_tok)} and {_made_with(other, tok)}); re-run `ptdp "
                "preprocess` on one of them with the other's --tokenizer"
            )


def _made_with(prefix: str, tok: Tokenizer | None) -> str:
    if tok is None:
        return f"{sidecar_path(prefix)} is missing, so its tokenizer is unknown"
    vocab = f"vocabulary {tok.vocab_size}"
    return (
        f"{sidecar_path(prefix)}: bytes, {vocab}" if tok.name == "bytes" else f"{tok.name}, {vocab}"
    )


def resolve_vocab(cfg: RunConfig) -> RunConfig:
    """Fill model.vocab_size from the data when it is 0; reject a model too small for it."""
    prefixes = [prefix for _, prefix in data_blend(cfg.data)]
    check_shared_tokenizer(prefixes)
    prefix = prefixes[0]
    meta = read_metadata(prefix)
    data_vocab = meta["vocab_size"] if meta else 0
    if cfg.data.tokenizer:
        tok = load_tokenizer(cfg.data.tokenizer)
        if meta:
            _check_same_tokenizer(prefix, cfg.data.tokenizer, tok)
        data_vocab = data_vocab or tok.vocab_size
    vocab = cfg.model.vocab_size or data_vocab
    if not vocab:
        raise ConfigError(
            f"model.vocab_size = 0 but the data at '{prefix}' records no tokenizer "
            "(was it preprocessed elsewhere?); set --model.vocab_size or --data.tokenizer"
        )
    if data_vocab and vocab < data_vocab:
        raise ConfigError(
            f"model.vocab_size = {vocab} is smaller than the data's vocabulary of {data_vocab} "
            f"tokens ({prefix}); set --model.vocab_size {data_vocab} or 0 (automatic)"
        )
    for each in prefixes:
        _check_token_ids(each, vocab)
    return replace(cfg, model=replace(cfg.model, vocab_size=vocab))


def _check_same_tokenizer(prefix: str, spec: str, chosen: Tokenizer) -> None:
    """data.tokenizer must be the tokenizer the data was made with (its sidecar says which)."""
    recorded = load_data_tokenizer(prefix)
    if recorded is not None and not same_tokenizer(recorded, chosen):
        made_with = "bytes" if recorded.name == "bytes" else recorded.name
        raise ConfigError(
            f"data.tokenizer = '{spec}' (vocabulary {chosen.vocab_size}) is not the "
            f"tokenizer the data at '{prefix}' was made with ({made_with}, vocabulary "
            f"{recorded.vocab_size}); leave --data.tokenizer empty to use the data's, or "
            "re-run `ptdp preprocess` with the tokenizer you want"
        )


def _check_token_ids(prefix: str, vocab: int) -> None:
    """Every token id of the data must have a row in the model's embedding, whatever the
    sidecar says (a damaged or replaced .bin): the whole .bin is scanned, the result cached
    for large files (ptdp/data/token_range.py)."""
    indexed = IndexedDataset(prefix)
    low, high = token_range(indexed)
    if low >= 0 and high < vocab:
        return
    bad = low if low < 0 else high
    meta = read_metadata(prefix)
    if meta:
        raise DataError(
            f"{indexed.bin_path} holds token id {bad}, but model.vocab_size = {vocab} (ids "
            f"0..{vocab - 1}) and its sidecar {sidecar_path(prefix)} records a vocabulary of "
            f"{meta['vocab_size']}: the .bin does not match its sidecar (damaged, or replaced "
            "by another tokenizer's data); re-create it with `ptdp preprocess`"
        )
    if low < 0:
        raise DataError(
            f"{indexed.bin_path} holds token id {low}: token ids cannot be negative; the "
            "file is damaged or not token ids, re-create it with `ptdp preprocess`"
        )
    raise ConfigError(
        f"the data at '{prefix}' ({indexed.bin_path}) holds token id {high}, but "
        f"model.vocab_size = {vocab} (ids 0..{vocab - 1}): the data was made with a larger "
        f"tokenizer; set --model.vocab_size {high + 1} or more, or --data.tokenizer to the "
        "tokenizer it was made with"
    )


def require_data_path(data: DataConfig) -> None:
    if not data.path and not data.paths:
        raise ConfigError(
            "data.path is empty; preprocess a corpus with `ptdp preprocess --input FILES "
            "--output-prefix data/NAME --tokenizer bpe` and pass --data.path data/NAME (or "
            "--data.paths 0.7,data/A,0.3,data/B for a weighted blend)"
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
    """The train and (when evaluating) valid splits: one dataset's, or the blend of every
    dataset's split by the same data.valid_fraction, with the same weights."""
    blend = data_blend(cfg.data)
    for _, prefix in blend:
        require_data_files(prefix)
    d, s, seed = cfg.data, cfg.model.seq_length, cfg.train.seed

    def split(name: str) -> GPTDataset | BlendedDataset:
        parts = [
            GPTDataset(p, s, name, valid_fraction=d.valid_fraction, seed=seed) for _, p in blend
        ]
        if len(parts) == 1:
            return parts[0]
        return BlendedDataset(parts, [w for w, _ in blend])

    train = split("train")
    if d.document_mask:  # every dataset's index must tell its documents apart
        for part in train.datasets if isinstance(train, BlendedDataset) else [train]:
            require_documents(part.indexed)
    valid = None
    if cfg.train.eval_interval:
        valid = split("valid")
        parts = valid.datasets if isinstance(valid, BlendedDataset) else [valid]
        for (_, prefix), part in zip(blend, parts):
            if len(part) == 0:
                raise ConfigError(
                    f"the validation split of {prefix} (data.valid_fraction = "
                    f"{d.valid_fraction}) holds no window of {s + 1} tokens; raise "
                    "data.valid_fraction or set --train.eval_interval 0"
                )
    return RunData(train, valid, tokenizer_spec_for(cfg.data))
