"""Published mixture-of-experts training runs, as data, and ptdp's prediction of each.

Each `MoeRun` is one table row of its source (`SOURCES`, read at the commit named there): the
GPUs, the layout, the model, the batch and what was measured (tokens/s per GPU, from the
step time where the table gives that, and the published model TFLOP/s per GPU). ptdp
predicts the tokens/s per GPU with Megatron-Core's software (`MEGATRON_CORE`, which these
runs used) on the row's device file, and compares; tokens/s is the figure both sides count
the same way (every publisher counts its own model FLOPs).

What ptdp assumes where a row is silent: the experts' tensor split etp = 1 where the row
does not give it (Megatron-Core's MoE recipes set --expert-tensor-parallel-size 1); a
uniform routing (the ModelZoo's and Megatron-Bridge's H100 runs force-balance or are
reported as balanced); Megatron's output-discarding recomputation of the norms and the
expert activation ("norm, act") has no ptdp option, so those rows are modelled without
recomputation (more memory than the run kept, the same compute). Layers that do not divide
evenly over the pipeline stages are split as Megatron-Core does by default (the first
stages one layer more).

A row ptdp cannot express has `unexpressible` set, saying why; it is listed, not predicted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ptdp.config.files import apply_updates
from ptdp.config.presets import MODEL_PRESETS
from ptdp.config.sections import ParallelConfig, RunConfig
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.software import MEGATRON_CORE
from ptdp.perf.simulate.simulator import Prediction, simulate

SOURCES: dict[str, str] = {
    "modelzoo": (
        "https://github.com/yanring/Megatron-MoE-ModelZoo/blob/"
        "c1ad0b5c89f425d60febddc38e7f741a16f08bd1/best_practice/Qwen3/readme.md"
        " (Performance Results: 256 H100, InfiniBand 8x50 GB/s)"
    ),
    "bridge": (
        "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/"
        "00b7660be0254ac6f95f44164ddd0c3e9cc798ed/docs/performance-summary.md"
        " (25.11 NeMo container, System: DGX-H100)"
    ),
    "deepseek-v3": (
        "DeepSeek-V3 Technical Report, arXiv 2412.19437: Table 1 (2.664M H800 GPU hours for "
        "14.8T tokens of pre-training, 180K per trillion) and section 3.2 (2048 H800, PP 16, "
        "EP 64 over 8 nodes, ZeRO-1, DualPipe, FP8)"
    ),
}


@dataclass(frozen=True)
class MoeRun:
    """One published MoE training run."""

    name: str
    source: str
    """Key of `SOURCES`."""
    system: str
    """ptdp's device file."""
    preset: str
    """ptdp's model preset (`ptdp.config.presets.MODEL_PRESETS`)."""
    gpus: int
    tp: int
    cp: int
    ep: int
    etp: int
    pp: int
    vpp: int
    micro_batch: int
    global_batch: int
    seq: int
    precision: str
    recompute: str
    """ptdp's recomputation for the row's (module doc)."""
    zero: int
    """1: Megatron's distributed optimizer; 3: its FSDP."""
    tokens_per_gpu: float
    """Published tokens/s per GPU (global batch x sequence / step time / GPUs where the
    source gives the step time)."""
    tflops: float
    """Published model TFLOP/s per GPU (the publisher's FLOP count)."""
    note: str = ""
    unexpressible: str = ""
    """Why ptdp cannot model the row; empty where it can."""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)


def _step(gbs: int, seq: int, seconds: float, gpus: int) -> float:
    return gbs * seq / seconds / gpus


_QWEN = "qwen3-235b-a22b"
_ZOO = dict(source="modelzoo", system="h100-sxm", preset=_QWEN, gpus=256, seq=4096)
_ZOO |= dict(cp=1, etp=1, micro_batch=1, global_batch=2048, precision="bf16", zero=1)

