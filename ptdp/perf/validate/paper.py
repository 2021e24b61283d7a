"""Model presets and published figures from the paper, for planning and validation; the
`--model NAME|FILE` resolver of `ptdp train`, `simulate` and `plan`.

Narayanan et al., SC21 (arXiv 2104.04473): Table 1 (weak scaling on DGX A100 80GB nodes,
interleaved schedule with scatter/gather, full activation recomputation, mixed precision,
vocabulary 51,200, sequence 2048), the Megatron-LM README's GPT-3 175B example (1024
GPUs, batch 1536, about 32 s per iteration, about 138 TFLOP/s per GPU), and the models of
Korthikanti et al. 2022 (arXiv 2205.05198, Table 3), and the paper's Table 2 (section 5.2:
PTD-P against ZeRO-3 without model parallelism on the same A100 cluster). Copied here,
with their source, so that the package does not depend on any file outside it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ptdp.config.files import apply_updates, load_toml, resolve
from ptdp.config.presets import MODEL_PRESETS, model_preset
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.errors import ConfigError

VOCAB = 51200
SEQ = 2048


@dataclass(frozen=True)
class Table1Row:
    """One row of the paper's Table 1 (weak scaling)."""

    name: str
    params_billion: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float
    """Published achieved TFLOP/s per GPU (equation (3) FLOPs, recomputation included)."""
    script_micro_batch: int = 1
    """b in the authors' script for the row (`AUTHORS_SCRIPT`); the paper's table has none."""
    script_vpp: int = 1
    """Chunks per rank v in that script (its --num-layers-per-virtual-pipeline-stage)."""
    torch_ddp: bool = False
    """The script's --DDP-impl torch: PyTorch's DistributedDataParallel, whose bucketed
    all-reduce overlaps the last microbatch's backward (no_sync before it). `local`, the
    rows with p > 1, reduced every gradient after the backward."""


