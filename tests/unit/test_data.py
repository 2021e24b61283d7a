"""Data pipeline: Megatron indexed format, tokenizers, preprocessing and GPT samples."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from ptdp.data.dataset import GPTDataset
from ptdp.data.indexed import IndexedDataset, IndexedWriter, optimal_dtype
from ptdp.data.preprocess import load_data_tokenizer, preprocess, read_metadata
from ptdp.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe
from ptdp.errors import DataError

DOCS = [
    "Hello, world!\n",
    "café — naïve ✓\r\nsecond line\twith tab",
    "  leading spaces and a literal <|endoftext|> marker",
    "日本語のテキスト 🎉",
]


def _write(prefix: Path, docs: list[list[int]], dtype: np.dtype) -> None:
    with IndexedWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)


def _random_docs(n: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(0, 20))).tolist() for _ in range(n)]


def _corpus(n_docs: int, seed: int = 0) -> list[str]:
    words = "the quick brown fox jumps over a lazy dog while café naïve ✓ data flows".split()
    rnd = random.Random(seed)
    return [" ".join(rnd.choice(words) for _ in range(rnd.randint(5, 40))) for _ in range(n_docs)]


# ---------------------------------------------------------------- indexed format


@pytest.mark.parametrize(("vocab", "code"), [(1000, 8), (70000, 4)])
def test_indexed_round_trip_and_header(tmp_path: Path, vocab: int, code: int) -> None:
    dtype = optimal_dtype(vocab)
    docs = _random_docs(7, vocab)
    prefix = tmp_path / "d.v1"  # a dot in the prefix must not be treated as a suffix
    _write(prefix, docs, dtype)
    assert not list(tmp_path.glob("*.tmp"))

    raw = (tmp_path / "d.v1.idx").read_bytes()
    magic, version, dcode, n, d = struct.unpack_from("<9sQBQQ", raw, 0)
    assert (magic, version, dcode, n, d) == (b"MMIDIDX\x00\x00", 1, code, 7, 8)
    off = 34
    sizes = struct.unpack_from(f"<{n}i", raw, off)
    pointers = struct.unpack_from(f"<{n}q", raw, off + 4 * n)
    doc_idx = struct.unpack_from(f"<{d}q", raw, off + 12 * n)
    assert len(raw) == off + 12 * n + 8 * d
    assert list(sizes) == [len(x) for x in docs]
    assert list(pointers) == list(np.cumsum([0] + list(sizes[:-1])) * dtype.itemsize)
    assert list(doc_idx) == list(range(n + 1))

    ds = IndexedDataset(prefix)
    assert ds.dtype == dtype and len(ds) == 7 and ds.sizes.dtype == np.int32
    assert ds.num_tokens == sum(len(x) for x in docs)
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == doc
    assert ds[-1].tolist() == docs[-1]
    assert ds.tokens.tolist() == [t for doc in docs for t in doc]
    assert (tmp_path / "d.v1.bin").stat().st_size == ds.num_tokens * dtype.itemsize


def test_writer_merge_and_abort(tmp_path: Path) -> None:
    a, b = _random_docs(3, 500, seed=1), _random_docs(4, 500, seed=2)
    _write(tmp_path / "a", a, np.uint16)
    _write(tmp_path / "b", b, np.uint16)
    with IndexedWriter(tmp_path / "ab", np.uint16) as w:
        w.merge(tmp_path / "a")
        w.merge(tmp_path / "b")
    ds = IndexedDataset(tmp_path / "ab")
    assert [ds[i].tolist() for i in range(len(ds))] == a + b
    assert ds.doc_idx.tolist() == list(range(8))

    with pytest.raises(RuntimeError), IndexedWriter(tmp_path / "bad", np.uint16) as w:
        w.add_document([1, 2])
        raise RuntimeError("boom")
    assert not list(tmp_path.glob("bad*"))


def _corrupt_cases(tmp_path: Path) -> list[tuple[str, Path, str]]:
    """(name, prefix, file name the error must mention) for each kind of damage."""
    cases = []
    for name in ("trunc_bin", "trunc_idx", "magic", "no_bin", "no_idx", "pointers", "version"):
        prefix = tmp_path / name
        _write(prefix, [[1, 2, 3], [4, 5], [6]], np.uint16)
        bin_, idx = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
        raw = bytearray(idx.read_bytes())
        culprit = idx
        if name == "trunc_bin":
            bin_.write_bytes(bin_.read_bytes()[:-2])
            culprit = bin_
        elif name == "trunc_idx":
            idx.write_bytes(bytes(raw[:-5]))
        elif name == "magic":
            raw[0:9] = b"NOTMAGIC!"
            idx.write_bytes(bytes(raw))
        elif name == "no_bin":
            bin_.unlink()
            culprit = bin_
        elif name == "no_idx":
            idx.unlink()
        elif name == "pointers":
            struct.pack_into("<q", raw, 34 + 4 * 3 + 8, 99)
            idx.write_bytes(bytes(raw))
        elif name == "version":
            struct.pack_into("<Q", raw, 9, 2)
            idx.write_bytes(bytes(raw))
        cases.append((name, prefix, culprit.name))
    return cases


def test_indexed_corruption_raises_data_error(tmp_path: Path) -> None:
    for name, prefix, culprit in _corrupt_cases(tmp_path):
        with pytest.raises(DataError) as info:
            IndexedDataset(prefix)
        assert culprit in str(info.value), name
        if name.startswith("no_"):
            assert "ptdp preprocess" in str(info.value)


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_and_load() -> None:
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eod_id) == (257, 256)
    for text in DOCS:
        assert tok.decode(tok.encode(text) + [tok.eod_id]) == text
    with pytest.raises(DataError, match="nope.json"):
        load_tokenizer("nope.json")


def test_train_bpe_round_trip(tmp_path: Path) -> None:
    files = []
    for i, text in enumerate(_corpus(40)):
        files.append(tmp_path / f"c{i}.txt")
        files[-1].write_text(text, encoding="utf-8")
    tok = train_bpe(files, 300, tmp_path / "tok" / "tokenizer.json")
    assert isinstance(tok, HFTokenizer) and tok.vocab_size <= 300
    assert tok.encode("<|endoftext|>") != [tok.eod_id]  # literal text cannot forge EOD
    for text in DOCS + ["unseen ßymbols ∑ and \x00 bytes"]:
        ids = tok.encode(text)
        assert tok.eod_id not in ids
        assert tok.decode(ids + [tok.eod_id]) == text
    assert isinstance(load_tokenizer(str(tmp_path / "tok")), HFTokenizer)


# ---------------------------------------------------------------- preprocess


def _write_inputs(root: Path, docs: list[str]) -> Path:
    """Half the docs as .txt files in a nested folder, the rest in one .jsonl."""
    src = root / "src"
    (src / "sub").mkdir(parents=True)
    half = len(docs) // 2
    for i, text in enumerate(docs[:half]):
        (src / "sub" / f"{i:03d}.txt").write_bytes(text.encode("utf-8"))
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(docs[half:])]
    (src / "zz.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (src / "ignored.md").write_text("not an input")
    return src


def _check_round_trip(prefix: Path, docs: list[str]) -> None:
    ds = IndexedDataset(prefix)
    tok = load_data_tokenizer(prefix)
    assert tok is not None and len(ds) == len(docs)
    for i, text in enumerate(docs):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod_id and tok.eod_id not in ids[:-1]
        assert tok.decode(ids[:-1]) == text


def test_preprocess_bytes(tmp_path: Path) -> None:
    src = _write_inputs(tmp_path, DOCS)
    res = preprocess([src], tmp_path / "out" / "corpus", "bytes", progress=False)
    assert (res.num_docs, res.vocab_size, res.eod_id) == (4, 257, 256)
    assert res.tokenizer == str(tmp_path / "out" / "tokenizer.json")  # the byte tokenizer's file
    assert isinstance(load_data_tokenizer(res.prefix), ByteTokenizer)
    _check_round_trip(res.prefix, DOCS)
    meta = read_metadata(res.prefix)
    assert meta is not None and meta["format"] == "ptdp-indexed-v1"
    assert meta["tokenizer"] == "tokenizer.json" and meta["num_tokens"] == res.num_tokens
    assert meta["inputs"][-1].endswith("zz.jsonl") and len(meta["inputs"]) == 3
    assert res.num_tokens == sum(len(d.encode()) + 1 for d in DOCS)


def test_preprocess_bpe_and_tokenizer_path(tmp_path: Path) -> None:
    docs = _corpus(30) + DOCS
    src = _write_inputs(tmp_path, docs)
    # Sorted file order: sub/000.txt.. first, then zz.jsonl, matching `docs` order.
    res = preprocess([src], tmp_path / "bpe" / "c", "bpe", vocab_size=300, progress=False)
    assert res.tokenizer.endswith("tokenizer.json") and res.vocab_size <= 300
    assert read_metadata(res.prefix)["tokenizer"] == "tokenizer.json"
    _check_round_trip(res.prefix, docs)

    res2 = preprocess([src], tmp_path / "copy" / "c", res.tokenizer, workers=2, progress=False)
    assert (tmp_path / "copy" / "tokenizer.json").read_bytes() == Path(res.tokenizer).read_bytes()
    _check_round_trip(res2.prefix, docs)
    assert Path(f"{res2.prefix}.bin").read_bytes() == Path(f"{res.prefix}.bin").read_bytes()


def test_preprocess_workers_identical(tmp_path: Path) -> None:
    docs = [f"document {i}: " + "é" * (i % 7) for i in range(300)]
    src = _write_inputs(tmp_path, docs)
    one = preprocess([src], tmp_path / "w1" / "c", "bytes", workers=1, progress=False)
    two = preprocess([src], tmp_path / "w2" / "c", "bytes", workers=2, progress=False)
    for ext in (".bin", ".idx"):
        assert Path(f"{one.prefix}{ext}").read_bytes() == Path(f"{two.prefix}{ext}").read_bytes()


def test_preprocess_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        preprocess([bad], tmp_path / "o", "bytes", progress=False)
    assert not list(tmp_path.glob("o.*"))
    with pytest.raises(DataError, match="no inputs"):
        preprocess([], tmp_path / "o", "bytes", progress=False)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="no documents"):
        preprocess([empty], tmp_path / "o", "bytes", progress=False)
    with pytest.raises(DataError, match="missing.txt"):
        preprocess([tmp_path / "missing.txt"], tmp_path / "o", "bytes", progress=False)
    assert read_metadata(tmp_path / "o") is None and load_data_tokenizer(tmp_path / "o") is None


# ---------------------------------------------------------------- GPT dataset


@pytest.fixture
def stream(tmp_path: Path) -> tuple[Path, np.ndarray]:
    docs = _random_docs(40, 250, seed=3)
    prefix = tmp_path / "s"
    _write(prefix, docs, np.uint16)
    return prefix, np.array([t for d in docs for t in d], dtype=np.int64)


def test_windows_are_contiguous_with_one_token_overlap(stream: tuple[Path, np.ndarray]) -> None:
    prefix, tokens = stream
    s = 8
    ds = GPTDataset(prefix, s, "valid", valid_fraction=0.5)  # valid is unshuffled
    assert len(ds) == (ds.num_tokens - 1) // s
    for k in range(len(ds)):
        x = ds.sample(k)
        assert x.dtype == np.int64 and x.shape == (s + 1,)
        assert np.array_equal(x, tokens[ds.start + k * s : ds.start + k * s + s + 1])
        if k + 1 < len(ds):
            assert x[-1] == ds.sample(k + 1)[0]
    assert np.array_equal(ds.sample(len(ds)), ds.sample(0))  # epoch 2, same order


def test_shuffle_is_deterministic_and_complete(stream: tuple[Path, np.ndarray]) -> None:
    prefix, tokens = stream
    indexed = IndexedDataset(prefix)
    a = GPTDataset(indexed, 4, "train", seed=7)
    b = GPTDataset(prefix, 4, "train", seed=7)
    c = GPTDataset(prefix, 4, "train", seed=8)
    n = len(a)
    order = [a.window_of(k) for k in range(3 * n)]
    assert order == [b.window_of(k) for k in range(3 * n)]
    assert order[:n] != [c.window_of(k) for k in range(n)]
    epochs = [order[e * n : (e + 1) * n] for e in range(3)]
    assert all(sorted(ep) == list(range(n)) for ep in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert [a.epoch_of(k) for k in (0, n - 1, n, 2 * n + 1)] == [0, 0, 1, 2]
    k = n + 5
    w = a.window_of(k)
    assert np.array_equal(a.sample(k), tokens[w * 4 : w * 4 + 5])


def test_splits_disjoint_and_cover(stream: tuple[Path, np.ndarray]) -> None:
    prefix, tokens = stream
    train = GPTDataset(prefix, 5, "train", valid_fraction=0.1)
    valid = GPTDataset(prefix, 5, "valid", valid_fraction=0.1)
    assert (train.start, train.stop, valid.start, valid.stop) == (
        0,
        len(tokens) - int(len(tokens) * 0.1),
        train.stop,
        len(tokens),
    )

    def positions(ds: GPTDataset) -> set[int]:
        return {ds.start + ds.window_of(k) * 5 + i for k in range(len(ds)) for i in range(6)}

    train_pos, valid_pos = positions(train), positions(valid)
    assert max(train_pos) < train.stop and min(valid_pos) >= valid.start
    assert not train_pos & valid_pos
    none = GPTDataset(prefix, 5, "valid", valid_fraction=0.0)
    assert len(none) == 0 and none.num_tokens == 0


def test_batch_matches_samples(stream: tuple[Path, np.ndarray]) -> None:
    prefix, _ = stream
    ds = GPTDataset(prefix, 6, "train")
    start = len(ds) - 2  # crosses an epoch boundary
    batch = ds.batch(start, 5)
    assert batch.dtype == torch.long and batch.shape == (5, 7)
    expected = np.stack([ds.sample(start + i) for i in range(5)])
    assert torch.equal(batch, torch.from_numpy(expected))


def test_too_short_corpus(tmp_path: Path) -> None:
    _write(tmp_path / "tiny", [[1, 2, 3], [4, 5]], np.uint16)
    with pytest.raises(DataError, match=r"tiny\.bin.*5 tokens.*seq_length"):
        GPTDataset(tmp_path / "tiny", 16, "train", valid_fraction=0.0)
