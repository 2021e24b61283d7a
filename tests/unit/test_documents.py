"""Document masking: the boundaries read from the index (edge cases against a count of the
tokens), the positions built from them, a packed window equal to each document run alone,
and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ptdp.config.files import apply_updates
from ptdp.config.sections import DataConfig, RunConfig
from ptdp.data.blend import BlendedDataset
from ptdp.data.dataset import GPTDataset
from ptdp.data.documents import DocumentIndex, microbatch_positions, window_positions
from ptdp.data.indexed import IndexedDataset, IndexedWriter
from ptdp.data.preprocess import preprocess
from ptdp.errors import ConfigError, DataError
from ptdp.model.gpt import GPT
from ptdp.model.positions import TokenPositions
from ptdp.rules.layout import validate
from ptdp.train.data_setup import open_data
from tests.helpers import LLAMA, tiny_config

EOD = 9


def _index(sequences: list[int], docs: list[int]) -> DocumentIndex:
    """An index of sequences of these sizes (int16 tokens) grouped into documents that
    start at the sequences `docs` (Megatron's doc_idx, ending with the sequence count)."""
    pointers = np.concatenate([[0], np.cumsum(sequences)[:-1]]).astype(np.int64) * 2
    return DocumentIndex(pointers, np.asarray(docs, dtype=np.int64), 2)


def _expected(doc_sizes: list[int], begin: int, length: int) -> list[int]:
    """Document numbers by counting: each token's document, from the first one's."""
    owner = [d for d, n in enumerate(doc_sizes) for _ in range(n)][begin : begin + length]
    return [d - owner[0] for d in owner]


# Documents of 3, 1, 1, 0 (an empty one, as Megatron's data may hold), 5 and 4 tokens.
SIZES = [3, 1, 1, 0, 5, 4]


@pytest.mark.parametrize(
    "begin,length,case",
    [
        (0, 4, "boundary inside"),
        (3, 5, "a document starts the window, then single-token documents"),
        (2, 3, "consecutive boundaries"),
        (0, 3, "the window ends with its document's last token"),
        (6, 4, "no boundary: one document"),
        (4, 7, "across an empty document"),
        (0, 14, "the whole stream"),
    ],
)
def test_window_documents_on_edge_cases(begin: int, length: int, case: str) -> None:
    one_per_doc = _index(SIZES, list(range(len(SIZES) + 1)))
    expected = _expected(SIZES, begin, length)
    assert one_per_doc.window(begin, length).tolist() == expected, case
    # Megatron's sentence-split data: documents of several sequences (and an empty sequence).
    sentences = [2, 1, 1, 1, 0, 2, 3, 4]  # doc 0 = 2+1, doc 1, doc 2, doc 3 (empty), 0+2+3, 4
    split = _index(sentences, [0, 2, 3, 4, 4, 7, 8])
    assert split.window(begin, length).tolist() == expected, case
    if case.startswith("no boundary"):
        assert set(expected) == {0}


def test_documents_of_preprocessed_data_end_at_their_eod(tmp_path: Path) -> None:
    """ptdp's data ends each document with EOD: the index's documents are exactly the
    EOD-closed runs of tokens, whatever window a (shuffled) sample reads."""
    rnd = np.random.default_rng(0)
    prefix = tmp_path / "docs"
    with IndexedWriter(prefix, np.int16) as writer:
        for _ in range(40):
            body = rnd.integers(0, EOD, int(rnd.integers(0, 6)))  # empty text: EOD alone
            writer.add_document([*body, EOD])
    indexed = IndexedDataset(prefix)
    for split in ("train", "valid"):
        data = GPTDataset(indexed, seq_length=7, split=split, valid_fraction=0.2, seed=3)
        for k in range(len(data)):
            inputs = data.sample(k)[:-1]
            closed = np.concatenate([[0], np.cumsum(inputs == EOD)[:-1]])  # EOD ends its own
            assert data.documents(k).tolist() == closed.tolist(), (split, k)
        rows = data.document_batch(1, 3)
        assert rows.shape == (3, 7) and rows[1].tolist() == data.documents(2).tolist()
    masking = DataConfig(document_mask=True, reset_positions=True)
    for first in range(0, len(data) - 2):
        got = microbatch_positions(data, first, 2, masking, torch.device("cpu"))
        want = window_positions(data.document_batch(first, 2), reset=True)
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got.position, want.position)
            assert torch.equal(got.document, want.document)
    assert microbatch_positions(data, 0, 2, DataConfig(), torch.device("cpu")) is None
    blend = BlendedDataset([data, GPTDataset(indexed, 7, "train", seed=5)], [0.5, 0.5])
    for k in range(6):  # each sample's documents come from the dataset it is drawn from
        i, n = blend.source(k)
        assert blend.document_batch(k, 1)[0].tolist() == blend.datasets[i].documents(n).tolist()


