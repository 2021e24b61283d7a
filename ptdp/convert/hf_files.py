"""The weight files of a Hugging Face model directory, checked before they are read.

A safetensors file is an 8-byte little-endian header length n, an n-byte JSON header
giving each tensor's `data_offsets` [begin, end) in the data that follows, then the
data. So whether a file is whole is known from its header and its size alone, without
reading the tensors: a download or copy cut short is named as truncated, with the sizes,
instead of surfacing as the reader's "incomplete metadata" error. Used by `ptdp convert
--from hf` and `checkpoint.init_from` (both through ptdp/convert/hf.py's reader), which
also compare the tensors' shapes in the headers with what config.json implies
(ptdp/convert/hf_check.py). And the export's folder: empty, new, or --overwrite.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import torch

from ptdp.checkpoint.lazy import Held, Lazy, Region, Stored
from ptdp.config.sections import ModelConfig
from ptdp.convert.hf_check import check_config_numbers
from ptdp.convert.hf_config import model_config_from_hf
from ptdp.errors import CheckpointError, ConfigError
from ptdp.outputs import check_output_dir

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = f"{WEIGHTS_FILE}.index.json"
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
MAX_HEADER_BYTES = 100_000_000
"""The safetensors format's own limit on the JSON header."""
FIX = "download or export the model again"


EXPORTED = (
    f"{WEIGHTS_FILE} (or model-0000k-of-0000n.safetensors and {INDEX_FILE})",
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
"""The files `ptdp convert --to hf` writes (with --overwrite, only these are replaced, and
an earlier export's weight files that this one does not write are removed)."""


def check_export_dir(out: Path, overwrite: bool) -> None:
    """OUT is empty or new; with `overwrite`, files there are allowed (only EXPORTED are
    replaced, the others left as they are)."""
    check_output_dir(out, "OUT")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        model = (out / "config.json").is_file() or bool(weight_names(held))
        what = "files of another model" if model else "files"
        raise ConfigError(
            f"OUT = '{out}' already holds {what} ({shown}), which an export would replace or "
            "mix with; choose a new or empty directory, or pass --overwrite to replace "
            f"{', '.join(EXPORTED)} there (other files are left alone)"
        )


def weight_names(names: list[str]) -> list[str]:
    """Which of `names` are a model's weight files, as ptdp and transformers name them."""
    return [n for n in names if n in (WEIGHTS_FILE, INDEX_FILE) or SHARD_NAME.fullmatch(n)]


def read_hf_json(directory: Path) -> dict[str, Any]:
    """A directory's config.json as a dict; a missing or unreadable one is named."""
    file = directory / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{directory} has no config.json: not a Hugging Face model")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _unreadable(file, exc) from None
    if not isinstance(config, dict):
        raise _unreadable(file, TypeError("not a JSON object"))
    return config


def read_hf_config(directory: Path, seq_length: int = 0) -> ModelConfig:
    """The model of a directory's config.json; a missing or unreadable one is named, and
    one whose heads do not divide its width, or key/value heads its heads, is refused."""
    config = read_hf_json(directory)
    check_config_numbers(directory, config)
    try:
        cfg = model_config_from_hf(config, seq_length)
        return with_held_mtp(cfg, weight_shapes(directory)) if cfg.mtp_depth else cfg
    except ConfigError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError) as exc:
        raise _unreadable(directory / "config.json", exc) from None


def with_held_mtp(cfg: ModelConfig, names: Iterable[str]) -> ModelConfig:
    """`cfg` with as many multi-token-prediction layers as config.json names and the weights
    (tensor `names`) hold: `transformers` writes num_nextn_predict_layers but saves none.
    Each follows the last layer (`ptdp.convert.hf._mtp_to_hf`)."""
    held, depth = set(names), 0
    while depth < cfg.mtp_depth and f"model.layers.{cfg.num_layers + depth}.eh_proj.weight" in held:
        depth += 1
    return replace(cfg, mtp_depth=depth)


def _unreadable(file: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"cannot read the Hugging Face model config {file} ({type(exc).__name__}: {exc}); "
        "is it a transformers config.json (save_pretrained output)?"
    )


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of `directory` (one, or those its index names), each present
    and whole; [] when it has neither (a pytorch_model.bin, or no weights at all)."""
    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            names = json.loads(index.read_text())["weight_map"].values()
            files = [directory / str(name) for name in sorted(set(names))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(
                f"cannot read the weights index {index} ({type(exc).__name__}: {exc}); it "
                f"must map each tensor name to its file under 'weight_map': {FIX}"
            ) from None
    else:
        return []
    for file in files:
        check_safetensors(file)
    return files


def weight_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the safetensors headers (files checked whole first) or
    pytorch_model.bin (mapped, not read); {} when there are no weights."""
    files = weight_files(directory)
    if files:
        places = tensor_files(directory, files)
        return {name: tuple(info["shape"]) for name, (_, info) in places.items()}
    if (directory / "pytorch_model.bin").is_file():
        state = torch.load(directory / "pytorch_model.bin", mmap=True, weights_only=True)
        return {k: tuple(v.shape) for k, v in state.items()}
    return {}


