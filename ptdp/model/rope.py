"""Rotary position embedding (Su et al. 2021, arXiv 2104.09864) and its frequency scaling.

Shapes: b = batch, n = heads, s = positions, d = head size. Rotation pairs dim i with
dim i + d/2 (the rotate-half convention of Llama and `transformers`), pair i turning by
position * w_i with w_i = theta^(-2i/d).

Llama 3.1 (`model.rope_scaling = llama3`, Grattafiori et al. 2024, arXiv 2407.21783)
stretches the context by slowing down only the slow rotations: a pair whose wavelength
2 pi / w_i spans more than L = original / low_freq_factor positions turns `factor` times
slower, one shorter than H = original / high_freq_factor is kept, and between the two
the frequency is interpolated linearly in original / wavelength, so w is continuous.

YaRN (`model.rope_scaling = yarn`, Peng et al. 2023, arXiv 2309.00071; DeepSeek-V3,
Qwen3) blends by the pair index instead: pair i turns r_i = original * w_i / 2 pi times
over the original context; pairs below the index where r = beta_fast are kept, pairs past
the index where r = beta_slow are divided by `factor`, and a linear ramp in i joins the
two (the indices rounded outwards, as `transformers` does). The rotated queries and keys
are scaled by an attention factor (`yarn_attention_factor`), so the logits by its square.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ptdp.config.enums import RopeScaling
from ptdp.config.sections import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """w_i [d/2] in float64 for `cfg.rotary_dim`, `cfg.rope_theta` and `cfg.rope_scaling`."""
    freq = plain_frequencies(cfg.rotary_dim, cfg.rope_theta)
    if cfg.rope_scaling is RopeScaling.LLAMA3:
        freq = llama3_scaled(
            freq,
            factor=cfg.rope_scaling_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_positions=cfg.rope_original_max_positions,
        )
    if cfg.rope_scaling is RopeScaling.YARN:
        freq = yarn_scaled(
            freq,
            factor=cfg.rope_scaling_factor,
            beta_fast=cfg.rope_beta_fast,
            beta_slow=cfg.rope_beta_slow,
            original_positions=cfg.rope_original_max_positions,
            theta=cfg.rope_theta,
        )
    return freq


def yarn_mscale(factor: float, coefficient: float = 1.0) -> float:
    """YaRN's m(c) = 0.1 c ln(factor) + 1 (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * coefficient * math.log(factor) + 1.0


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """What the rotated queries and keys are multiplied by (1 without yarn):
    m(mscale) / m(mscale_all_dim) when both are set, else m(1)."""
    if cfg.rope_scaling is not RopeScaling.YARN:
        return 1.0
    factor = cfg.rope_scaling_factor
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(factor, cfg.rope_mscale) / yarn_mscale(factor, cfg.rope_mscale_all_dim)
    return yarn_mscale(factor)


def yarn_scaled(
    freq: torch.Tensor,
    *,
    factor: float,
    beta_fast: float,
    beta_slow: float,
    original_positions: int,
    theta: float,
) -> torch.Tensor:
    """YaRN's blended frequencies (module docstring) for freq = w_i [d/2]."""
    d = 2 * freq.numel()

    def index(rotations: float) -> float:  # the pair index i where r_i = rotations
        return d * math.log(original_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(index(beta_fast)), 0)
    high = min(math.ceil(index(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    return freq / factor * ramp + freq * (1.0 - ramp)


def plain_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """w_i = theta^(-2i/d), i < d/2, in float64."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def llama3_scaled(
    freq: torch.Tensor,
    *,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_positions: int,
) -> torch.Tensor:
    """Llama 3.1's scaled frequencies (module docstring): kept above 2 pi / H, divided by
    `factor` below 2 pi / L, linearly blended in between."""
    ratio = original_positions * freq / (2 * math.pi)  # original context / wavelength
    blend = ((ratio - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    return (1.0 - blend) * freq / factor + blend * freq


class Rotary(nn.Module):
    """Rotates queries and keys by their positions; cos/sin tables for `seq_length`."""

    def __init__(
        self,
        head_dim: int,
        seq_length: int,
        theta: float,
        inv_freq: torch.Tensor | None = None,
        attention_factor: float = 1.0,
    ) -> None:
        super().__init__()
        if inv_freq is None:
            inv_freq = plain_frequencies(head_dim, theta)
        angles = torch.outer(torch.arange(seq_length, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # [s, d]
        # Not persistent: derived from the config, so checkpoints need not carry it.
        # YaRN's attention factor scales both tables, as `transformers` does.
        cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
        self.register_buffer("cos", cos.float(), persistent=False)
        self.register_buffer("sin", sin.float(), persistent=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> Rotary:
        return cls(
            cfg.rotary_dim,
            cfg.seq_length,
            cfg.rope_theta,
            inverse_frequencies(cfg),
            yarn_attention_factor(cfg),
        )

    def forward(
        self, x: torch.Tensor, offset: int = 0, ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: [b, n, s, d] -> same, rotated by each position's angle: positions offset..
        offset+s-1, or the position ids `ids` [b or 1, s] (`TokenPositions.ids`)."""
        if ids is not None:
            cos, sin = self.cos[ids][:, None].to(x.dtype), self.sin[ids][:, None].to(x.dtype)
        else:
            s = x.shape[-2]
            cos = self.cos[offset : offset + s].to(x.dtype)
            sin = self.sin[offset : offset + s].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
