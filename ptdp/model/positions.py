"""Where each token of a training window sits, for attention and position embeddings.

A plain window needs nothing: token i is at position i and attends to every j <= i, which
the fused causal kernel does without a mask. Two features break that picture:
context parallelism hands a rank non-contiguous pieces of the window, and document masking
gives each packed document its own causal mask (and, optionally, its own positions).
Both reduce to three per-token facts, carried together from the data loader to every
attention layer and every pipeline stage (each stage derives them from its microbatch,
never from a received tensor).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TokenPositions:
    """Per-token facts of the local tokens of one microbatch."""

    index: torch.Tensor
    """[s] long: each local token's index in the full training window (the causal order)."""
    position: torch.Tensor | None = None
    """[b, s] long: position ids for learned or rotary embeddings; None = `index`."""
    document: torch.Tensor | None = None
    """[b, s] long: document number within the window; None = the window is one document."""
    keys: tuple[TokenPositions, ...] = ()
    """Under context parallelism, every cp rank's part of the window in rank order (who the
    keys of each ring step are), derived once per microbatch by the split; else empty."""
    plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """What attention plans from these facts, made once per microbatch by its first layer and
    read by the rest (context parallelism's blocks, by window). Only this object's: `replace`
    and `select` start empty, and equality and hashing ignore it."""

    @classmethod
    def contiguous(cls, seq_length: int, device: torch.device | str = "cpu") -> TokenPositions:
        """A whole window in order: what a run without these features implies."""
        return cls(torch.arange(seq_length, device=device))

    @property
    def length(self) -> int:
        return self.index.shape[0]

    def ids(self) -> torch.Tensor:
        """Position ids [b or 1, s] for the embeddings."""
        return self.index[None] if self.position is None else self.position

    def select(self, local: torch.Tensor) -> TokenPositions:
        """The facts of the tokens at local offsets `local` (a long tensor [s'])."""
        return TokenPositions(
            self.index[local],
            None if self.position is None else self.position[:, local],
            None if self.document is None else self.document[:, local],
        )

    def allowed(self, keys: TokenPositions, window: int = 0) -> torch.Tensor:
        """Bool [b or 1, 1, s_q, s_k]: True where query i may read key j (j at or before i in
        the window, within `window` tokens of it if > 0, and in the same document)."""
        qi, kj = self.index[:, None], keys.index[None, :]
        mask = kj <= qi
        if window:
            mask = mask & (qi - kj < window)
        mask = mask[None]
        if self.document is not None and keys.document is not None:
            mask = mask & (self.document[:, :, None] == keys.document[:, None, :])
        return mask[:, None]
