"""benchmarks/step_phases.py at a tiny size: each phase of a one-process step measured and
beside the model's figure for it, the phases adding up to the step on both sides."""

from __future__ import annotations

import pytest

from tests.helpers import load_benchmark


def test_phases_measured_and_modelled_add_up(capsys) -> None:
    bench = load_benchmark("step_phases")
    argv = "--tiny --calibration a100-80gb --only 1p-base 1p-s32 --steps 2 --warmup 1".split()
    rows = bench.main(argv)
    assert [name for name, _, _ in rows] == ["1p-base", "1p-s32"]
    for _, got, want in rows:
        # Every hook fired: each layer's forward and backward inside the step, some of the
        # forward-backward outside the layers (embedding, head, loss, data).
        assert min(got.values()) > 0, got
        assert got["layers_f"] + got["layers_b"] < got["step"]
        # The model's split: a layer's backward (B + W) costs more than its forward.
        assert 0 < want["layers_f"] < want["layers_b"] < want["step"]
        assert 0 < want["optimizer"] < want["step"]
    out = capsys.readouterr().out
    assert out.count("| 1p-base |") == 2 and "| step ms (model) |" in out


def test_only_one_process_cases() -> None:
    bench = load_benchmark("step_phases")
    with pytest.raises(SystemExit):
        bench.main("--tiny --calibration a100-80gb --only tp2".split())
