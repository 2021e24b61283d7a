"""benchmarks/memory/memory_phases.py off CUDA: the model's count it reports, its rows as printed,
and its refusal without a CUDA device (what it measures needs one: scripts/gpu-check.sh)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ptdp.parallel.env import LaunchEnv
from ptdp.perf.cost.memory import estimate_memory
from ptdp.train.run import prepare
from tests.helpers import load_benchmark

torch = pytest.importorskip("torch")
GIB = 2**30


@pytest.fixture(scope="module")
def phases():
    return load_benchmark("memory/memory_phases")


def _config(phases, name: str, tmp_path: Path):
    args = argparse.Namespace(
        compile=False, precision="bf16", device="cpu", vocab_size=50257, grad_accum=1
    )
    data = phases.synthetic_tokens(tmp_path, args.vocab_size, 4 * 2049)
    shape = phases.SHAPES[name]
    recompute = "full" if name in phases.FILL else "none"
    cfg = phases.ptdp_config(args, shape, shape.micro_batch, data, recompute)
    return prepare(cfg, LaunchEnv(0, 1, 0))[0]


def test_the_count_is_the_memory_model_split_into_what_a_step_adds(phases, tmp_path) -> None:
    counts = {}
    for name in ("1.3b", "4b"):
        cfg = _config(phases, name, tmp_path / name)
        m = estimate_memory(cfg, 1)[0]
        c = counts[name] = phases.predicted(cfg)
        assert c["static"] == pytest.approx((m.params + m.grads + m.optimizer) / GIB)
        assert c["total"] == pytest.approx(c["static"] + c["activations"] + c["working"])
        assert c["total"] == pytest.approx(m.total / GIB)
        # bf16 weights, fp32 gradient buffers, fp32 masters and AdamW's two moments
        assert c["grads"] == pytest.approx(2 * c["params"])
        assert c["optimizer"] == pytest.approx(6 * c["params"])
    # 4B stores less for backward than 1.3B: full recomputation keeps each layer's input only
    assert counts["4b"]["static"] > 2.5 * counts["1.3b"]["static"]
    assert counts["4b"]["activations"] < counts["1.3b"]["activations"] / 4


def test_rows_print_each_phase_and_an_out_of_memory_one(phases) -> None:
    count = dict(static=22.0, params=2.5, grads=4.9, optimizer=14.6, activations=27.2)
    count |= dict(working=4.6, total=53.8)
    steady = {"model": "1.3b", "micro_batch": 8, "recompute": "none", "model_count": count}
    steady |= {
        "built": {"allocated": 7.4, "peak": 7.5, "reserved": 7.6},
        "step1": {"allocated": 22.1, "peak": 50.0, "reserved": 52.0},
        "steady": {"allocated": 22.1, "peak": 51.3, "reserved": 53.0, "before": 22.1},
        "used": 54.1,
        "device": 79.1,
    }
    text = phases.show(steady)
    assert "static 22.00" in text and "total 53.80" in text
    assert "step 4: allocated before 22.10, peak 51.30 (a step adds 29.20)" in text
    assert "device used 54.10 of 79.10" in text
    oom = {"model": "4b", "micro_batch": 4, "recompute": "full", "model_count": count}
    oom |= {"out_of_memory": "step 1", "message": "CUDA out of memory. Tried to allocate 2 GiB"}
    oom |= {"at_oom": {"allocated": 77.0, "peak": 78.5, "reserved": 78.9}}
    assert "OUT OF MEMORY in step 1: allocated 77.00, peak 78.50, reserved 78.90" in phases.show(
        oom
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the path without CUDA")
def test_without_cuda_it_says_it_needs_one(phases) -> None:
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        phases.main(["--models", "1.3b"])
