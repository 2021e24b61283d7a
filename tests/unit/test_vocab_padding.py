"""model.make_vocab_size_divisible_by pads the vocabulary rows for aligned matrix shapes;
it changes memory layout only: losses, gradients, logits and checkpoints are unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ptdp import checkpoint as ckpt
from ptdp.checkpoint import full_model_state
from ptdp.config.sections import ModelConfig
from ptdp.errors import ConfigError
from ptdp.model.gpt import GPT, count_parameters
from ptdp.parallel.comm import Group
from ptdp.train.run import train
from tests.helpers import tiny_config


def _gpt(vocab: int, divisible_by: int) -> GPT:
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        seq_length=16,
        vocab_size=vocab,
        make_vocab_size_divisible_by=divisible_by,
    )
    return GPT(cfg, seed=1)


@pytest.mark.parametrize(("vocab", "divisible_by", "rows"), [(70, 128, 128), (257, 64, 320)])
def test_rows_are_padded_with_zeros(vocab: int, divisible_by: int, rows: int) -> None:
    model = _gpt(vocab, divisible_by)
    assert model.embedding.weight.shape == (rows, 32)
    assert model.embedding.weight[vocab:].abs().max() == 0
    tp2 = -(-vocab // (2 * divisible_by)) * 2 * divisible_by  # a multiple of divisible_by * tp
    assert model.cfg.padded_vocab_size() == rows and model.cfg.padded_vocab_size(tp=2) == tp2
    assert count_parameters(model) == count_parameters(_gpt(vocab, 1))
    assert count_parameters(model, full=False) - count_parameters(model) == (rows - vocab) * 32


def test_loss_gradients_and_logits_equal_the_unpadded_model() -> None:
    padded, plain = _gpt(70, 128), _gpt(70, 1)
    assert plain.embedding.weight.shape == (70, 32)
    tokens = torch.randint(0, 70, (3, 17), generator=torch.Generator().manual_seed(0))
    losses = [m(tokens[:, :-1], tokens[:, 1:]) for m in (padded, plain)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    grad = padded.embedding.weight.grad
    assert grad[70:].abs().max() == 0  # padded columns take no probability, so no gradient
    torch.testing.assert_close(grad[:70], plain.embedding.weight.grad, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        logits = [m.eval()(tokens[:, 1:]) for m in (padded, plain)]
    assert logits[0].shape == (3, 16, 70)  # generation never sees the padded ids
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-6)
    state = full_model_state([padded], Group.single())
    assert state["embedding.weight"].shape == (70, 32)  # what a checkpoint stores


def test_training_and_resume_do_not_depend_on_padding(tiny_data: str, tmp_path: Path) -> None:
    def cfg(run: str, divisible_by: int, steps: int):
        model = {"make_vocab_size_divisible_by": divisible_by}
        return tiny_config(tiny_data, tmp_path / run, model=model, train={"steps": steps})

    plain = train(cfg("plain", 1, 6))
    padded = train(cfg("padded", 128, 3))  # the byte vocabulary: 257 -> 384 rows
    for step, loss in padded.losses.items():
        assert loss == pytest.approx(plain.losses[step], rel=1e-5)
    saved = ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path / "padded"))["model"]
    assert saved["embedding.weight"].shape == (257, 32)
    # The setting is a memory layout: the run resumes with another one.
    resumed = train(cfg("padded", 1, 6), resume=True)
    assert resumed.start_step == 3
    for step, loss in resumed.losses.items():
        assert loss == pytest.approx(plain.losses[step], rel=1e-5)


def test_a_non_positive_multiple_is_refused(tiny_data: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="make_vocab_size_divisible_by = 0 must be > 0"):
        train(tiny_config(tiny_data, tmp_path, model={"make_vocab_size_divisible_by": 0}))
