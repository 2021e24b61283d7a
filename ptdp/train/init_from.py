"""`checkpoint.init_from`: start a run from the weights of another run or of a Hugging Face
model, in any layout, with a fresh optimizer, step 0 and the data from its beginning.

The architecture comes from the source (the model section of the run's config.toml, or
the model's config.json): model keys left unset take its values, and a key set to another
value is refused with its name. Keys that leave the weights' shapes alone are free:
dropout, init_std and make_vocab_size_divisible_by; seq_length may be shorter than a
learned position table (its first rows are kept) and anything with rotary positions. The
source's tokenizer must be the data's. A Hugging Face model is converted in memory
(ptdp/convert/hf.py): nothing is written beside it. Everything here but the load runs
before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from ptdp import checkpoint as ckpt
from ptdp.checkpoint.store import load_entries
from ptdp.config.enums import PositionEmbedding
from ptdp.config.sections import LAYOUT_ONLY_MODEL_KEYS, DataConfig, ModelConfig, RunConfig
from ptdp.convert.hf import TOKENIZER_FILE, check_hf_model, hf_sources
from ptdp.convert.hf_deepseek import import_notes as deepseek_import_notes
from ptdp.convert.hf_files import HfWeights, read_hf_config, read_hf_json, weight_files
from ptdp.data.preprocess import read_metadata
from ptdp.errors import CheckpointError, ConfigError
from ptdp.train.data_setup import tokenizer_spec_for

FREE_MODEL_KEYS = frozenset({"dropout", "init_std"}) | LAYOUT_ONLY_MODEL_KEYS
"""Model keys a run may set apart from its source: they do not shape the weights."""

EXPECTED = (
    "pass a ptdp run directory or step directory (from any layout), or a Hugging Face model "
    "directory holding config.json and model.safetensors"
)


@dataclass(frozen=True)
class InitSource:
    """Where a run's first weights come from, and what they are."""

    path: Path
    """A ptdp step directory, or a Hugging Face model directory."""
    hf: bool
    model: ModelConfig
    tokenizer: str
    """"bytes", a tokenizer.json path, or "" when the source records none."""

    def describe(self) -> str:
        return f"{'Hugging Face model' if self.hf else 'checkpoint'} {self.path}"


def open_source(path: str) -> InitSource:
    """The source named by checkpoint.init_from, its files checked (checksums are read
    when loading); a missing or damaged file is named."""
    where = Path(path)
    if not where.exists():
        raise CheckpointError(f"checkpoint.init_from = '{path}' does not exist; {EXPECTED}")
    if (where / "config.json").is_file():
        return _hf_source(where)
    marks = ("checkpoints", ckpt.LATEST, ckpt.METADATA, ckpt.STATE_FILE)
    if not any((where / m).exists() for m in marks):
        raise CheckpointError(
            f"checkpoint.init_from = '{path}' holds neither a ptdp checkpoint ({ckpt.LATEST}, "
            f"checkpoints/ or {ckpt.METADATA}) nor a Hugging Face config.json; {EXPECTED}"
        )
    try:
        step_dir = ckpt.find_checkpoint(where)
        model = ckpt.load_config(step_dir).model
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint.init_from = '{path}': {exc}") from None
    return InitSource(step_dir, False, model, _saved_tokenizer(step_dir))


def _saved_tokenizer(step_dir: Path) -> str:
    """The tokenizer a ptdp checkpoint was trained with: its copied tokenizer.json, or the
    `tokenizer` entry ("bytes" or "")."""
    if (step_dir / TOKENIZER_FILE).is_file():
        return str(step_dir / TOKENIZER_FILE)
    if (step_dir / ckpt.STATE_FILE).is_file():
        return ""  # the earlier format: reading the entry would load every tensor
    if "tokenizer" not in ckpt.read_metadata(step_dir).state_dict_metadata:
        return ""
    entry = load_entries(step_dir, {"tokenizer": None})["tokenizer"]
    return "bytes" if entry == "bytes" else ""


def _hf_source(directory: Path) -> InitSource:
    model = read_hf_config(directory)
    _check_weight_files(directory)
    check_hf_model(directory, read_hf_json(directory))  # as `ptdp convert --from hf` does
    tokenizer = directory / TOKENIZER_FILE
    return InitSource(directory, True, model, str(tokenizer) if tokenizer.is_file() else "")


def _check_weight_files(directory: Path) -> None:
    """The safetensors files are there, whole, and their headers read (before launch)."""
    files = weight_files(directory)  # each named if missing or truncated
    if not files:
        HfWeights(directory)  # pytorch_model.bin mapped, or the error naming what is missing
        return
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(
                f"cannot read Hugging Face weights file {file} ({exc}); the file is missing "
                "or damaged: download or export the model again"
            ) from None


# ---------------------------------------------------------------------- the model settings


def _effective(cfg: ModelConfig, key: str, value: Any) -> Any:
    """What a model key's value means: 0 widths and groups are resolved."""
    if key == "ffn_hidden_size":
        return replace(cfg, ffn_hidden_size=value).ffn_size
    if key == "num_query_groups":
        return replace(cfg, num_query_groups=value).query_groups
    return value