def test_window_positions() -> None:
    one = torch.tensor([[0, 0, 0, 0], [3, 3, 3, 3]])
    assert window_positions(one, reset=True) is None  # the fused causal path
    docs = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    kept = window_positions(docs, reset=False)
    assert kept.position is None and kept.index.tolist() == list(range(6))
    assert torch.equal(kept.document, docs)
    reset = window_positions(docs, reset=True)
    assert reset.position.tolist() == [[0, 1, 0, 1, 2, 0], list(range(6))]
    edges = window_positions(torch.tensor([[0, 1, 2, 2, 3, 4]]), reset=True)
    assert edges.position.tolist() == [[0, 0, 0, 1, 0, 0]]


SIZES_MODEL = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 16}
FAMILIES = {
    "learned": {"vocab_size": 64},
    "rope": {**LLAMA, "vocab_size": 64},
    "window": {**LLAMA, "vocab_size": 64, "sliding_window": 3},
}
DOCS = [[0, 5, 9, 16], [0, 1, 2, 12, 16]]
"""Document starts of each row (and the window's end): a one-token document, two
consecutive ones, documents longer and shorter than the sliding window."""


@pytest.mark.parametrize("reset", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_window_equals_each_document_alone(family: str, reset: bool) -> None:
    cfg = apply_updates(RunConfig(), {"model": {**SIZES_MODEL, **FAMILIES[family]}}, "test").model
    model = GPT(cfg, seed=4)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 64, (2, 16), generator=gen)
    labels = torch.randint(0, 64, (2, 16), generator=gen)
    documents = torch.zeros(2, 16, dtype=torch.long)
    for row, starts in enumerate(DOCS):
        for d, (a, b) in enumerate(zip(starts, starts[1:])):
            documents[row, a:b] = d
    positions = window_positions(documents, reset=reset)
    packed = model(tokens, positions=positions)
    loss = model(tokens, labels, positions=positions) * tokens.numel()  # token-loss sum
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone_loss = torch.zeros(())
    for row, starts in enumerate(DOCS):
        for a, b in zip(starts, starts[1:]):
            ids = None if reset else TokenPositions(torch.arange(b - a), torch.arange(a, b)[None])
            logits = model(tokens[row : row + 1, a:b], positions=ids)
            torch.testing.assert_close(logits[0], packed[row, a:b], rtol=1e-5, atol=1e-5)
            doc_loss = model(tokens[row : row + 1, a:b], labels[row : row + 1, a:b], positions=ids)
            alone_loss = alone_loss + doc_loss * (b - a)
    alone_loss.backward()
    torch.testing.assert_close(loss, alone_loss, rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, packed_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    # Without the mask the later documents read the earlier ones: the test can fail.
    plain = model(tokens)
    assert not torch.allclose(plain[0, 5:9], packed[0, 5:9], atol=1e-3)


def test_reset_positions_needs_document_mask(tmp_path: Path) -> None:
    cfg = tiny_config("unused", tmp_path, data={"reset_positions": True})
    with pytest.raises(ConfigError, match="data.reset_positions = true .* --data.document_mask"):
        validate(cfg)
    validate(tiny_config("unused", tmp_path, data={"reset_positions": True, "document_mask": True}))


def test_document_mask_refuses_data_of_one_document(tmp_path: Path) -> None:
    lines = tmp_path / "one.jsonl"
    lines.write_text(json.dumps({"text": "a single long document " * 20}) + "\n")
    preprocess([lines], tmp_path / "one", "bytes", progress=False)
    cfg = tiny_config(str(tmp_path / "one"), tmp_path, data={"document_mask": True})
    cfg = apply_updates(cfg, {"model": {"seq_length": 16}}, "test")
    with pytest.raises(
        DataError, match="one.idx records a single document.*--data.document_mask false"
    ):
        open_data(cfg)
    open_data(apply_updates(cfg, {"data": {"document_mask": False}}, "test"))
