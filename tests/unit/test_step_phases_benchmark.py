"""benchmarks/perf_model/step_phases.py at a tiny size: each phase of a step measured and beside the
model's figure for it, the phases adding up to the step on both sides; one process and
two data-parallel ranks."""

from __future__ import annotations

import pytest

from tests.helpers import load_benchmark  # a module of the repo: spawned ranks unpickle its worker


def test_phases_measured_and_modelled_add_up(capsys) -> None:
    bench = load_benchmark("perf_model/step_phases")
    argv = "--tiny --calibration a100-80gb --only 1p-base 1p-s32 dp2-zero0 --steps 2 --warmup 1"
    rows = bench.main(argv.split())
    assert [name for name, _, _ in rows] == ["1p-base", "1p-s32", "dp2-zero0"]
    for name, got, want in rows:
        # Every hook fired: each layer's forward and backward inside the step, some of the
        # forward-backward outside the layers (embedding, head, loss, data).
        phases = ("layers_f", "layers_b", "rest", "optimizer")
        assert min(got[k] for k in phases) > 0, got
        assert got["layers_f"] + got["layers_b"] + got["reduce"] < got["step"]
        # The model's split: a layer's backward (B + W) costs more than its forward.
        assert 0 < want["layers_f"] < want["layers_b"] < want["step"]
        assert 0 < want["optimizer"] < want["step"]
        # Only two ranks wait for a reduction (one process's `finish` has nothing to wait on).
        if name.startswith("dp2"):
            assert got["reduce"] > 0 and want["reduce"] > 0, (got, want)
        else:
            assert got["reduce"] < 0.1 * got["step"] and want["reduce"] == 0, (got, want)
    out = capsys.readouterr().out
    assert out.count("| 1p-base |") == 2 and "| step ms (model) |" in out


def test_only_cases_whose_phases_follow_each_other() -> None:
    bench = load_benchmark("perf_model/step_phases")
    for name in ("tp2", "pp2-1f1b", "dp2-zero2"):
        with pytest.raises(SystemExit):
            bench.main(f"--tiny --calibration a100-80gb --only {name}".split())
