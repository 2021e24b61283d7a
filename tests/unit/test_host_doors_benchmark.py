"""benchmarks/memory/host_doors.py's pure helpers: each rank's parameter count per layout,
the VmHWM line, the rows and the markdown table (the measurement itself is the benchmark's)."""

from __future__ import annotations

import pytest

from tests.helpers import load_benchmark

doors = load_benchmark("memory/host_doors")
LLAMA = doors.Shape(hidden=256, layers=4, heads=4, kv_heads=2, ffn=512, vocab=8192)
MIXTRAL = doors.Shape(hidden=256, layers=4, heads=4, kv_heads=2, ffn=256, vocab=8192, experts=4)


def test_padded_vocab() -> None:
    assert doors.padded_vocab(32000, 2) == 32000
    assert doors.padded_vocab(50257, 1) == 50304
    assert doors.padded_vocab(50257, 2) == 50432


def test_shard_params_of_a_dense_model() -> None:
    # Per layer: norms 2*256, attention (2*256*256 + 2*256*128) / tp, MLP 3*256*512 / tp;
    # embedding and output 8192*256 / tp, final norm 256. (Counted by `ptdp train` too.)
    whole = 4 * (512 + 196608 + 393216) + 2 * 8192 * 256 + 256
    assert doors.shard_params(LLAMA, doors.Layout("1", 1), 0) == whole == 6555904
    tp2 = doors.Layout("tp2", 2, tp=2)
    assert [doors.shard_params(LLAMA, tp2, r) for r in (0, 1)] == [3279104, 3279104]
    pp2 = doors.Layout("pp2", 2, pp=2)  # embedding on stage 0, final norm + output on stage 1
    assert [doors.shard_params(LLAMA, pp2, r) for r in (0, 1)] == [3277824, 3278080]
    both = doors.Layout("tp2·pp2", 4, tp=2, pp=2)  # ranks 0, 1 hold stage 0
    assert [doors.shard_params(LLAMA, both, r) for r in range(4)] == [1639424] * 2 + [1639680] * 2


def test_shard_params_of_experts() -> None:
    # Per layer: router 256*4 whole, 4 / ep experts of 3*256*256 each.
    one = doors.shard_params(MIXTRAL, doors.Layout("1", 1), 0)
    assert one == 4 * (512 + 196608 + 1024 + 4 * 196608) + 2 * 8192 * 256 + 256
    ep2 = doors.shard_params(MIXTRAL, doors.Layout("ep2", 2, ep=2), 1)
    assert one - ep2 == 4 * 2 * 196608
    tp2 = doors.Layout("tp2", 2, tp=2)  # the experts stay whole on every tp rank (etp = 1)
    assert one - doors.shard_params(MIXTRAL, tp2, 0) == (4 * 196608 + 2 * 8192 * 256) // 2
    with pytest.raises(ValueError, match="does not divide"):
        doors.shard_params(MIXTRAL, doors.Layout("ep8", 8, ep=8), 0)


def test_parse_hwm() -> None:
    status = "Name:\tpython\nVmPeak:\t 2000 kB\nVmHWM:\t  123456 kB\nVmRSS:\t 100000 kB\n"
    assert doors.parse_hwm(status) == 123456 * 1024
    with pytest.raises(ValueError, match="no VmHWM"):
        doors.parse_hwm("VmRSS:\t 1 kB\n")


def test_rows_and_table() -> None:
    layout = doors.Layout("tp2", 2, tp=2)
    info = {"family": "llama", "bytes": 26_000_000, "largest": 8_000_000}
    base = {r: {"hwm_loaded": 300_000_000, "t_loop": 5.0} for r in (0, 1)}
    init = {r: {"hwm_loaded": 340_000_000, "t_loop": 6.5, "load_s": 1.5} for r in (0, 1)}
    rows = doors.init_rows(base, init, info, LLAMA, layout)
    shard = 4 * 3279104
    assert rows[1]["rank"] == 1 and rows[1]["shard"] == shard and rows[1]["extra"] == 40_000_000
    assert rows[1]["extra_per_shard_largest"] == round(40e6 / (shard + 8e6), 2) == 1.89
    assert rows[1]["extra_per_model"] == 1.54 and rows[1]["to_loop_s"] == 1.5
    text = doors.table(rows[:1], doors.INIT_COLUMNS)
    assert text.splitlines()[0].startswith("| model | layout | rank | shard MB |")
    assert text.splitlines()[1] == "|" + "|".join(["---"] * len(doors.INIT_COLUMNS)) + "|"
    assert text.splitlines()[2] == "| llama | tp2 | 0 | 13 | 300 | 340 | 40 | 1.89 | 1.54 | 1.5 |"
    assert doors.table([{"model": "x"}], [("m", "model", ""), ("r", "ratio", ".2f")]).endswith(
        "| x | – |"
    )
