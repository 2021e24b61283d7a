"""GPT pretraining samples: fixed windows over the concatenated token stream, reshuffled per epoch.

Letters: s = seq_length. A sample is s + 1 tokens, input ``x[:-1]`` and target ``x[1:]``;
consecutive windows share one token so no token is a target twice in an epoch. Samples
are addressed by a global index k that counts across epochs, so resuming training needs only the
number of samples consumed and the seed: no sampler state to checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ptdp.data.documents import DocumentIndex
from ptdp.data.indexed import IndexedDataset
from ptdp.errors import DataError

SPLITS = ("train", "valid")


class GPTDataset:
    """Windows of s + 1 tokens with stride s over one split of an indexed dataset.

    The stream is the whole ``.bin`` (documents in file order, each ending with EOD). Train is
    its first ``1 - valid_fraction`` of tokens, valid the rest, so the two never share a token.
    Train order is a fresh permutation per epoch from ``default_rng([seed, epoch])``; valid
    keeps file order so validation loss is comparable across evaluations.
    """

    def __init__(
        self,
        prefix_or_indexed: str | Path | IndexedDataset,
        seq_length: int,
        split: str,
        valid_fraction: float = 0.05,
        seed: int = 1234,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {SPLITS}")
        if seq_length < 1:
            raise ValueError(f"seq_length {seq_length} must be at least 1")
        if not 0.0 <= valid_fraction < 1.0:
            raise DataError(
                f"valid_fraction {valid_fraction} is outside [0, 1); use e.g. 0.05, or 0 for "
                f"no validation split"
            )
        indexed = (
            prefix_or_indexed
            if isinstance(prefix_or_indexed, IndexedDataset)
            else IndexedDataset(prefix_or_indexed)
        )
        self.indexed = indexed
        self.seq_length = seq_length
        self.split = split
        self.seed = seed
        total = indexed.num_tokens
        num_train = total - int(total * valid_fraction)
        # [start, stop) token range of this split within the stream.
        self.start, self.stop = (0, num_train) if split == "train" else (num_train, total)
        self.num_tokens = self.stop - self.start
        self.num_samples = max(0, (self.num_tokens - 1) // seq_length)
        if split == "train" and self.num_samples == 0:
            raise DataError(
                f"{indexed.bin_path}: the corpus has {total} tokens ({self.num_tokens} in the "
                f"train split) but one sample needs seq_length + 1 = {seq_length + 1}; lower "
                f"model.seq_length or add data"
            )
        self._tokens = indexed.tokens
        self._documents = DocumentIndex.of(indexed)
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def epoch_of(self, k: int) -> int:
        """Epoch that global sample index ``k`` falls in."""
        if self.num_samples == 0:
            raise IndexError(f"the {self.split} split of {self.indexed.prefix} has no samples")
        return k // self.num_samples

    def _permutation(self, epoch: int) -> np.ndarray:
        # Cached: consecutive k almost always share an epoch.
        if epoch != self._perm_epoch:
            dtype = np.int32 if self.num_samples < 2**31 else np.int64
            perm = np.arange(self.num_samples, dtype=dtype)
            np.random.default_rng([self.seed, epoch]).shuffle(perm)
            self._perm, self._perm_epoch = perm, epoch
        return self._perm

    def window_of(self, k: int) -> int:
        """Window (position in the split, in units of s) that global sample ``k`` reads."""
        if k < 0:
            raise IndexError(f"sample index {k} is negative")
        if self.num_samples == 0:
            raise IndexError(f"the {self.split} split of {self.indexed.prefix} has no samples")
        epoch, j = divmod(k, self.num_samples)
        if self.split == "valid":
            return j
        return int(self._permutation(epoch)[j])

    def _begin(self, k: int) -> int:
        """Stream offset of global sample ``k``'s first token."""
        return self.start + self.window_of(k) * self.seq_length

    def sample(self, k: int) -> np.ndarray:
        """Global sample ``k`` as int64[s + 1]."""
        begin = self._begin(k)
        return np.asarray(self._tokens[begin : begin + self.seq_length + 1], dtype=np.int64)

    def documents(self, k: int) -> np.ndarray:
        """int64[s]: the document of each input token of sample ``k``, from 0 for the first
        (``ptdp.data.documents``)."""
        return self._documents.window(self._begin(k), self.seq_length)

    def batch(self, start: int, count: int) -> torch.Tensor:
        """Samples ``start .. start + count - 1`` as a LongTensor [count, s + 1]."""
        return stack_samples(self.sample, start, count, self.seq_length + 1)

    def document_batch(self, start: int, count: int) -> torch.Tensor:
        """Their ``documents`` as a LongTensor [count, s]."""
        return stack_samples(self.documents, start, count, self.seq_length)


def stack_samples(
    read: Callable[[int], np.ndarray], start: int, count: int, width: int
) -> torch.Tensor:
    """``read(start) .. read(start + count - 1)`` as the rows of a LongTensor [count, width]."""
    out = np.empty((count, width), dtype=np.int64)
    for i in range(count):
        out[i] = read(start + i)
    return torch.from_numpy(out)
