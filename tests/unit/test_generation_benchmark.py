"""benchmarks/speed/generation.py on a tiny model: both modes run, agree, and the report is sane."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import load_benchmark


def test_tiny_run_matches_greedy_tokens_and_reports_speeds(tmp_path: Path, capsys) -> None:
    bench = load_benchmark("speed/generation")
    out = tmp_path / "generation.json"
    argv = "--device cpu --layers 2 --hidden 32 --heads 2 --vocab-size 64 --prompt-len 4"
    argv += f" --new-tokens 4 12 --rounds 2 --json {out}"
    rows = bench.main(argv.split())
    assert [r.new_tokens for r in rows] == [4, 12]
    for r in rows:
        assert r.same_tokens
        assert len(r.cache_tokens_per_s) == len(r.no_cache_tokens_per_s) == 2
        assert min(r.cache_tokens_per_s + r.no_cache_tokens_per_s) > 0
        assert r.speedup == pytest.approx(r.cache_median / r.no_cache_median)
    report = json.loads(out.read_text())
    assert [r["new_tokens"] for r in report["rows"]] == [4, 12]
    assert report["command"].endswith(argv)
    assert "| 12 |" in capsys.readouterr().out


def test_check_same_names_the_first_differing_token() -> None:
    bench = load_benchmark("speed/generation")
    cached = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    plain = cached.clone()
    bench.check_same(cached, plain, prompt_len=2)
    plain[1, 3] = 0
    with pytest.raises(AssertionError, match="sequence 1, new token 1 \\(8 against 0\\)"):
        bench.check_same(cached, plain, prompt_len=2)