def read_header(file: Path) -> dict[str, Any]:
    """A safetensors file's header: each tensor's dtype, shape and data offsets."""
    with file.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def tensor_files(directory: Path, files: list[Path]) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Each tensor's file and header entry. A tensor two files hold, or one the index
    places in a file that lacks it, is refused: which copy is the model's is unknown."""
    places: dict[str, tuple[Path, dict[str, Any]]] = {}
    for file in files:
        for name, info in read_header(file).items():
            if name in places:
                raise CheckpointError(
                    f"Hugging Face weights tensor {name!r} is held by two files, "
                    f"{places[name][0]} and {file}, so which is the model's is unknown: "
                    f"the shards are from different exports; {FIX}"
                )
            places[name] = (file, info)
    index = directory / INDEX_FILE
    if not (directory / WEIGHTS_FILE).is_file():  # the files came from the index
        for name, shard in json.loads(index.read_text())["weight_map"].items():
            held = places.get(name, (None,))[0]
            if held is None or held.name != str(shard):
                where = f"it is in {held}" if held else "no file holds it"
                raise CheckpointError(
                    f"the weights index {index} places tensor {name!r} in {shard}, but "
                    f"{where}: the index and the shards are from different exports; {FIX}"
                )
    return places


def check_safetensors(file: Path) -> None:
    """Refuse a missing, truncated or malformed safetensors file, naming it."""
    if not file.is_file():
        raise CheckpointError(f"Hugging Face weights file {file} is missing: {FIX}")
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            _truncated(file, size, 8, "the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            _malformed(file, f"its header length {n} is not that of a safetensors file")
        if size < 8 + n:
            _truncated(file, size, 8 + n, f"its {n}-byte header")
        try:
            header = json.loads(f.read(n))
            ends = [
                int(info["data_offsets"][1])
                for name, info in header.items()
                if name != "__metadata__"
            ]
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            _malformed(file, f"its header is not a safetensors header ({exc})")
    want = 8 + n + max(ends, default=0)
    if size < want:
        _truncated(file, size, want, "the tensors its header lists")


def _truncated(file: Path, size: int, want: int, what: str) -> NoReturn:
    raise CheckpointError(
        f"Hugging Face weights file {file} is truncated ({size} of {want} bytes, the end of "
        f"{what}): the download or copy was cut short; {FIX}"
    )


def _malformed(file: Path, problem: str) -> NoReturn:
    raise CheckpointError(f"Hugging Face weights file {file} is damaged: {problem}; {FIX}")


class HfWeights:
    """A model directory's tensors, opened lazily: safetensors files memory-mapped
    (`safe_open`, read by slice), or pytorch_model.bin mapped by `torch.load(mmap=True)`,
    so a reader of one region reads that region's bytes alone (ptdp/checkpoint/lazy.py).
    Use as a context manager; the files close on exit."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._open: dict[Path, Any] = {}
        files = weight_files(directory)
        if files:
            self.tensors: dict[str, Lazy] = {
                name: Stored(name, tuple(info["shape"]), self._fetcher(file, name))
                for name, (file, info) in tensor_files(directory, files).items()
            }
        elif (directory / "pytorch_model.bin").is_file():
            file = directory / "pytorch_model.bin"
            try:
                state = torch.load(file, mmap=True, weights_only=True)
            except Exception as exc:  # torch raises several types for damaged archives
                problem = f"cannot read Hugging Face weights file {file} ({exc})"
                raise CheckpointError(f"{problem}; {FIX}") from None
            self.tensors = {k: Held(v) for k, v in state.items()}
        else:
            raise CheckpointError(
                f"{directory} holds no {WEIGHTS_FILE}, {INDEX_FILE} or pytorch_model.bin: "
                "is it a Hugging Face model directory (save_pretrained output)?"
            )

    def _fetcher(self, file: Path, name: str) -> Callable[[Region], torch.Tensor]:
        def fetch(region: Region) -> torch.Tensor:
            try:
                return self._handle(file).get_slice(name)[region]
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(
                    f"cannot read tensor {name!r} of Hugging Face weights file {file} "
                    f"({exc}); the file is damaged: {FIX}"
                ) from None

        return fetch

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            try:
                from safetensors import safe_open
            except ImportError as exc:  # pragma: no cover - depends on the environment
                raise ConfigError(
                    "reading Hugging Face weights needs safetensors: pip install 'ptdp[hf]'"
                ) from exc
            self._open[file] = safe_open(str(file), framework="pt")
        return self._open[file]

    def close(self) -> None:
        self._open.clear()  # safe_open handles unmap when dropped

    def __enter__(self) -> HfWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
