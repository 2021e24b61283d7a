"""Config: precedence, override syntax, unknown keys, validation messages, help, TOML."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from ptdp.config.enums import Activation, Schedule
from ptdp.config.files import (
    apply_updates,
    from_dict,
    help_text,
    load_toml,
    parse_overrides,
    resolve,
    to_dict,
    to_toml,
)
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.rules.layout import validate


def test_defaults_then_toml_then_command_line(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[model]\nnum_layers = 8\nhidden_size = 512\n[parallel]\nschedule = "gpipe"\n')
    cfg = resolve(str(toml), ["--model.num_layers", "12", "--optim.lr=1e-3"])
    assert cfg.model.num_layers == 12  # command line beats TOML
    assert cfg.model.hidden_size == 512  # TOML beats default
    assert cfg.model.num_heads == RunConfig().model.num_heads  # default kept
    assert cfg.optim.lr == 1e-3
    assert cfg.parallel.schedule is Schedule.GPIPE


def test_preset_then_toml_then_command_line(tmp_path: Path) -> None:
    # `ptdp simulate/plan --model NAME|FILE`: the preset (or file) is the base `resolve` starts
    # from instead of the defaults; the TOML file and the overrides apply on top.
    from ptdp.perf.validate.paper import model_config, preset, preset_config

    base = preset_config("gpt3-175b")
    assert base.model == preset("gpt3-175b") and base.train.precision.value == "bf16"
    toml = tmp_path / "c.toml"
    toml.write_text('[model]\nnum_layers = 8\n[train]\nprecision = "fp16"\n')
    cfg = resolve(str(toml), ["--model.num_layers", "12"], base=base)
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (12, 12288)  # override, preset
    assert cfg.train.precision.value == "fp16"  # the TOML beats the preset
    assert model_config(str(toml)).model.hidden_size == RunConfig().model.hidden_size
    with pytest.raises(ConfigError, match="unknown model 'gpt-2t'; use a preset .*gpt3-175b"):
        model_config("gpt-2t")
    with pytest.raises(ConfigError, match="nope.toml does not exist"):
        model_config(str(tmp_path / "nope.toml"))


def test_override_forms_and_coercion() -> None:
    updates = parse_overrides(
        ["--parallel.tp", "2", "--parallel.sequence_parallel=true", "--model.activation", "swiglu"]
    )
    assert updates == {
        "parallel": {"tp": "2", "sequence_parallel": "true"},
        "model": {"activation": "swiglu"},
    }
    cfg = apply_updates(RunConfig(), updates, "cli")
    assert cfg.parallel.tp == 2 and cfg.parallel.sequence_parallel is True
    assert cfg.model.activation is Activation.SWIGLU


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.num_layer", "2"], "did you mean 'num_layers'"),
        (["--modle.num_layers", "2"], "did you mean 'model'"),
        (["--parallel.schedule", "interleave"], "did you mean 'interleaved'"),
        (["--model.num_layers", "two"], "is not an integer"),
        (["--model.num_layers", "2.5"], "is not an integer"),
        (["--train.tensorboard", "maybe"], "not a boolean"),
        (["--optim.lr", "fast"], "not a number"),
        (["--model.num_layers"], "needs a value"),
        (["--parallel.pipeline_layers", "3,x"], r"pipeline_layers\[1\] = 'x' is not an integer"),
        (["model.num_layers=2"], "config overrides look like"),
    ],
)
def test_bad_command_line(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(None, args)


def test_bad_toml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nnum_layers = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(bad)
    bad.write_text("[train]\nstep = 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'train.step'.*did you mean 'steps'"):
        load_toml(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")


# Each row: overrides, world size, a fragment the message must contain.
INVALID = [
    ({"model": {"hidden_size": 250, "num_heads": 4}}, 1, "not divisible by model.num_heads = 4"),
    ({"model": {"num_heads": 8, "num_query_groups": 3}}, 1, "does not divide model.num_heads"),
    ({"model": {"num_layers": 0}}, 1, "model.num_layers = 0 must be > 0"),
    (
        {"model": {"hidden_size": 20, "num_heads": 4, "position_embedding": "rope"}},
        1,
        "even head size",
    ),
    ({"model": {"dropout": 1.0}}, 1, "model.dropout = 1.0 must be in [0, 1)"),
    (
        {"model": {"num_heads": 6, "hidden_size": 384}, "parallel": {"tp": 4}},
        4,
        "model.num_heads = 6 is not divisible by parallel.tp = 4",
    ),
    (
        {"model": {"num_heads": 8, "num_query_groups": 2}, "parallel": {"tp": 4}},
        4,
        "model.num_query_groups = 2 is not divisible by parallel.tp = 4",
    ),
    ({"model": {"ffn_hidden_size": 1001}, "parallel": {"tp": 2}}, 2, "MLP width 1001"),
    (
        {"model": {"seq_length": 255}, "parallel": {"tp": 2, "sequence_parallel": True}},
        2,
        "model.seq_length = 255 is not divisible by parallel.tp = 2",
    ),
    (
        {"parallel": {"pp": 4}, "model": {"num_layers": 6}},
        4,
        "model.num_layers = 6 is not divisible by pp*vpp = 4*1",
    ),
    (
        {
            "parallel": {"pp": 2, "vpp": 2, "schedule": "interleaved"},
            "train": {"global_batch_size": 24, "micro_batch_size": 8},
        },
        2,
        "with 3 microbatches per step",
    ),
    (
        {"parallel": {"pp": 4}, "model": {"num_layers": 6}},
        4,
        "or give each stage's layers, e.g. --parallel.pipeline_layers 1,2,2,1",
    ),
    (  # no split of 1 layer over 4 stages exists: none is suggested
        {"parallel": {"pp": 4}, "model": {"num_layers": 1}},
        4,
        "multiple of 4, or use fewer stages: at most pp*vpp = 3 for model.num_layers = 1",
    ),
    (
        {"parallel": {"pp": 2, "pipeline_layers": [1, 2, 1]}},
        2,
        "parallel.pipeline_layers = 1,2,1 has 3 entries but pp*vpp = 2*1 = 2 stages",
    ),
    (
        {"parallel": {"pp": 2, "pipeline_layers": [-1, 5]}},
        2,
        "parallel.pipeline_layers = -1,5 has an entry below 0",
    ),
    (
        {"parallel": {"pp": 4, "pipeline_layers": [1, 0, 3, 0]}},
        4,
        "parallel.pipeline_layers = 1,0,3,0 gives stage 1 no layer; only the first stage (the "
        "embedding alone) and the last one (the final norm, output layer and loss alone) may "
        "hold 0 layers; give each stage's layers, e.g. --parallel.pipeline_layers 1,1,1,1",
    ),
    (
        {"parallel": {"pp": 2, "pipeline_layers": [2, 3]}},
        2,
        "parallel.pipeline_layers = 2,3 sums to 5 but model.num_layers = 4",
    ),
    ({"parallel": {"dp": 2}}, 3, "does not match the world size 3"),
    ({"parallel": {"tp": 2}}, 3, "world size 3 is not divisible by tp*cp*pp"),
    ({"parallel": {"vpp": 2}}, 1, "needs a schedule with model chunks"),
    ({"parallel": {"pp": 2, "vpp": 3, "schedule": "zb-v"}}, 2, "set --parallel.vpp 2"),
    ({"parallel": {"schedule": "interleaved"}}, 1, "needs parallel.vpp >= 2"),
    ({"parallel": {"sequence_parallel": True}}, 1, "needs parallel.tp > 1"),
    (
        {"train": {"global_batch_size": 12, "micro_batch_size": 8}},
        1,
        "global_batch_size = 12 is not divisible by micro_batch_size*dp",
    ),
    ({"train": {"global_batch_size": 8, "micro_batch_size": 4}}, 4, "micro_batch_size*dp = 4*4"),
    ({"parallel": {"bucket_mb": 0}}, 1, "parallel.bucket_mb = 0"),
    ({"parallel": {"zero": 4}}, 1, "parallel.zero = 4 is not a ZeRO level"),
    (
        {"parallel": {"cp": 4}, "model": {"seq_length": 36}},
        4,
        "model.seq_length = 36 is not divisible by 2*parallel.cp = 8",
    ),
    (
        {"parallel": {"zero": 3}, "train": {"compile": True}},
        1,
        "parallel.zero = 3 gathers each layer's parameters in module hooks",
    ),
    ({"parallel": {"zero": 3}, "train": {"compile": True}}, 1, "set --train.compile false"),
    (
        {"parallel": {"zero": 0}, "optim": {"distributed": True}},
        1,
        "optim.distributed = true (the old spelling of parallel.zero = 1) disagrees with "
        "parallel.zero = 0",
    ),
    (
        {"parallel": {"zero": 2, "zero3_reshard_after_forward": False}},
        2,
        "parallel.zero3_reshard_after_forward = false keeps ZeRO-3's gathered parameters",
    ),
    ({"optim": {"loss_scale_window": 0}}, 1, "optim.loss_scale_window = 0"),
    ({"optim": {"lr": 1e-4, "min_lr": 1e-3}}, 1, "optim.min_lr = 0.001 must be in [0"),
    ({"optim": {"warmup_steps": 50, "decay_steps": 10}}, 1, "exceeds optim.decay_steps = 10"),
    ({"optim": {"grad_clip": -1.0}}, 1, "optim.grad_clip = -1.0 must be >= 0"),
    ({"train": {"device": "tpu"}}, 1, "use auto, cpu or cuda"),
    ({"data": {"valid_fraction": 0.0}}, 1, "leaves no validation data"),
    ({"train": {"eval_iters": 0}}, 1, "train.eval_iters = 0"),
]


@pytest.mark.parametrize(("updates", "world", "message"), INVALID)
def test_invalid_configs_are_rejected(updates: dict, world: int, message: str) -> None:
    cfg = apply_updates(RunConfig(), updates, "test")
    with pytest.raises(ConfigError) as info:
        validate(cfg, world)
    assert message in str(info.value)


def test_all_problems_reported_together() -> None:
    cfg = apply_updates(RunConfig(), {"model": {"num_layers": 0}, "parallel": {"tp": 3}}, "test")
    with pytest.raises(ConfigError) as info:
        validate(cfg, 3)
    text = str(info.value)
    assert "num_layers = 0" in text
    assert "num_heads = 4 is not divisible by parallel.tp = 3" in text


@pytest.mark.parametrize(
    ("parallel", "batch", "problem", "batch_fix"),
    [
        # vpp without the chunks its schedule runs: one error, and no batch to change
        ({"pp": 2, "vpp": 2}, 4, "needs a schedule with model chunks", None),
        ({"pp": 2, "schedule": "interleaved"}, 4, "needs parallel.vpp >= 2", None),
        ({"pp": 2, "schedule": "zb-v"}, 4, "set --parallel.vpp 2", None),
        # the chunks fit, the microbatches do not: the batch that fits is named
        ({"pp": 2, "vpp": 2, "schedule": "interleaved"}, 3, "use m = 2 or 4", 4),
    ],
)
def test_a_schedule_problem_is_reported_once_with_its_own_fix(
    parallel: dict, batch: int, problem: str, batch_fix: int | None
) -> None:
    updates = {"parallel": parallel, "train": {"global_batch_size": batch, "micro_batch_size": 1}}
    with pytest.raises(ConfigError) as info:
        validate(apply_updates(RunConfig(), updates, "t"), 2)
    problems = str(info.value).splitlines()[1:]
    assert len(problems) == 1 and problem in problems[0]
    if batch_fix is None:
        assert "global_batch_size" not in problems[0]
    else:
        assert problems[0].endswith(f"e.g. --train.global_batch_size {batch_fix}")


def test_valid_layouts_derive_dp_and_microbatches() -> None:
    cfg = apply_updates(
        RunConfig(), {"train": {"micro_batch_size": 2, "global_batch_size": 16}}, "t"
    )
    layout = validate(cfg, 4)
    assert (layout.dp, layout.num_microbatches) == (4, 2)
    assert validate(cfg, 1).num_microbatches == 8


@pytest.mark.parametrize(
    ("zero", "distributed", "level"),
    [
        *((-1, False, 0), (-1, True, 1), (0, False, 0), (1, False, 1), (2, False, 2)),
        *((2, True, 2), (3, False, 3), (3, True, 3)),
    ],
)
def test_zero_level_and_its_old_spelling(zero: int, distributed: bool, level: int) -> None:
    updates = {"parallel": {"zero": zero}, "optim": {"distributed": distributed}}
    updates |= {"train": {"micro_batch_size": 1}}
    layout = validate(apply_updates(RunConfig(), updates, "t"), 2)
    assert layout.zero == level
    assert (f" zero={level} " in layout.describe()) == (level > 0)
    assert (layout.shards_optimizer, layout.shards_grads) == (level >= 1, level >= 2)
    assert layout.shards_params == (level >= 3)


def test_explicit_pipeline_layers() -> None:
    # TOML array or a comma-separated command-line value, the same tuple either way.
    assert resolve(None, ["--parallel.pipeline_layers", "3,4,4,3"]).parallel.pipeline_layers == (
        3,
        4,
        4,
        3,
    )
    cfg = apply_updates(
        RunConfig(),
        {"model": {"num_layers": 7}, "parallel": {"pp": 2, "pipeline_layers": [3, 4]}},
        "t",
    )
    assert cfg.parallel.pipeline_layers == (3, 4)
    layout = validate(cfg, 2)  # 7 layers over 2 stages: no divisibility rule with a split
    assert layout.stage_layers == (3, 4) and "layers=3,4" in layout.describe()
    even = apply_updates(
        RunConfig(),
        {"model": {"num_layers": 8}, "parallel": {"pp": 4}, "train": {"micro_batch_size": 1}},
        "t",
    )
    assert validate(even, 4).stage_layers == (2, 2, 2, 2)
    interleaved = apply_updates(
        even,
        {"parallel": {"pp": 2, "vpp": 2, "schedule": "interleaved", "pipeline_layers": "1,3,3,1"}},
        "t",
    )
    assert validate(interleaved, 2).stage_layers == (1, 3, 3, 1)


def test_help_lists_every_field_with_its_doc() -> None:
    text = help_text()
    for section, values in to_dict(RunConfig()).items():
        for key in values:
            assert f"--{section}.{key} " in text
    assert "Model width h." in text
    assert "1f1b" in text and "interleaved" in text


def test_toml_round_trip(tmp_path: Path) -> None:
    cfg = resolve(
        None,
        [
            "--model.activation",
            "swiglu",
            "--data.path",
            'a "quoted" path',
            "--optim.lr",
            "1e-3",
            "--train.tensorboard",
            "true",
            "--parallel.pipeline_layers",
            "1,3",
        ],
    )
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    assert load_toml(path) == cfg
    assert from_dict(to_dict(cfg)) == cfg


def test_zb_v_alone_takes_its_two_chunks_per_rank(tmp_path: Path) -> None:
    # zb-v runs exactly vpp = 2: left unset (TOML or command line), it is taken.
    assert resolve(None, ["--parallel.schedule", "zb-v"]).parallel.vpp == 2
    toml = tmp_path / "c.toml"
    toml.write_text('[parallel]\nschedule = "zb-v"\npp = 2\n')
    assert resolve(str(toml), []).parallel.vpp == 2
    validate(resolve(str(toml), ["--train.global_batch_size", "32"]), 2)
    # an explicit other value stays, and is refused with its fix
    cfg = resolve(str(toml), ["--parallel.vpp", "3", "--model.num_layers", "6"])
    with pytest.raises(ConfigError, match="set --parallel.vpp 2, or leave parallel.vpp out"):
        validate(cfg, 2)
    # interleaved runs any vpp >= 2: the choice stays the user's
    assert resolve(None, ["--parallel.schedule", "interleaved"]).parallel.vpp == 1
    assert resolve(None, ["--parallel.schedule", "1f1b"]).parallel.vpp == 1


def test_zb_v_alone_in_every_command(tmp_path: Path, capsys) -> None:
    from ptdp.cli import main

    zb_v = ["--parallel.schedule", "zb-v", "--parallel.pp", "2", "--model.vocab_size", "128"]
    assert main(["schedule", "--schedule", "zb-v", "--pp", "2", "--microbatches", "4"]) == 0
    assert "zb-v: pp=2 vpp=2" in capsys.readouterr().out
    assert main(["train", "--dry-run", "--world-size", "2", *zb_v]) == 2  # no data given
    assert "vpp" not in capsys.readouterr().err
    out = str(tmp_path / "sim")
    assert main(["simulate", "--json", "--out", out, "--gpus", "2", *zb_v]) == 0
    assert '"vpp": 2' in capsys.readouterr().out
    plan = ["plan", "--gpus", "2", "--json", "--global-batch", "8", "--compare", *zb_v]
    assert main(plan) == 0
    assert "parallel.vpp" not in capsys.readouterr().out


def test_a_command_line_data_source_replaces_the_files_other(tmp_path: Path) -> None:
    # data.path and data.paths are one setting in two spellings: the later layer's wins.
    toml = tmp_path / "c.toml"
    toml.write_text('[data]\npath = "data/one"\n')
    blend = ["--data.paths", "0.7,data/a,0.3,data/b"]
    cfg = resolve(str(toml), blend)
    assert (cfg.data.path, cfg.data.paths) == ("", ("0.7", "data/a", "0.3", "data/b"))
    toml.write_text('[data]\npaths = ["1", "data/a", "1", "data/b"]\n')
    cfg = resolve(str(toml), ["--data.path", "data/one"])
    assert (cfg.data.path, cfg.data.paths) == ("data/one", ())
    assert resolve(str(toml), []).data.paths == ("1", "data/a", "1", "data/b")
    # both in one layer: neither can win
    with pytest.raises(ConfigError, match=r"both set in one place \(the command line\)"):
        resolve(None, [*blend, "--data.path", "data/one"])
    toml.write_text('[data]\npath = "data/one"\npaths = ["1", "data/a"]\n')
    with pytest.raises(ConfigError, match=f"both set in one place \\({toml}\\); give data.path"):
        resolve(str(toml), [])


@pytest.mark.parametrize("num_layers", range(1, 10))
def test_a_suggested_split_always_validates(num_layers: int) -> None:
    """Every `--parallel.pipeline_layers` a message suggests is one that validates; where no
    split exists (a middle stage would have no layer), none is suggested."""
    for pp, given in itertools.product((2, 3, 4, 8), ((), (1,), (0, 9, 0))):
        updates = {
            "model": {"num_layers": num_layers},
            "parallel": {"pp": pp, "pipeline_layers": list(given)},
            "train": {"micro_batch_size": 1},
        }
        try:
            validate(apply_updates(RunConfig(), updates, "t"), pp)
            continue
        except ConfigError as exc:
            message = str(exc)
        suggested = re.findall(r"--parallel\.pipeline_layers (\d+(?:,\d+)*)", message)
        assert suggested or "use fewer stages" in message, message
        for split in suggested:
            updates["parallel"]["pipeline_layers"] = split
            layout = validate(apply_updates(RunConfig(), updates, "t"), pp)
            assert sum(layout.stage_layers) == num_layers and len(layout.stage_layers) == pp
        if "use fewer stages" in message:
            assert num_layers + 2 < pp  # a split of one layer a stage, the ends none
