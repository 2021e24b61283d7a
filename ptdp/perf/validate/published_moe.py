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
expert activation ("norm, act") and DeepEP's dispatch are the software's
(`Software.discards_outputs`, `Software.moe_node_dedup`), ptdp's runtime has neither. Where
the layers do not divide evenly over the pipeline stages (the runs set the first and last
stage sizes, which the tables do not give), the first stages take one layer more. A row
that gives no recomputation is modelled without.

A row ptdp cannot express has `unexpressible` set, saying why; it is listed, not predicted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ptdp.config.files import apply_updates
from ptdp.config.presets import MODEL_PRESETS
from ptdp.config.sections import ParallelConfig, RunConfig
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.software import MEGATRON_CORE, Software
from ptdp.perf.simulate.simulator import Prediction, simulate

SOURCES: dict[str, str] = {
    "modelzoo": (
        "https://github.com/yanring/Megatron-MoE-ModelZoo/blob/"
        "c1ad0b5c89f425d60febddc38e7f741a16f08bd1/best_practice/Qwen3/readme.md"
        " (Performance Results: 256 H100, InfiniBand 8x50 GB/s)"
    ),
    "bridge": (
        "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/"
        "df0289c180dd20ff26933455c7a0a11084f6a36f/docs/performance-summary.md"
        " (System: DGX-H100 of the 26.02, 25.11 and 25.09 NeMo containers; MoE runs "
        "force-balanced)"
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
    deepep: bool = False
    """DeepEP's deduplicating dispatch (`Software.moe_node_dedup`); else an all-to-all."""
    overlap: bool = False
    """Megatron's all-to-all overlap with another microbatch's compute
    (`Software.moe_a2a_overlap`)."""
    tp_overlap: bool = True
    """Megatron's tensor-parallel communication overlap (Megatron-Bridge's H100 recipes turn
    it off)."""
    discards: bool = False
    """Megatron's output-discarding recomputation of the norms and the experts' activation
    ("recompute norm, act": `Software.discards_outputs`)."""
    note: str = ""
    unexpressible: str = ""
    """Why ptdp cannot model the row; empty where it can."""
    doubt: str = ""
    """Why a row ptdp models is left out of the accuracy target; empty where it counts."""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)


def _step(gbs: int, seq: int, seconds: float, gpus: int) -> float:
    return gbs * seq / seconds / gpus


_QWEN = "qwen3-235b-a22b"
_ZOO = dict(source="modelzoo", system="h100-sxm", preset=_QWEN, gpus=256, seq=4096)
_ZOO |= dict(cp=1, etp=1, micro_batch=1, global_batch=2048, precision="bf16", zero=1)
_BRIDGE = dict(source="bridge", system="h100-sxm", gpus=256, seq=4096, cp=1, etp=1)
_BRIDGE |= dict(recompute="none", zero=1)
# Its H100 recipe (scripts/performance/configs/qwen/, same repository): all-to-all dispatcher,
# moe_a2a_overlap on, tp_comm_overlap off; the recomputation is the repository's launch
# script for this layout's (scripts/moe_model_zoo/examples/qwen3/launch_qwen235b.sh:
# selective, moe_act and layernorm), which the table does not give.
_BRIDGE_235 = _BRIDGE | dict(preset=_QWEN, overlap=True, tp_overlap=False, discards=True)
_BRIDGE_30 = _BRIDGE | dict(preset="qwen3-30b-a3b", gpus=16)
_DOUBT_30 = (
    "the source's three Qwen3-30B-A3B rows on 16 H100 (10494, 5275 and 2557 tokens/s in "
    "25.09, 25.11 and 26.02) differ 4x for nearly one layout, and none gives its "
    "recomputation or dispatcher"
)

MOE_RUNS: tuple[MoeRun, ...] = (
    MoeRun(
        "Qwen3-235B tp2 ep32 pp8 (cross-node EP)",
        tp=2, ep=32, pp=8, vpp=4, recompute="none", deepep=True, discards=True,
        tokens_per_gpu=_step(2048, 4096, 19.7, 256), tflops=245,
        note="DeepEP; recompute norm, act", **_ZOO,
    ),
    MoeRun(
        "Qwen3-235B tp2 ep32 pp8 + 1F1B A2A overlap",
        tp=2, ep=32, pp=8, vpp=4, recompute="none", deepep=True, discards=True,
        tokens_per_gpu=_step(2048, 4096, 17.6, 256), tflops=276, overlap=True,
        note="DeepEP; recompute norm, act; Megatron's overlap under the interleaved schedule "
        "(ptdp's parallel.moe_overlap pairs 1f1b and dualpipev only)",
        **_ZOO,
    ),
    MoeRun(
        "Qwen3-235B tp2 ep8 FSDP (intra-node EP)",
        tp=2, ep=8, pp=1, vpp=1, recompute="full", deepep=True,
        tokens_per_gpu=_step(2048, 4096, 17.6, 256), tflops=276,
        note="DeepEP; Megatron FSDP as ZeRO-3, micro-batch 4",
        **(_ZOO | dict(micro_batch=4, zero=3)),
    ),
    MoeRun(
        "Qwen3-235B tp2 ep8 pp32 (all-to-all)",
        tp=2, ep=8, pp=32, vpp=3, recompute="none", discards=True,
        tokens_per_gpu=_step(2048, 4096, 24.2, 256), tflops=200,
        note="all-to-all dispatcher; recompute norm, act",
        unexpressible="94 layers over 96 virtual stages: two stages without a layer in the "
        "middle, which ptdp's pipeline_layers refuses (only the first and the last may be 0)",
        **_ZOO,
    ),
    MoeRun(
        "Qwen3-235B tp4 ep8 pp8",
        tp=4, ep=8, pp=8, vpp=4, recompute="none", deepep=True,
        tokens_per_gpu=_step(2048, 4096, 29.0, 256), tflops=167,
        note="DeepEP; no recompute", **_ZOO,
    ),
    MoeRun(
        "Qwen3-235B fp8 tp2 ep32 pp8 (Bridge 26.02)",
        tp=2, ep=32, pp=8, vpp=4, micro_batch=1, global_batch=8192, precision="fp8",
        tokens_per_gpu=1633, tflops=242, note="FP8 current scaling", **_BRIDGE_235,
    ),
    MoeRun(
        "Qwen3-235B fp8 tp2 ep32 pp8 (Bridge 25.11)",
        tp=2, ep=32, pp=8, vpp=4, micro_batch=1, global_batch=2048, precision="fp8",
        tokens_per_gpu=1575, tflops=233, note="FP8 current scaling", **_BRIDGE_235,
    ),
    MoeRun(
        "Qwen3-235B tp2 ep32 pp8 (Bridge 25.09)",
        tp=2, ep=32, pp=8, vpp=4, micro_batch=1, global_batch=2048, precision="bf16",
        tokens_per_gpu=1204, tflops=178, note="token-dropping",
        unexpressible="the precision is not given, nor the capacity factor of its token "
        "dropping", **_BRIDGE_235,
    ),
    MoeRun(
        "Qwen3-30B-A3B fp8 tp1 ep8 pp2 (Bridge 25.11)",
        tp=1, ep=8, pp=2, vpp=24, micro_batch=2, global_batch=512, precision="fp8",
        tokens_per_gpu=5275, tflops=121, note="FP8 current scaling", doubt=_DOUBT_30,
        **_BRIDGE_30,
    ),
    MoeRun(
        "Qwen3-30B-A3B fp8 tp1 ep8 pp2 (Bridge 26.02)",
        tp=1, ep=8, pp=2, vpp=12, micro_batch=1, global_batch=1024, precision="fp8",
        tokens_per_gpu=2557, tflops=118,
        note="FP8 current scaling", doubt=_DOUBT_30 + "; its tokens/s and TFLOP/s disagree by "
        "2x (46 GFLOP a token where the model has about 25)", **_BRIDGE_30,
    ),
    MoeRun(
        "Qwen3-30B-A3B tp1 ep8 pp2 (Bridge 25.09)",
        tp=1, ep=8, pp=2, vpp=24, micro_batch=2, global_batch=512, precision="bf16",
        tokens_per_gpu=10494, tflops=241, note="token-dropping",
        unexpressible="the precision is not given, nor the capacity factor of its token "
        "dropping", **_BRIDGE_30,
    ),
    MoeRun(
        "GPT-OSS 120B tp1 ep8 pp4 (Bridge 26.02)",
        source="bridge", system="h100-sxm", preset="", gpus=64, tp=1, cp=1, ep=8, etp=1,
        pp=4, vpp=1, micro_batch=1, global_batch=1280, seq=4096, precision="bf16",
        recompute="none", zero=1, tokens_per_gpu=5993, tflops=163,
        unexpressible="attention sinks and alternating sliding-window layers: no ptdp preset",
    ),
    MoeRun(
        "DeepSeek-V3 tp2 ep64 pp8 on 1024 H100 (Bridge 25.09)",
        source="bridge", system="h100-sxm", preset="deepseek-v3", gpus=1024, tp=2, cp=1,
        ep=64, etp=1, pp=8, vpp=4, micro_batch=1, global_batch=8192, seq=4096,
        precision="bf16", recompute="none", zero=1, tokens_per_gpu=1297, tflops=338,
        unexpressible="its recomputation is not given: priced with none and one MTP layer "
        "the row is 27 GiB over its 80 GB and 50% slow, with full recomputation it fits and "
        "is 63% slow",
    ),
    MoeRun(
        "DeepSeek-V3 pre-training (2048 H800)",
        source="deepseek-v3", system="h800", preset="deepseek-v3", gpus=2048,
        tp=1, cp=1, ep=64, etp=1, pp=16, vpp=2, micro_batch=1, global_batch=15360, seq=4096,
        precision="fp8", recompute="none", zero=1, tokens_per_gpu=1e12 / 180e3 / 3600,
        tflops=0.0, note="tokens/s from 180K GPU hours per trillion tokens",
        unexpressible="multi-token prediction and DualPipe's two-way schedule; the GPU hours "
        "include the batch size's ramp",
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


def run_software(row: MoeRun) -> Software:
    """Megatron-Core as the row ran it: its dispatcher, overlaps and output-discarding
    recomputation."""
    return replace(
        MEGATRON_CORE,
        moe_node_dedup=row.deepep,
        moe_a2a_overlap=row.overlap,
        tp_comm_overlap=row.tp_overlap,
        discards_outputs=row.discards,
    )


def predict_moe_run(row: MoeRun) -> Prediction:
    """ptdp's prediction of the row on its device file with the row's Megatron-Core."""
    system = load_system(row.system)
    return simulate(moe_run(row), system, row.gpus, software=run_software(row))


def expressible() -> tuple[MoeRun, ...]:
    """The rows ptdp models."""
    return tuple(row for row in MOE_RUNS if not row.unexpressible)


def targeted() -> tuple[MoeRun, ...]:
    """The rows the accuracy target counts: modelled and not in doubt."""
    return tuple(row for row in expressible() if not row.doubt)


def moe_error(row: MoeRun, prediction: Prediction | None = None) -> float:
    """Predicted / published tokens/s per GPU, minus 1."""
    got = prediction or predict_moe_run(row)
    return got.tokens_per_second / row.gpus / row.tokens_per_gpu - 1
