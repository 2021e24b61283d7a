"""Corpus formats (Parquet, Arrow, saved datasets), model-directory tokenizers, and the byte
tokenizer's file in datasets and checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tokenizers as hf

from ptdp import checkpoint as ckpt
from ptdp.cli import main
from ptdp.data.preprocess import load_data_tokenizer, preprocess, read_metadata
from ptdp.data.readers import find_input_files
from ptdp.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    byte_tokenizer_json,
    load_tokenizer,
    train_bpe_from_iterator,
)
from ptdp.errors import DataError
from ptdp.sample import sample_from_checkpoint
from ptdp.train.run import train
from tests.helpers import tiny_config

pa = pytest.importorskip("pyarrow", reason="needs pyarrow (pip install .[data])")
pq = pytest.importorskip("pyarrow.parquet", reason="needs pyarrow (pip install .[data])")
datasets = pytest.importorskip("datasets", reason="needs datasets (pip install .[data])")

TEXTS = [
    "Hello, world!\n",
    "café — naïve ✓\r\nsecond line\twith tab",
    "",  # empty documents are skipped in every format
    "  a literal <|endoftext|> marker",
    "日本語のテキスト 🎉",
] + [f"row {i} " + "é" * (i % 5) for i in range(150)]


def _bin(prefix: Path) -> bytes:
    return Path(f"{prefix}.bin").read_bytes() + Path(f"{prefix}.idx").read_bytes()


def _table() -> pa.Table:
    return pa.table({"id": list(range(len(TEXTS))), "body": TEXTS})


@pytest.fixture
def reference(tmp_path: Path) -> Path:
    """The texts as JSON lines in field "body", preprocessed with the byte tokenizer."""
    src = tmp_path / "ref.jsonl"
    src.write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    return preprocess(
        [src], tmp_path / "ref" / "c", "bytes", progress=False, text_key="body"
    ).prefix


def test_parquet_arrow_and_saved_datasets_match_json_lines(tmp_path: Path, reference: Path) -> None:
    table = _table()
    inputs = {}
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=40)
    inputs["parquet"] = tmp_path / "t.parquet"
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink:
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=33)
    inputs["arrow-file"] = tmp_path / "file.arrow"
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=33)
    inputs["arrow-stream"] = tmp_path / "stream.arrow"
    datasets.Dataset.from_dict({"body": TEXTS, "id": list(range(len(TEXTS)))}).save_to_disk(
        str(tmp_path / "saved")
    )
    inputs["saved-dataset"] = tmp_path / "saved"
    for name, path in inputs.items():
        out = preprocess([path], tmp_path / name / "c", "bytes", progress=False, text_key="body")
        assert out.num_docs == len([t for t in TEXTS if t]), name
        assert _bin(out.prefix) == _bin(reference), name
    # Through the command line, --text-key, a saved dataset inside a folder as one input.
    (tmp_path / "folder").mkdir()
    shutil.copytree(tmp_path / "saved", tmp_path / "folder" / "saved")
    assert find_input_files([tmp_path / "folder"]) == [tmp_path / "folder" / "saved"]
    argv = ["preprocess", "--input", str(tmp_path / "folder"), "--tokenizer", "bytes"]
    assert main([*argv, "--output-prefix", str(tmp_path / "cli" / "c"), "--text-key", "body"]) == 0
    assert _bin(tmp_path / "cli" / "c") == _bin(reference)


def test_table_inputs_name_the_problem(tmp_path: Path) -> None:
    pq.write_table(_table(), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t\.parquet: no column 'text' \(columns: id, body\)"):
        preprocess([tmp_path / "t.parquet"], tmp_path / "o", "bytes", progress=False)
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
    with pytest.raises(DataError, match="row 1 has no 'text'"):
        preprocess([tmp_path / "null.parquet"], tmp_path / "o", "bytes", progress=False)
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(DataError, match="column 'text' holds int64, not text"):
        preprocess([tmp_path / "ints.parquet"], tmp_path / "o", "bytes", progress=False)
    (tmp_path / "bad.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(DataError, match="not an Arrow IPC file or stream"):
        preprocess([tmp_path / "bad.arrow"], tmp_path / "o", "bytes", progress=False)
    ds = datasets.Dataset.from_dict({"text": ["a", "b"]})
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"a DatasetDict .*splits: test, train.*--input .*test"):
        preprocess([tmp_path / "dict"], tmp_path / "o", "bytes", progress=False)
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match=r"no string 'body' field \(its keys: text\).*--text-key"):
        preprocess([jsonl], tmp_path / "o", "bytes", progress=False, text_key="body")


# ---------------------------------------------------------------- tokenizers


def _bpe(path: Path) -> HFTokenizer:
    texts = [t for t in TEXTS if t] * 3
    return train_bpe_from_iterator(texts, 320, path)


def test_hf_model_directory_tokenizers(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="needs transformers (pip install .[hf])")
    original = _bpe(tmp_path / "bpe" / "tokenizer.json")
    # A model directory holding tokenizer.json.
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copyfile(original.path, model_dir / "tokenizer.json")
    (model_dir / "config.json").write_text("{}")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS if t))
    by_file = preprocess([src], tmp_path / "f" / "c", str(original.path), progress=False)
    by_dir = preprocess([src], tmp_path / "d" / "c", str(model_dir), progress=False)
    assert _bin(by_dir.prefix) == _bin(by_file.prefix)
    # A directory without tokenizer.json (vocab.json + merges.txt, as GPT-2 ships):
    # transformers reads it; the dataset keeps the converted tokenizer.json.
    slow_dir = tmp_path / "slow"
    slow_dir.mkdir()
    hf.Tokenizer.from_file(str(original.path)).model.save(str(slow_dir))
    (slow_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"})
    )
    converted = load_tokenizer(slow_dir)
    assert isinstance(converted, HFTokenizer) and converted.eod_id == original.eod_id
    for text in TEXTS:
        assert converted.encode(text) == original.encode(text)
    by_slow = preprocess([src], tmp_path / "s" / "c", str(slow_dir), progress=False)
    assert _bin(by_slow.prefix) == _bin(by_file.prefix)
    assert json.loads((tmp_path / "s" / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    with pytest.raises(DataError, match="transformers cannot load a tokenizer"):
        (tmp_path / "empty").mkdir()
        load_tokenizer(tmp_path / "empty")  # a folder with no tokenizer files


def test_end_of_document_of_other_model_families(tmp_path: Path) -> None:
    tok = hf.Tokenizer(hf.models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3}, "<unk>"))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).eod_id == 2  # Llama's </s>, not the lowest special <unk>


def test_byte_tokenizer_file_is_a_hugging_face_tokenizer() -> None:
    plain = hf.Tokenizer.from_str(byte_tokenizer_json())  # any tokenizers user can load it
    plain.encode_special_tokens = True
    ours = ByteTokenizer()
    assert plain.get_vocab_size(with_added_tokens=True) == 257
    assert plain.token_to_id("<|endoftext|>") == 256
    for text in [t for t in TEXTS if t] + ["\x00\x7f\xa0 ", "".join(map(chr, range(1, 600)))]:
        ids = plain.encode(text, add_special_tokens=False).ids
        assert ids == ours.encode(text)
        assert plain.decode(ids + [256], skip_special_tokens=True) == text


def test_bytes_tokenizer_round_trips_from_dataset_and_checkpoint(
    tiny_data: str, tmp_path: Path
) -> None:
    data_file = Path(tiny_data).parent / "tokenizer.json"
    assert read_metadata(tiny_data)["tokenizer"] == "tokenizer.json"
    assert data_file.read_text() == byte_tokenizer_json()
    assert isinstance(load_data_tokenizer(tiny_data), ByteTokenizer)
    assert isinstance(load_tokenizer(data_file), ByteTokenizer)
    # Checkpoints hold the file, whether the data names it or data.tokenizer = bytes does.
    for run, data in [("from_data", {}), ("named", {"tokenizer": "bytes"})]:
        cfg = tiny_config(tiny_data, tmp_path / run, train={"steps": 1}, data=data)
        train(cfg)
        step_dir = ckpt.find_checkpoint(tmp_path / run)
        assert ckpt.load_checkpoint(step_dir)["tokenizer"] == "tokenizer.json"
        assert (step_dir / "tokenizer.json").read_text() == byte_tokenizer_json()
    # `ptdp generate` needs the checkpoint alone: move it away from the data.
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "named", moved)
    text = sample_from_checkpoint(moved, "to be", max_new_tokens=4, temperature=0)[0]
    assert text.startswith("to be") and len(text.encode()) <= len("to be") + 4
