"""The planner, and the model against the paper's Table 1 (arXiv 2104.04473)."""

from __future__ import annotations

import pytest

from ptdp.config.enums import Recompute
from ptdp.config.files import apply_updates, parse_overrides, resolve
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.perf.cost.costs import Compute
from ptdp.perf.cost.flops import paper_equation_3
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.reserve import fit
from ptdp.perf.cost.software import MEGATRON_2021
from ptdp.perf.plan.keys import pinned
from ptdp.perf.plan.planner import plan
from ptdp.perf.plan.search import equation_1, layout_config
from ptdp.perf.simulate.simulator import simulate
from ptdp.perf.validate.paper import README_GPT3, TABLE_1, paper_run, preset_config
from ptdp.perf.validate.validation import check_row, check_script_row, readme_gpt3
from ptdp.pipeline.schedules import SCHEDULES
from ptdp.rules.layout import validate

A100 = load_system("a100-80gb")


@pytest.mark.parametrize("row", TABLE_1, ids=lambda r: r.name)
def test_table_1_within_10_percent(row) -> None:
    check = check_row(row, A100)
    lay = check.option.prediction.layout
    assert (lay.tp, lay.pp, lay.dp) == (row.tp, row.pp, row.gpus // (row.tp * row.pp))
    assert check.option.config.train.global_batch_size == row.batch
    assert abs(check.error) <= 0.10, f"{row.name}: {check.predicted:.1f} vs {row.tflops}"
    need, usable = fit(check.option.prediction.memory, A100.device)
    assert need <= usable


@pytest.mark.parametrize("row", TABLE_1, ids=lambda r: r.name)
def test_table_1_at_micro_batch_1_within_8_percent(row) -> None:
    """At b = 1 each microbatch's fixed costs weigh most. The 1.7B-18B rows were 8-13% low
    here until a GPU's kernel launches hid behind longer kernels (`Compute.launched`) and
    the rows the authors ran with torch DDP overlapped their reduction (`torch_ddp`)."""
    check = check_row(row, A100, micro_batch=1)
    assert check.option.config.train.micro_batch_size == 1
    assert abs(check.error) <= 0.08, f"{row.name}: {check.predicted:.1f} vs {row.tflops}"


@pytest.mark.parametrize("row", TABLE_1, ids=lambda r: r.name)
def test_table_1_as_the_authors_script_ran_it(row) -> None:
    """b, v and DDP of Megatron-LM's examples/sc21/run_table_1.sh: every row within 6%."""
    dp = row.gpus // (row.tp * row.pp)
    assert (row.layers // row.pp) % row.script_vpp == 0
    assert row.batch % (row.script_micro_batch * dp) == 0
    p = check_script_row(row, A100)
    assert (p.layout.tp, p.layout.pp, p.layout.vpp) == (row.tp, row.pp, row.script_vpp)
    assert row.torch_ddp == (row.pp == 1)  # the script's DDP: torch without pipelining
    assert abs(p.tflops_per_device / row.tflops - 1) <= 0.06, f"{row.name}: {p.tflops_per_device}"


def test_torch_ddp_overlaps_the_reduction_only_without_pipelining() -> None:
    """megatron-2021 overlaps the data-parallel reduction at p = 1 (torch DDP) and never
    with a pipeline, whatever the config says; the 7.5B row at b 16: m = 1, so the whole
    reduction can hide behind its one backward."""
    row = TABLE_1[2]
    on = paper_run(row, micro_batch=16, vpp=1)
    off = apply_updates(on, {"parallel": {"overlap_grad_reduce": False}}, "test")
    t_on, t_off = (
        simulate(c, A100, row.gpus, software=MEGATRON_2021).iteration_seconds for c in (on, off)
    )
    assert t_on < t_off
    piped = apply_updates(paper_run(TABLE_1[4], micro_batch=1, vpp=1), {}, "test")
    assert piped.parallel.overlap_grad_reduce is False
    forced = apply_updates(piped, {"parallel": {"overlap_grad_reduce": True}}, "test")
    t_piped, t_forced = (
        simulate(c, A100, TABLE_1[4].gpus, software=MEGATRON_2021).iteration_seconds
        for c in (piped, forced)
    )
    assert t_piped == t_forced


def test_readme_gpt3_example() -> None:
    # 1024 A100s, batch 1536, t = 8, p = 16, b = 1: about 32 s and 138 TFLOP/s per GPU.
    p = readme_gpt3(A100)
    flops = paper_equation_3(1536, 2048, 96, 12288, 51200)
    assert p.tflops_per_device == pytest.approx(flops / p.iteration_seconds / 1024 / 1e12)
    assert p.tflops_per_device == pytest.approx(138, rel=0.10)
    assert p.iteration_seconds == pytest.approx(32, rel=0.10)
    assert p.bubble_fraction == pytest.approx(15 / 192, rel=0.1)  # (p-1)/m, m = 192


def test_micro_batch_from_equation_1() -> None:
    row = TABLE_1[6]  # 145.6B: t = 8, p = 8, d = 24, b' = 96
    result = check_row(row, A100)
    plan_b = result.option.config.train.micro_batch_size
    c = Compute(A100, result.option.config.train.precision, MEGATRON_2021)
    base = paper_run(row, micro_batch=1, vpp=1)
    estimate = {
        b: equation_1(
            layout_config(
                base,
                tp=8,
                pp=8,
                vpp=1,
                micro_batch=b,
                recompute=Recompute.FULL,
                sequence_parallel=False,
            ),
            row.gpus,
            c,
        )
        for b in (1, 2, 4)
    }
    assert plan_b == min(estimate, key=estimate.get)
    # A larger b runs more efficiently but the bubble (p - 1)/m grows: b = 1 wins here.
    assert plan_b == 1


@pytest.mark.parametrize("row", [TABLE_1[5], TABLE_1[6]], ids=lambda r: r.name)
def test_planner_puts_tensor_parallelism_inside_a_node(row) -> None:
    base = paper_run(row, micro_batch=1, vpp=1)
    result = plan(
        base,
        gpus=row.gpus,
        system=A100,
        software=MEGATRON_2021,
        recompute=Recompute.FULL,
        sequence_parallel=False,
    )
    lay = result.best.prediction.layout
    assert lay.tp == 8 and lay.pp * lay.tp * lay.dp == row.gpus
    need, usable = fit(result.best.prediction.memory, A100.device)
    assert need <= usable
    # Fewer pipeline stages with t = 8 would not fit: p is the smallest that does.
    assert any("t=8 p=" in r.layout and "GiB" in r.reason for r in result.rejected)
    fastest = result.options[0].prediction.iteration_seconds
    assert result.best.prediction.iteration_seconds <= fastest * 1.06
    assert any("tensor parallel t=8" in line for line in result.explanation)


def tiny(**train) -> RunConfig:
    return apply_updates(
        RunConfig(),
        {
            "model": {
                "num_layers": 4,
                "hidden_size": 64,
                "num_heads": 4,
                "seq_length": 64,
                "vocab_size": 128,
            },
            "train": {"global_batch_size": 16, **train},
        },
        "test",
    )


def test_a_small_model_plan_is_accepted_by_the_runtime() -> None:
    seen = []
    result = plan(tiny(), gpus=4, system=A100, progress=lambda i, n, what: seen.append((i, n)))
    best = result.best
    validate(best.config, 4)  # raises if the runtime would reject it
    assert (
        seen[-1][0]
        == seen[-1][1]
        == len(result.options)
        + sum("GiB" in r.reason and "v=" not in r.layout for r in result.rejected)
        or seen
    )
    times = [o.prediction.iteration_seconds for o in result.options]
    assert times == sorted(times)
    assert all(o.config.train.global_batch_size == 16 for o in result.options)


def test_fixed_choices_are_respected() -> None:
    result = plan(tiny(), gpus=4, system=A100, tp=2, pp=2, micro_batch=2, recompute=Recompute.FULL)
    for o in result.options:
        p = o.config.parallel
        assert (p.tp, p.pp, p.recompute, o.config.train.micro_batch_size) == (
            2,
            2,
            Recompute.FULL,
            2,
        )


def test_nothing_fits() -> None:
    row = TABLE_1[-1]  # 1T parameters on 64 GPUs
    result = plan(paper_run(row, micro_batch=1, vpp=1), gpus=64, system=A100, tp=8)
    assert result.best is None and result.rejected
    assert all("GiB" in r.reason or "divis" in r.reason for r in result.rejected)


def test_readme_planner_choice_reported() -> None:
    # The planner, free to choose b and v for the README's t, p: better than the script's.
    script = readme_gpt3(A100)
    planned = check_row(README_GPT3, A100).option.prediction
    assert planned.iteration_seconds <= script.iteration_seconds


def test_only_the_keys_given_are_pinned() -> None:
    # `ptdp plan --parallel.tp 2 ...`: the searched keys on the command line fix the search,
    # at their resolved (typed) values; 0 leaves a size to the search; the rest stay searched.
    args = "--parallel.tp 2 --parallel.vpp 0 --train.micro_batch_size 4 --parallel.schedule "
    args += "zb-h1 --parallel.recompute full --parallel.sequence_parallel off --optim.lr 1e-4"
    cfg = resolve(None, args.split(), base=paper_run(TABLE_1[0], micro_batch=1, vpp=1))
    assert pinned(cfg, parse_overrides(args.split())) == {
        "tp": 2,
        "vpp": None,
        "micro_batch": 4,
        "schedules": ("zb-h1",),
        "recompute": Recompute.FULL,
        "sequence_parallel": False,
    }
    assert pinned(cfg, {}) == {}  # a TOML's or preset's layout is searched over
    with pytest.raises(ConfigError, match="derives d = gpus / .* fix --parallel.tp"):
        pinned(resolve(None, ["--parallel.dp", "4"]), {"parallel": {"dp": "4"}})


def test_zero_bubble_chosen_where_fastest_never_for_megatron_2021() -> None:
    # p = 4 with m = 4 microbatches: the bubble dominates, and ZB's (p-1)/(3m) beats 1F1B's.
    result = plan(tiny(), gpus=4, system=A100, tp=1, pp=4, micro_batch=4)
    names = [o.config.parallel.schedule.value for o in result.options]
    assert {"1f1b", "zb-h1", "zb-h2"} <= set(names)
    best = result.best.config.parallel.schedule.value
    assert best in ("zb-h1", "zb-h2") and result.recommended == 0
    formula = SCHEDULES[best].formula  # (p-1)/(3m) or max(p-1,2p-1-m)/(3m)
    assert any(
        f"schedule {best} v=1" in line and f"formula {formula}" in line
        for line in result.explanation
    )
    old = plan(tiny(), gpus=4, system=A100, software=MEGATRON_2021, tp=1, pp=4, micro_batch=4)
    assert {o.config.parallel.schedule.value for o in old.options} == {"1f1b"}
    assert any("formula (p-1)/m = 0.750" in line for line in old.explanation)


def test_a_given_layer_split_is_kept_only_where_it_fits() -> None:
    base = apply_updates(tiny(), {"parallel": {"pp": 2, "pipeline_layers": [1, 3]}}, "t")
    result = plan(base, gpus=4, system=A100)
    layouts = {(o.config.parallel.pp, o.config.parallel.vpp) for o in result.options}
    assert (2, 1) in layouts and any(pp != 2 for pp, _ in layouts)
    for o in result.options:
        p = o.config.parallel
        assert p.pipeline_layers == ((1, 3) if (p.pp, p.vpp) == (2, 1) else ())


def _model_parallel_clause(result) -> str:
    line = next(x for x in result.explanation if "model-parallel size t*p =" in x)
    return line[line.index("t*p =") : line.index("; peak")]


def test_the_reason_for_t_times_p_names_what_else_fits() -> None:
    # GPT-3 175B at t = 8 on 384 GPUs: p = 2 fits (with ZeRO-2) but is predicted more than
    # the model's 6% slower, so the pick is p = 3, the smallest within 6% of the fastest;
    # "smallest that fits" alone would contradict the pick.
    result = plan(paper_run(README_GPT3, micro_batch=1, vpp=1), gpus=384, system=A100, tp=8)
    layouts = [o.prediction.layout for o in result.options] + [u.layout for u in result.unranked]
    smallest = min(x.tp * x.pp for x in layouts if x.zero != 3)
    best = result.best.prediction.layout
    assert (smallest, best.tp * best.pp) == (16, 24)
    assert _model_parallel_clause(result) == (
        "t*p = 24 (smallest that fits: 16; the smallest within the model's 6% of the fastest step)"
    )
    fastest = result.options[0].prediction.iteration_seconds
    close = [
        o.prediction.layout
        for o in result.options
        if o.prediction.iteration_seconds <= fastest * 1.06
    ]
    assert min(x.tp * x.pp for x in close) == 24
    # 18.4B on 256 GPUs: ZeRO-3 fits at t*p = 1, ranked last by `recommend`; t*p = 2 is
    # the smallest without it and is the pick (with the reduction after the backward, which
    # holds every gradient whole; overlapped, t*p = 1 fits with ZeRO-2).
    row = TABLE_1[3]
    after = {"parallel": {"overlap_grad_reduce": False}}
    base = apply_updates(paper_run(row, micro_batch=1, vpp=1), after, "test")
    result = plan(base, gpus=row.gpus, system=A100)
    assert _model_parallel_clause(result) == "t*p = 2 (smallest that fits: 2, 1 with ZeRO-3)"


def test_fp8_all_gather_is_kept_only_at_zero_3() -> None:
    """parallel.zero3_fp8_all_gather in the base config: candidates at other ZeRO levels
    drop it (validation refuses it there), so they are still searched."""
    train = {"global_batch_size": 64, "precision": "fp8"}
    parallel = {"zero": 3, "zero3_fp8_all_gather": True}
    base = apply_updates(preset_config("gpt-1.7b"), {"train": train, "parallel": parallel}, "t")
    h100 = load_system("h100-sxm")
    free = plan(base, gpus=8, system=h100, tp=1, pp=1, schedules=("1f1b",))
    pinned3 = plan(base, gpus=8, system=h100, tp=1, pp=1, zero=3, schedules=("1f1b",))
    options = free.options
    keys = {(o.prediction.layout.zero, o.config.parallel.zero3_fp8_all_gather) for o in options}
    assert keys and all(on == (zero == 3) for zero, on in keys) and min(z for z, _ in keys) < 3
    assert {o.config.parallel.zero3_fp8_all_gather for o in pinned3.options} == {True}