MOE_RUNS: tuple[MoeRun, ...] = (
    MoeRun(
        "Qwen3-235B tp2 ep32 pp8 (cross-node EP)",
        tp=2, ep=32, pp=8, vpp=4, recompute="none",
        tokens_per_gpu=_step(2048, 4096, 19.7, 256), tflops=245,
        note="DeepEP dispatcher; recompute norm, act", **_ZOO,
    ),
    MoeRun(
        "Qwen3-235B tp2 ep32 pp8 + 1F1B A2A overlap",
        tp=2, ep=32, pp=8, vpp=4, recompute="none",
        tokens_per_gpu=_step(2048, 4096, 17.6, 256), tflops=276,
        note="DeepEP; recompute norm, act",
        unexpressible="overlap under the interleaved schedule: ptdp pairs 1f1b and dualpipev",
        **_ZOO,
    ),
    MoeRun(
        "Qwen3-235B tp2 ep8 FSDP (intra-node EP)",
        tp=2, ep=8, pp=1, vpp=1, recompute="full",
        tokens_per_gpu=_step(2048, 4096, 17.6, 256), tflops=276,
        note="DeepEP; Megatron FSDP as ZeRO-3, micro-batch 4",
        **(_ZOO | dict(micro_batch=4, zero=3)),
    ),
    MoeRun(
        "Qwen3-235B tp2 ep8 pp32 (all-to-all)",
        tp=2, ep=8, pp=32, vpp=3, recompute="none",
        tokens_per_gpu=_step(2048, 4096, 24.2, 256), tflops=200,
        note="all-to-all dispatcher; recompute norm, act",
        unexpressible="94 layers over 96 virtual stages: two stages without a layer in the "
        "middle, which ptdp's pipeline_layers refuses (only the first and the last may be 0)",
        **_ZOO,
    ),
    MoeRun(
        "Qwen3-235B tp4 ep8 pp8",
        tp=4, ep=8, pp=8, vpp=4, recompute="none",
        tokens_per_gpu=_step(2048, 4096, 29.0, 256), tflops=167,
        note="DeepEP; no recompute", **_ZOO,
    ),
    MoeRun(
        "Qwen3-30B-A3B tp1 ep8 pp2 (Megatron-Bridge)",
        source="bridge", system="h100-sxm", preset="qwen3-30b-a3b", gpus=16,
        tp=1, cp=1, ep=8, etp=1, pp=2, vpp=24, micro_batch=2, global_batch=512, seq=4096,
        precision="fp8", recompute="none", zero=1, tokens_per_gpu=5275, tflops=121,
        note="FP8 current scaling; force-balanced, dropless",
    ),
    MoeRun(
        "DeepSeek-V3 pre-training (2048 H800)",
        source="deepseek-v3", system="h800", preset="deepseek-v3-moe", gpus=2048,
        tp=1, cp=1, ep=64, etp=1, pp=16, vpp=2, micro_batch=1, global_batch=15360, seq=4096,
        precision="fp8", recompute="none", zero=1, tokens_per_gpu=1e12 / 180e3 / 3600 / 1,
        tflops=0.0, note="tokens/s from 180K GPU hours per trillion tokens",
        unexpressible="multi-head latent attention (ptdp's preset stands in grouped-query "
        "attention of another width), multi-token prediction and DualPipe's two-way "
        "schedule; the GPU hours include the ramp of the batch size",
    ),
)  # fmt: skip
"""The rows (module doc)."""


def moe_run(row: MoeRun) -> RunConfig:
    """The row as a ptdp config (module doc for what the row leaves out)."""
    model = dict(MODEL_PRESETS[row.preset], seq_length=row.seq, dropout=0.0)
    stages = row.pp * row.vpp
    base, extra = divmod(model["num_layers"], stages)
    layers = tuple(base + (i < extra) for i in range(stages)) if extra else ()
    parallel = {
        "tp": row.tp,
        "cp": row.cp,
        "pp": row.pp,
        "dp": row.dp,
        "ep": row.ep,
        "etp": row.etp,
        "vpp": row.vpp,
        "schedule": "interleaved" if row.vpp > 1 else "1f1b",
        "pipeline_layers": layers,
        "recompute": row.recompute,
        "sequence_parallel": row.tp > 1,
        "zero": row.zero,
    }
    if "moe_overlap" in {f.name for f in fields(ParallelConfig)}:
        parallel["moe_overlap"] = False
    train = {
        "precision": row.precision,
        "micro_batch_size": row.micro_batch,
        "global_batch_size": row.global_batch,
    }
    sections = {"model": model, "parallel": parallel, "train": train}
    return apply_updates(RunConfig(), sections, f"published run {row.name}")


def predict_moe_run(row: MoeRun) -> Prediction:
    """ptdp's prediction of the row on its device file with Megatron-Core's software."""
    return simulate(moe_run(row), load_system(row.system), row.gpus, software=MEGATRON_CORE)


def expressible() -> tuple[MoeRun, ...]:
    return tuple(row for row in MOE_RUNS if not row.unexpressible)


def moe_error(row: MoeRun, prediction: Prediction | None = None) -> float:
    """Predicted / published tokens/s per GPU, minus 1."""
    got = prediction or predict_moe_run(row)
    return got.tokens_per_second / row.gpus / row.tokens_per_gpu - 1