def _conflict(key: str, mine: Any, saved: ModelConfig) -> str | None:
    """Why a given model key cannot hold `mine` when the weights are `saved`'s, or None."""
    theirs = getattr(saved, key)
    if key in FREE_MODEL_KEYS or (key == "vocab_size" and mine == 0):
        return None
    if key == "seq_length":
        if saved.position_embedding is PositionEmbedding.LEARNED and mine > theirs:
            return f"model.seq_length = {mine} exceeds its {theirs} learned positions"
        return None
    if key == "mtp_depth":  # fewer multi-token-prediction modules: the rest are not read
        if mine > theirs:
            return f"model.mtp_depth = {mine} where it has {theirs} modules (at most {theirs})"
        return None
    if _effective(saved, key, mine) != _effective(saved, key, theirs):
        return f"model.{key} = {_show(mine)} where it has {_show(theirs)}"
    return None


def _show(value: Any) -> Any:
    return getattr(value, "value", value)  # enums by their value


def merge_model(
    current: ModelConfig, saved: ModelConfig, given: frozenset[str] | None, source: str
) -> ModelConfig:
    """The run's model: `saved`'s architecture, with the free keys `given` sets.

    `given` holds the `model.key` names the user set (config.given_keys); None (a config
    built in code) counts every key that differs from its default as given."""
    if given is None:
        default = ModelConfig()
        given = frozenset(
            f"model.{f.name}"
            for f in fields(ModelConfig)
            if getattr(current, f.name) != getattr(default, f.name)
        )
    values, conflicts = {}, []
    for f in fields(ModelConfig):
        key, mine = f.name, getattr(current, f.name)
        if f"model.{key}" not in given:
            values[key] = getattr(saved, key)
        elif (why := _conflict(key, mine, saved)) is not None:
            conflicts.append(why)
        else:
            free = key in FREE_MODEL_KEYS or key in ("seq_length", "mtp_depth")
            values[key] = mine if free else getattr(saved, key)
    if conflicts:
        raise ConfigError(
            f"checkpoint.init_from: the model comes from {source}, which disagrees: "
            f"{'; '.join(conflicts)}. Leave these model keys out (they are taken from it) or "
            "set them to its values"
        )
    return ModelConfig(**values)


# ---------------------------------------------------------------------- the vocabulary


def _same_tokenizer(a: str, b: str) -> bool:
    if "bytes" in (a, b):
        return a == b
    pa, pb = Path(a), Path(b)
    pa, pb = (p / TOKENIZER_FILE if p.is_dir() else p for p in (pa, pb))
    if pa.read_bytes() == pb.read_bytes():
        return True
    from tokenizers import Tokenizer

    vocab = [Tokenizer.from_file(str(p)).get_vocab(with_added_tokens=True) for p in (pa, pb)]
    return vocab[0] == vocab[1]


def check_vocabulary(source: InitSource, data: DataConfig) -> None:
    """The source's tokenizer must be the one the data was made with: the same file or
    vocabulary where both are known, else the same vocabulary size."""
    theirs = tokenizer_spec_for(data)
    meta = read_metadata(data.path)
    data_vocab = int(meta["vocab_size"]) if meta else 0
    if source.tokenizer and theirs:
        same = _same_tokenizer(source.tokenizer, theirs)
    else:
        same = not data_vocab or data_vocab == source.model.vocab_size
    if not same:
        raise ConfigError(
            f"checkpoint.init_from: {source.describe()} was trained with tokenizer "
            f"{source.tokenizer or '(not recorded)'} (vocabulary {source.model.vocab_size}), but "
            f"the data at '{data.path}' was made with {theirs or '(not recorded)'} (vocabulary "
            f"{data_vocab or 'unknown'}); preprocess the data with the checkpoint's tokenizer "
            "(ptdp preprocess --tokenizer PATH/tokenizer.json) or start from a checkpoint of "
            "this data's tokenizer"
        )


# ---------------------------------------------------------------------- run setup and load


def resolve_init(
    cfg: RunConfig, given: frozenset[str] | None
) -> tuple[RunConfig, InitSource | None]:
    """The run's config with its model taken from checkpoint.init_from, and the source to
    load. None without init_from, or when the run has its own checkpoint: --resume then
    continues from it (a restarted fine-tune), and without --resume the run is refused
    (ptdp/train/run.py); either way the model is that checkpoint's."""
    if not cfg.checkpoint.init_from:
        return cfg, None
    run_dir = cfg.train.run_dir
    if ckpt.has_checkpoint(run_dir):
        step_dir = ckpt.find_checkpoint(run_dir)
        model = merge_model(cfg.model, ckpt.load_config(step_dir).model, given, str(step_dir))
        return replace(cfg, model=model), None
    source = open_source(cfg.checkpoint.init_from)
    cfg = replace(cfg, model=merge_model(cfg.model, source.model, given, source.describe()))
    check_vocabulary(source, cfg.data)
    return cfg, source


def load_initial_weights(
    manager: ckpt.CheckpointManager, source: InitSource, model: ModelConfig
) -> list[str]:
    """Every rank loads its shards of the source's weights into its chunks, with a fresh
    optimizer (collective); returns what the import changed or left out, to be said."""
    if not source.hf:
        manager.load_weights(source.path)
        return []
    with HfWeights(source.path) as weights, torch.no_grad():  # each rank its regions
        config = read_hf_json(source.path)
        manager.load_model_state(hf_sources(model, weights.tensors, config))
    return deepseek_import_notes(config, model.mtp_depth)
