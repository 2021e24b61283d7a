"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, arXiv 1710.03740).

fp16 gradients underflow below about 6e-8; multiplying the loss by a large scale keeps
them representable. A step whose gradients contain inf or NaN is skipped and the scale
halved; after `window` good steps in a row the scale doubles again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DynamicLossScaler:
    scale: float = 2.0**16
    window: int = 1000
    min_scale: float = 1.0
    good_steps: int = 0
    """Steps since the last overflow or growth."""
    skipped: int = 0
    """Steps skipped for inf/NaN gradients over the run."""

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale / 2, self.min_scale)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.window:
            self.scale *= 2
            self.good_steps = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
