"""Weighted blends of datasets (data.paths): ratios, determinism across layouts and resume."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from ptdp.config.files import apply_updates, load_toml, parse_overrides
from ptdp.config.sections import RunConfig
from ptdp.data.blend import BlendedDataset, BlendSchedule, integer_shares, parse_blend
from ptdp.data.dataset import GPTDataset
from ptdp.data.preprocess import preprocess
from ptdp.errors import ConfigError
from ptdp.train.data_setup import open_data, resolve_vocab
from ptdp.train.run import train
from tests.helpers import tiny_config

SEQ = 16


def _corpus(root: Path, name: str, alphabet: str, docs: int = 30) -> str:
    """A byte-level dataset whose text uses only `alphabet`, so a sample shows its source."""
    rng = np.random.default_rng(len(name))
    src = root / f"{name}_text"
    src.mkdir(parents=True)
    for i in range(docs):
        words = [
            "".join(rng.choice(list(alphabet), size=int(rng.integers(2, 8))))
            for _ in range(int(rng.integers(20, 60)))
        ]
        (src / f"{i:03d}.txt").write_text(" ".join(words))
    prefix = root / name / name
    preprocess([src], prefix, "bytes", progress=False)
    return str(prefix)


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("blend")
    return _corpus(root, "lower", "abcdefghij"), _corpus(root, "upper", "ABCDEFGHIJ")


def _source(sample: np.ndarray) -> int:
    """0 for the lower-case corpus, 1 for the upper-case one (space and EOD are shared)."""
    letters = sample[(sample != ord(" ")) & (sample != 256)]
    lower = bool(np.all((letters >= ord("a")) & (letters <= ord("j"))))
    upper = bool(np.all((letters >= ord("A")) & (letters <= ord("J"))))
    assert lower != upper, sample
    return 0 if lower else 1


def _config(paths: list[str], tmp: Path, **train: object) -> RunConfig:
    cfg = tiny_config("", tmp / "run", train=train, model={"seq_length": SEQ})
    return apply_updates(cfg, {"data": {"paths": paths}}, "a test")


# ---------------------------------------------------------------- the spelling


def test_parse_blend_megatron_spelling_toml_and_command_line(tmp_path: Path) -> None:
    assert parse_blend(["0.7", "a", "0.3", "b"]) == [(0.7, "a"), (0.3, "b")]
    assert parse_blend(["3", "a", "1", "b"]) == [(0.75, "a"), (0.25, "b")]
    assert parse_blend(["only/prefix"]) == [(1.0, "only/prefix")]
    toml = tmp_path / "c.toml"
    toml.write_text('[data]\npaths = [0.7, "a/x", 0.3, "b/y"]\n')
    assert load_toml(toml).data.paths == ("0.7", "a/x", "0.3", "b/y")
    cli = apply_updates(RunConfig(), parse_overrides(["--data.paths", "0.7,a/x,0.3,b/y"]), "cli")
    assert cli.data.paths == ("0.7", "a/x", "0.3", "b/y")
    for bad, message in [
        (["0.7", "a", "0.3"], "has 3 entries; it alternates weights and prefixes"),
        (["a", "0.7", "b", "0.3"], "data.paths[0] = 'a' is not a weight"),
        (["0", "a", "1", "b"], "weight of 'a' must be a positive number"),
        (["1", "a", "2", "a"], "names 'a' more than once"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_blend(bad)


def test_path_and_paths_are_exclusive(two_corpora: tuple[str, str], tmp_path: Path) -> None:
    cfg = _config(["1", two_corpora[0], "1", two_corpora[1]], tmp_path)
    one = apply_updates(cfg, {"data": {"path": two_corpora[0]}}, "a test")
    assert one.data.paths == ()  # a later layer's data source replaces the other
    both = replace(cfg, data=replace(cfg.data, path=two_corpora[0]))  # built, not layered
    with pytest.raises(ConfigError, match="data.path = .* and data.paths are both set"):
        open_data(both)


# ---------------------------------------------------------------- the schedule


@pytest.mark.parametrize(
    "weights", [[0.7, 0.3], [0.2, 0.5, 0.3], [1, 2], [0.123, 0.877], [0.6, 0.3, 0.1, 1e-3]]
)
def test_blend_counts_stay_within_one_sample_of_the_weights(weights: list[float]) -> None:
    schedule = BlendSchedule(weights)
    w = np.asarray(weights) / sum(weights)
    k = 3 * schedule.period + 12345
    ids = np.array([schedule.locate(j)[0] for j in range(k)])
    counts = np.cumsum(np.eye(len(w), dtype=np.int64)[ids], axis=0)
    expected = np.arange(1, k + 1)[:, None] * w[None, :]
    # Exact shares for ratios of small integers; otherwise to 1/65536 of each weight.
    drift = 0 if schedule.period <= 1000 else np.arange(1, k + 1)[:, None] / 65536
    assert np.all(np.abs(counts - expected) <= 1 + drift)
    # Each dataset's samples are read in order, once each: locate and position invert.
    seen = [[n for j, n in (schedule.locate(x) for x in range(k)) if j == i] for i in range(len(w))]
    assert all(s == list(range(len(s))) for s in seen)
    assert all(schedule.position(*schedule.locate(x)) == x for x in range(0, k, 97))


def test_small_integer_ratios_give_short_exact_periods() -> None:
    assert integer_shares([0.7, 0.3]) == [7, 3]
    assert integer_shares([2, 4, 2]) == [1, 2, 1]
    assert sum(integer_shares([0.123456789, 0.876543211])) == 1 << 16
    with pytest.raises(ConfigError, match="below 1/65536 of the total"):
        integer_shares([1.0, 1e-7])


# ---------------------------------------------------------------- blended samples


def test_blended_samples_come_from_their_datasets_in_ratio(two_corpora: tuple[str, str]) -> None:
    parts = [GPTDataset(p, SEQ, "train", seed=3) for p in two_corpora]
    blend = BlendedDataset(parts, [0.7, 0.3])
    k = 2000  # several epochs of the smaller corpus
    sources = [_source(blend.sample(j)) for j in range(k)]
    assert abs(sum(s == 0 for s in sources) / k - 0.7) < 1e-3
    for j in range(0, k, 7):
        i, n = blend.source(j)
        assert sources[j] == i and np.array_equal(blend.sample(j), parts[i].sample(n))
    # Length: samples before either dataset starts its second epoch.
    i, n = blend.source(len(blend))
    assert n == len(parts[i])
    assert all(n < len(parts[i]) for i, n in map(blend.source, range(len(blend))))


def _rank_order(dataset, dp: int, micro: int, steps: int, gbs: int, start: int = 0) -> list:
    """Samples in the order the trainer reads them: at step s, dp rank r reads its share
    from s * gbs + r * gbs / dp, micro samples at a time (Trainer.forward_backward)."""
    rows = []
    per_rank = gbs // dp
    for step in range(start, steps):
        for rank in range(dp):
            first = step * gbs + rank * per_rank
            for mb in range(per_rank // micro):
                rows.append(dataset.batch(first + mb * micro, micro))
    return torch.cat(rows).tolist()


def test_blend_is_the_same_for_every_layout_and_after_resume(
    two_corpora: tuple[str, str], tmp_path: Path
) -> None:
    cfg = resolve_vocab(_config(["0.7", two_corpora[0], "0.3", two_corpora[1]], tmp_path))
    train_set = open_data(cfg).train
    assert isinstance(train_set, BlendedDataset)
    gbs, steps = 8, 12
    reference = _rank_order(train_set, 1, 8, steps, gbs)
    for dp, micro in [(1, 2), (2, 4), (2, 1), (4, 2), (8, 1)]:
        assert _rank_order(train_set, dp, micro, steps, gbs) == reference, (dp, micro)
    # A resumed run opens the data afresh and starts at the samples consumed.
    resumed = open_data(cfg).train
    assert _rank_order(resumed, 2, 2, steps, gbs, start=5) == reference[5 * gbs :]
    # The seed, not the layout, changes the order.
    other = open_data(apply_updates(cfg, {"train": {"seed": 99}}, "a test")).train
    assert _rank_order(other, 1, 8, steps, gbs) != reference


def test_blended_validation_split_uses_each_datasets_split(
    two_corpora: tuple[str, str], tmp_path: Path
) -> None:
    cfg = resolve_vocab(
        _config(["1", two_corpora[0], "3", two_corpora[1]], tmp_path, eval_interval=5)
    )
    valid = open_data(cfg).valid
    assert isinstance(valid, BlendedDataset) and valid.schedule.shares == [1, 3]
    for j, part in enumerate(valid.datasets):
        expected = GPTDataset(two_corpora[j], SEQ, "valid", valid_fraction=0.1)
        assert (part.split, part.start, part.stop) == ("valid", expected.start, expected.stop)
    sources = [_source(valid.sample(j)) for j in range(len(valid) // 4 * 4)]
    assert sources and all(sum(sources[j : j + 4]) == 3 for j in range(0, len(sources), 4))
    tight = apply_updates(cfg, {"data": {"valid_fraction": 0.001}}, "a test")
    with pytest.raises(ConfigError, match="validation split of .*lower"):
        open_data(tight)


def test_blend_refuses_datasets_with_different_tokenizers(
    two_corpora: tuple[str, str], tmp_path: Path
) -> None:
    src = tmp_path / "bpe_text"
    src.mkdir()
    (src / "a.txt").write_text("some text to train a small tokenizer on " * 50)
    bpe = str(tmp_path / "bpe" / "c")
    preprocess([src], bpe, "bpe", vocab_size=300, progress=False)
    cfg = _config(["1", two_corpora[0], "1", bpe], tmp_path)
    with pytest.raises(ConfigError) as info:
        resolve_vocab(cfg)
    message = str(info.value)
    assert "were not made with the same tokenizer" in message
    assert "lower.json: bytes, vocabulary 257" in message
    assert f"{tmp_path / 'bpe' / 'tokenizer.json'}, vocabulary" in message
    assert "re-run `ptdp preprocess`" in message


def test_blended_training_resumes_bitwise(two_corpora: tuple[str, str], tmp_path: Path) -> None:
    paths = ["0.7", two_corpora[0], "0.3", two_corpora[1]]
    common = {"optim": {"decay_steps": 4}, "data": {"paths": paths}}

    def cfg(run: str, steps: int) -> RunConfig:
        base = tiny_config("", tmp_path / run, train={"steps": steps}, model={"seq_length": SEQ})
        return apply_updates(base, common, "a test")

    full = train(cfg("full", 4))
    train(cfg("split", 2))
    resumed = train(cfg("split", 4), resume=True)
    assert resumed.start_step == 2
    assert [resumed.losses[s] for s in (3, 4)] == [full.losses[s] for s in (3, 4)]
