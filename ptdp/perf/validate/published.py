"""Published H100 training measurements the H100 and H200 files are fitted to.

Megatron-Core's weak-scaling table (NVIDIA/Megatron-LM README, "Performance Benchmarking",
the image `images/model_table.png`, last changed in commit f2e5db402c44 of 2024-07-15,
read at commit d98e8a64ddf3): GPT models from 1.7B to 462B parameters on 48 to 6144 H100
SXM GPUs with Megatron-Core r0.8.0, vocabulary 131,072, sequence 4096, bf16, data-parallel
size 48 throughout, with the distributed optimizer and the tensor-parallel, gradient and
parameter communication overlapped (--tp-comm-overlap, --overlap-grad-reduce,
--overlap-param-gather). Its teraFLOP/s count model FLOPs (no recomputation, the full
s x s attention square: `ptdp.perf.cost.flops` counts the same), and MFU is that over 989.
https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/README.md

The table gives t, p, d, the global batch and the model's shape, not the micro-batch, the
chunks per pipeline rank or the recomputation. ptdp assumes micro-batch 1, no
recomputation (fused attention keeps no s x s tensor), sequence parallelism with t > 1,
and takes for v the interleaving its own simulator finds fastest (`vpp` below).
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.perf.cost.hardware import System
from ptdp.perf.cost.software import MEGATRON_CORE
from ptdp.perf.simulate.simulator import Prediction, simulate

SOURCE = (
    "https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/"
    "images/model_table.png"
)
VOCAB = 131072
SEQ = 4096


@dataclass(frozen=True)
class McoreRow:
    """One row of Megatron-Core's H100 weak-scaling table."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    dp: int
    gpus: int
    batch: int
    tflops: float
    """Published model teraFLOP/s per GPU."""
    mfu: float
    """Published model FLOPs utilisation (of 989 TFLOP/s)."""
    vpp: int
    """ptdp's assumption: the chunks per pipeline rank it simulates fastest (not published)."""


MCORE_H100_WEAK_SCALING: tuple[McoreRow, ...] = (
    McoreRow("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 0.41, 1),
    McoreRow("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 0.47, 1),
    McoreRow("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 0.49, 1),
    McoreRow("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 0.46, 1),
    McoreRow("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 0.42, 7),
    McoreRow("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 0.43, 23),
    McoreRow("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 0.44, 8),
    McoreRow("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 0.48, 6),
    McoreRow("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 0.47, 7),
)


def mcore_run(row: McoreRow, vpp: int | None = None) -> RunConfig:
    """The row as a ptdp config: its shape and layout, with the module docstring's
    assumptions for what the table leaves out."""
    v = row.vpp if vpp is None else vpp
    sections = {
        "model": {
            "num_layers": row.layers,
            "hidden_size": row.hidden,
            "num_heads": row.heads,
            "seq_length": SEQ,
            "vocab_size": VOCAB,
            "dropout": 0.0,
        },
        "parallel": {
            "tp": row.tp,
            "pp": row.pp,
            "dp": row.dp,
            "vpp": v,
            "schedule": "interleaved" if v > 1 else "1f1b",
            "recompute": "none",
            "sequence_parallel": row.tp > 1,
            "overlap_grad_reduce": True,
        },
        "optim": {"distributed": True},
        "train": {"precision": "bf16", "micro_batch_size": 1, "global_batch_size": row.batch},
    }
    return apply_updates(RunConfig(), sections, f"Megatron-Core row {row.name}")


def predict_row(row: McoreRow, system: System, vpp: int | None = None) -> Prediction:
    """ptdp's prediction of the row on `system` with Megatron-Core's software."""
    return simulate(mcore_run(row, vpp), system, row.gpus, software=MEGATRON_CORE)


def row_error(row: McoreRow, system: System) -> float:
    """Predicted / published model TFLOP/s per GPU, minus 1."""
    return predict_row(row, system).model_tflops_per_device / row.tflops - 1
