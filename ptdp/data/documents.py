"""Document boundaries inside packed training windows, for document masking.

Letters: b = micro_batch_size, s = seq_length. A training window packs the end of one
document, whole short documents and the start of another; with `data.document_mask` each
token attends only within its own document, as if every document ran alone.

The boundaries come from the dataset's index, not from scanning for an end-of-document
token: the ``.idx`` records where every document ends (Megatron's ``doc_idx``, over its
sequences), so data made with or without EOD tokens (Megatron's ``--append-eod`` is
optional) and any tokenizer's EOD id are handled alike, and no token inside a document's
text can end it. ``ptdp preprocess`` ends each document with EOD, so the EOD belongs to
the document it closes and the next token starts a new one.

Labels are left as they are: the label of a document's last input token (its EOD) is the
next document's first token, as in Megatron-LM's default (``eod_mask_loss`` off). That
EOD reads only its own document, so no attention crosses a boundary and the loss stays
the mean over all s tokens of the window, with or without masking; a document run alone
with its own slice of the window's labels gives the same logits and per-token losses.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from ptdp.config.sections import DataConfig
from ptdp.data.indexed import IndexedDataset
from ptdp.errors import DataError
from ptdp.model.positions import TokenPositions


class Documents(Protocol):
    """A dataset that knows its documents (`GPTDataset`, `BlendedDataset`)."""

    def document_batch(self, start: int, count: int) -> torch.Tensor: ...


class DocumentIndex:
    """Which document each token of a dataset's stream belongs to.

    Two binary searches over the memory-mapped index per token (sequence, then document),
    so nothing of the size of the corpus is built in memory.
    """

    def __init__(self, pointers: np.ndarray, doc_idx: np.ndarray, itemsize: int) -> None:
        self._pointers = pointers  # int64[N] byte offset of each sequence
        self._doc_idx = doc_idx  # int64[D] first sequence of each document, then N
        self._itemsize = itemsize

    @classmethod
    def of(cls, indexed: IndexedDataset) -> DocumentIndex:
        return cls(indexed.pointers, indexed.doc_idx, indexed.dtype.itemsize)

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    def window(self, begin: int, length: int) -> np.ndarray:
        """int64[length]: the document of tokens begin .. begin + length - 1 of the stream,
        numbered from 0 for the first token's document (empty documents count too, so
        numbers may skip; only equality matters)."""
        offsets = (np.arange(begin, begin + length, dtype=np.int64)) * self._itemsize
        # The last sequence starting at or before each token holds it (an empty sequence
        # shares its pointer with the next one, and side="right" skips past it).
        sequence = np.searchsorted(self._pointers, offsets, side="right") - 1
        document = np.searchsorted(self._doc_idx, sequence, side="right") - 1
        return document - document[0]


def require_documents(indexed: IndexedDataset) -> None:
    """data.document_mask needs a dataset whose index tells documents apart."""
    if len(indexed.doc_idx) - 1 < 2:
        raise DataError(
            f"data.document_mask = true but {indexed.idx_path} records a single document "
            f"({indexed.num_tokens} tokens), so no window has documents to keep apart; "
            "preprocess the corpus with one document per file, line or row (`ptdp preprocess` "
            "records each one in the .idx), or set --data.document_mask false"
        )


def window_positions(documents: torch.Tensor, *, reset: bool) -> TokenPositions | None:
    """The positions of a microbatch from its tokens' documents [b, s] (numbers that grow
    along each row exactly at each boundary, e.g. `DocumentIndex.window`).

    None when every row lies in one document: the fused causal kernel then does the same
    work without building a mask. With `reset`, each document's positions start at 0
    (the first, partial, document of a row too, as Megatron-LM's ``reset_position_ids``).
    """
    if bool((documents[:, 0] == documents[:, -1]).all()):
        return None
    s = documents.shape[1]
    index = torch.arange(s, device=documents.device)
    position = None
    if reset:
        starts = torch.ones_like(documents, dtype=torch.bool)
        starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
        first = torch.where(starts, index, 0).cummax(dim=1).values  # each token's doc start
        position = index - first
    return TokenPositions(index, position, documents)


def microbatch_positions(
    dataset: Documents, first_sample: int, count: int, data: DataConfig, device: torch.device
) -> TokenPositions | None:
    """The positions of samples first_sample .. + count - 1 of `dataset` under
    data.document_mask and data.reset_positions; None without masking (the fused path)."""
    if not data.document_mask:
        return None
    # Built on the host, where the one-document test costs no device synchronisation.
    host = window_positions(dataset.document_batch(first_sample, count), reset=data.reset_positions)
    if host is None:
        return None
    position = None if host.position is None else host.position.to(device)
    return TokenPositions(host.index.to(device), position, host.document.to(device))
