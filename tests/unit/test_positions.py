"""Token positions: the explicit path (a mask built from `TokenPositions`) must equal the
fused causal path for a plain window, and a select of the window must see exactly what
the window's own rows see. Context parallelism and document masking build on this."""

from __future__ import annotations

import pytest
import torch

from ptdp.config.enums import Recompute
from ptdp.config.files import apply_updates
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.model.gpt import GPT
from ptdp.model.positions import TokenPositions
from tests.helpers import LLAMA

SIZES = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 16, "vocab_size": 64}
FAMILIES = {"gpt": {}, "llama": LLAMA, "window": {**LLAMA, "sliding_window": 5}}


def model_cfg(family: str) -> ModelConfig:
    return apply_updates(RunConfig(), {"model": {**SIZES, **FAMILIES[family]}}, "test").model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recompute", [Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL])
def test_explicit_positions_equal_the_causal_path(family: str, recompute: Recompute) -> None:
    cfg = model_cfg(family)
    model = GPT(cfg, seed=3, recompute=recompute)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = tokens.roll(-1, 1)
    plain = model(tokens, labels)
    plain.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    explicit = model(tokens, labels, positions=TokenPositions.contiguous(16))
    explicit.backward()
    torch.testing.assert_close(explicit, plain, rtol=1e-6, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_allowed_masks_causal_window_and_documents() -> None:
    docs = torch.tensor([[0, 0, 0, 1, 1, 2]])
    pos = TokenPositions(torch.arange(6), document=docs)
    mask = pos.allowed(pos, window=2)[0, 0]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        for j in range(6):
            expected[i, j] = j <= i and i - j < 2 and docs[0, i] == docs[0, j]
    assert torch.equal(mask, expected)
    part = pos.select(torch.tensor([1, 4]))
    assert part.index.tolist() == [1, 4] and part.document.tolist() == [[0, 1]]
    assert torch.equal(part.allowed(pos)[0, 0], pos.allowed(pos)[0, 0][[1, 4]])


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_position_ids_move_learned_and_rotary_positions(family: str) -> None:
    """Ids 4..11 for an 8-token window give the rows that those tokens get at 4..11 of a
    longer window whose first four keys are masked off by a document boundary."""
    cfg = model_cfg(family)
    model = GPT(cfg, seed=3)
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    docs = torch.tensor([[0] * 4 + [1] * 8])
    whole = model(tokens, positions=TokenPositions(torch.arange(12), document=docs))
    shifted = TokenPositions(torch.arange(8), position=torch.arange(4, 12)[None])
    alone = model(tokens[:, 4:], positions=shifted)
    torch.testing.assert_close(alone, whole[:, 4:], rtol=1e-5, atol=1e-5)