TABLE_1: tuple[Table1Row, ...] = (
    Table1Row("gpt-1.7b", 1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1, True),
    Table1Row("gpt-3.6b", 3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1, True),
    Table1Row("gpt-7.5b", 7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1, True),
    Table1Row("gpt-18.4b", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1, True),
    Table1Row("gpt-39.1b", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1),
    Table1Row("gpt-76.1b", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
    Table1Row("gpt-145.6b", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2),
    Table1Row("gpt-310.1b", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
    Table1Row("gpt-529.6b", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),
    Table1Row("gpt-1t", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1),
)
AUTHORS_SCRIPT = (
    "Megatron-LM examples/sc21/run_table_1.sh (commit de7dc40, 2021-08-10, 'scripts for sc21'; "
    "now examples/academic_paper_scripts/sc21/)"
)
"""Where each row's b, v and DDP come from: the authors' script that ran Table 1 (fp16,
--checkpoint-activations, --DDP-impl torch for the rows with p = 1, local for the rest).
The v there is layers per stage over --num-layers-per-virtual-pipeline-stage."""

README_GPT3 = Table1Row("gpt3-175b", 174.6, 96, 12288, 96, 8, 16, 1024, 1536, 138)
"""The README's example: about 32 s per iteration (equation (3) / (1024 x 138e12))."""

# name -> (layers, hidden, heads). GPT-3 175B (Brown et al. 2020, as in the paper's
# section 5.1), MT-NLG 530B = the 529.6B row, Korthikanti et al.'s 22B.
PRESETS: dict[str, tuple[int, int, int]] = {
    **{row.name: (row.layers, row.hidden, row.heads) for row in TABLE_1},
    "gpt3-175b": (96, 12288, 96),
    "mt-nlg-530b": (105, 20480, 128),
    "gpt-22b": (48, 6144, 64),
}


def preset(name: str) -> ModelConfig:
    """A paper model as a ModelConfig: GPT-2 style (learned positions, LayerNorm, GeLU, tied
    embeddings, biases), vocabulary 51,200, sequence 2048, dropout 0.1 as in Megatron-LM."""
    if name not in PRESETS:
        raise KeyError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    layers, hidden, heads = PRESETS[name]
    model = {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_heads": heads,
        "seq_length": SEQ,
        "vocab_size": VOCAB,
        "dropout": 0.1,
    }
    return apply_updates(RunConfig(), {"model": model}, f"preset {name}").model


ALL_PRESETS: tuple[str, ...] = (*PRESETS, *MODEL_PRESETS)
"""Every `--model NAME`: the paper's GPTs, then the published models of `ptdp.config.presets`."""

MODEL_HELP = f"a preset ({', '.join(ALL_PRESETS)}; in bf16) or a TOML config to start from"
"""The help of `--model` (train, simulate, plan)."""


def preset_config(name: str) -> RunConfig:
    """A paper model (`preset`) or a published one (`ptdp.config.presets`) in mixed precision (bf16,
    as the paper and those models trained), as a whole config."""
    if name not in ALL_PRESETS:
        raise ConfigError(f"unknown model {name!r}; presets: {', '.join(ALL_PRESETS)}")
    model = preset(name) if name in PRESETS else model_preset(name)
    cfg = replace(RunConfig(), model=model)
    return apply_updates(cfg, {"train": {"precision": "bf16"}}, f"preset {name}")


def model_config(model: str) -> RunConfig:
    """`--model NAME|FILE` of `ptdp train`, `simulate` and `plan`: a preset (`preset_config`)
    or a TOML config file; the base that `ptdp.config.files.resolve` applies `--config` and
    overrides to."""
    if model in ALL_PRESETS:
        return preset_config(model)
    if Path(model).suffix == ".toml" or Path(model).exists():
        return load_toml(model)
    raise ConfigError(
        f"unknown model {model!r}; use a preset ({', '.join(ALL_PRESETS)}) or a TOML config file"
    )


def perf_config(model: str, config: str | None, overrides: list[str]) -> RunConfig:
    """`ptdp train|simulate|plan`: --model (`model_config`) < --config FILE < --section.key
    overrides."""
    return resolve(config, overrides, base=model_config(model) if model else None)


def paper_run(row: Table1Row, *, micro_batch: int, vpp: int) -> RunConfig:
    """The paper's settings for a Table 1 row as a ptdp config, with b and v still to choose.

    Mixed precision (bf16 here: the same peak and element size as the paper's fp16), full
    recomputation, no sequence parallelism (it came later), scatter/gather on, no
    distributed optimizer (as in Megatron-LM at the time), the data-parallel reduction
    overlapping the backward where the authors ran torch DDP (`Table1Row.torch_ddp`) and
    after it elsewhere, interleaved schedule when v > 1.
    """
    sections = {
        "model": {
            "num_layers": row.layers,
            "hidden_size": row.hidden,
            "num_heads": row.heads,
            "seq_length": SEQ,
            "vocab_size": VOCAB,
            "dropout": 0.1,
        },
        "parallel": {
            "tp": row.tp,
            "pp": row.pp,
            "vpp": vpp,
            "schedule": "interleaved" if vpp > 1 else "1f1b",
            "recompute": "full",
            "sequence_parallel": False,
            "scatter_gather": True,
            "overlap_grad_reduce": row.torch_ddp,
        },
        "optim": {"distributed": False},
        "train": {
            "precision": "bf16",
            "micro_batch_size": micro_batch,
            "global_batch_size": row.batch,
        },
    }
    return apply_updates(RunConfig(), sections, f"Table 1 row {row.name}")


@dataclass(frozen=True)
class Table2Row:
    """One row of the paper's Table 2 (section 5.2, Figure 10): PTD-P or ZeRO-3."""

    scheme: str
    """"ptd-p" (t = 8, p = model-parallel size / 8) or "zero-3" (t = p = 1, d = n)."""
    model: str
    """The preset (`PRESETS`): gpt3-175b (174.6B) or mt-nlg-530b (529.6B)."""
    model_parallel: int
    batch: int
    gpus: int
    micro_batch: int
    tflops: float
    """Published achieved TFLOP/s per GPU (equation (3), recomputation included)."""
    days: int
    """Published training time for 300B tokens."""


TABLE_2: tuple[Table2Row, ...] = (
    Table2Row("zero-3", "gpt3-175b", 1, 1536, 384, 4, 144, 90),
    Table2Row("zero-3", "gpt3-175b", 1, 1536, 768, 2, 88, 74),
    Table2Row("zero-3", "gpt3-175b", 1, 1536, 1536, 1, 44, 74),
    # The paper's star: ZeRO-3 at b = 4 did not fit on 560 GPUs, so 640 and batch 2560.
    Table2Row("zero-3", "mt-nlg-530b", 1, 2560, 640, 4, 138, 169),
    Table2Row("zero-3", "mt-nlg-530b", 1, 2240, 1120, 2, 98, 137),
    Table2Row("zero-3", "mt-nlg-530b", 1, 2240, 2240, 1, 48, 140),
    Table2Row("ptd-p", "gpt3-175b", 96, 1536, 384, 1, 153, 84),
    Table2Row("ptd-p", "gpt3-175b", 96, 1536, 768, 1, 149, 43),
    Table2Row("ptd-p", "gpt3-175b", 96, 1536, 1536, 1, 141, 23),
    Table2Row("ptd-p", "mt-nlg-530b", 280, 2240, 560, 1, 171, 156),
    Table2Row("ptd-p", "mt-nlg-530b", 280, 2240, 1120, 1, 167, 80),
    Table2Row("ptd-p", "mt-nlg-530b", 280, 2240, 2240, 1, 159, 42),
)


def table2_run(row: Table2Row, *, vpp: int = 1) -> RunConfig:
    """A Table 2 row as a ptdp config: the paper's model in mixed precision with full
    recomputation; PTD-P as `paper_run` sets it (t = 8, scatter/gather, interleaved when
    v > 1), ZeRO-3 as parallel.zero = 3 over all n GPUs (t = p = 1)."""
    mp = row.model_parallel
    ptdp = row.scheme == "ptd-p"
    parallel = {
        "tp": 8 if ptdp else 1,
        "pp": mp // 8 if ptdp else 1,
        "vpp": vpp,
        "schedule": "interleaved" if vpp > 1 else "1f1b",
        "recompute": "full",
        "sequence_parallel": False,
        "overlap_grad_reduce": not ptdp,
        "zero": 0 if ptdp else 3,
    }
    train = {
        "precision": "bf16",
        "micro_batch_size": row.micro_batch,
        "global_batch_size": row.batch,
    }
    cfg = replace(RunConfig(), model=preset(row.model))
    return apply_updates(cfg, {"parallel": parallel, "train": train}, f"Table 2 row {row}")
