"""The peers benchmarks/speed/mfu.py trains beside ptdp, one module each, behind one interface.

A peer builds a model from a `PeerShape` (the same numbers as ptdp's row) that maps token
ids [b, s] to logits [b, s, v]; the shared loop in mfu.py trains it. A peer that cannot run
here (not installed, needs CUDA, has no such architecture or precision) raises
`PeerUnavailable` with the reason, which becomes the row's error text: a row never
disappears. Each peer's mapping from the shape to its own config is a pure function, tested
without the peer installed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

ARCHS = ("gpt", "llama")
"""gpt: learned positions, LayerNorm, GELU, biases, tied output layer (GPT-2).
llama: RoPE, RMSNorm, SwiGLU, no biases, untied output layer."""


class PeerUnavailable(Exception):
    """This peer cannot train this row here; the message says why (and the fix, if any)."""


@dataclass(frozen=True)
class PeerShape:
    """One row's model and precision, as every implementation gets it."""

    arch: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    """MLP width (SwiGLU: of each of the two input projections)."""
    seq: int
    vocab: int
    """Rows of the embedding and output layer (padded or not, as ptdp's row is)."""
    precision: str = "bf16"
    """bf16, fp16, fp32, or fp8-tensorwise / fp8-rowwise (fp8 GEMMs, bf16 elsewhere)."""
    rope_theta: float = 500000.0

    @property
    def fp8_recipe(self) -> str | None:
        return self.precision.removeprefix("fp8-") if self.precision.startswith("fp8") else None


Builder = Callable[[PeerShape, torch.device, bool], nn.Module]
"""(shape, device, compile) -> model mapping token ids to logits."""


def _gpt2(shape: PeerShape, device: torch.device, compile: bool) -> nn.Module:
    from .gpt2 import build_hf_gpt2

    return build_hf_gpt2(shape, device, compile)


def _plain(shape: PeerShape, device: torch.device, compile: bool) -> nn.Module:
    from .gpt2 import build_plain_gpt

    return build_plain_gpt(shape, device, compile)


def _titan(shape: PeerShape, device: torch.device, compile: bool) -> nn.Module:
    from .torchtitan import build

    return build(shape, device, compile)


def _megatron(shape: PeerShape, device: torch.device, compile: bool) -> nn.Module:
    from .megatron import build

    return build(shape, device, compile)


PEERS: dict[str, Builder] = {
    "hf-gpt2": _gpt2,
    "plain-gpt": _plain,
    "torchtitan": _titan,
    "megatron-core": _megatron,
}
DEFAULT_PEERS = {"gpt": "hf-gpt2,plain-gpt,megatron-core", "llama": "torchtitan,megatron-core"}


def build_peer(name: str, shape: PeerShape, device: torch.device, compile: bool) -> nn.Module:
    """The peer's model on `device`, or PeerUnavailable naming why not."""
    if shape.arch not in ARCHS:
        raise PeerUnavailable(f"unknown architecture {shape.arch!r}; known: {', '.join(ARCHS)}")
    return PEERS[name](shape, device, compile)


def refuse_fp8_off_cuda(name: str, shape: PeerShape, device: torch.device) -> None:
    """fp8 GEMMs need a GPU with fp8 tensor cores (compute capability 8.9 or later)."""
    if shape.fp8_recipe is None:
        return
    if device.type != "cuda":
        raise PeerUnavailable(f"{name} trains fp8 on CUDA only (fp8 GEMMs need sm_89 or later)")
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise PeerUnavailable(f"{name}: this GPU has no fp8 tensor cores (needs sm_89 or later)")
