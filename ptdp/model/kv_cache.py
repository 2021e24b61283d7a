"""Keys and values of past positions, so that generation feeds one new token per step.

Shapes: b = batch, g = this rank's key/value groups, s = positions, d = head size. Each
layer's keys and values are kept as attention consumes them, [b, g, s, d], after the
rotary rotation and before the groups are repeated for their query heads: grouped-query
attention caches g, not n, heads, and under tensor parallelism each rank caches its own
groups. Latent attention (`ptdp.model.latent_attention`) stores its normalised latent
[b, 1, s, c] and rotary key [b, 1, s, r] in the two places instead: every head reads them,
so each tensor rank holds them whole. The buffers are allocated once, for the model's
whole context (`max_length`).
Under a sliding window (model.sliding_window) the cache still holds every position; the
attention reads only the window's (model/attention.py, `Attention._cached_core`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCache:
    """Per-layer key/value buffers [b, g, max_length, d] and the number of filled positions.

    `GPT.forward(tokens, cache=cache)` reads `length` as the position of its first new
    token, has each layer append its keys and values through `layer(name)`, and then
    `advance`s by the number of new tokens.
    """

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self.length = 0
        self._kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, name: str) -> LayerCache:
        return LayerCache(self, name)

    def update(
        self, name: str, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [b, g, s, d] at positions length..length+s-1; return all cached
        keys and values of layer `name`, [b, g, length+s, d] (views, not copies)."""
        start, end = self.length, self.length + k.shape[2]
        self.check_room(k.shape[2])
        if name not in self._kv:
            self._kv[name] = tuple(
                x.new_empty(x.shape[0], x.shape[1], self.max_length, x.shape[3]) for x in (k, v)
            )
        keys, values = self._kv[name]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def check_room(self, n: int) -> None:
        """Refuse n more positions past the cache's (and the model's) context."""
        if self.length + n > self.max_length:
            raise ValueError(
                f"KV cache holds {self.max_length} positions, {self.length + n} requested"
            )

    def advance(self, n: int) -> None:
        self.length += n

    def nbytes(self) -> int:
        return sum(t.nbytes for kv in self._kv.values() for t in kv)


@dataclass(frozen=True)
class LayerCache:
    """One layer's view of a KVCache: where its new positions start, and its buffers."""

    cache: KVCache
    name: str

    @property
    def offset(self) -> int:
        return self.cache.length

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(self.name, k, v)
