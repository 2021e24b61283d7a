"""Host (CPU) memory per rank: starting from Hugging Face weights, resuming, saving.

On a GPU the training state lives in device memory (`ptdp.perf.cost.memory`); what a rank
holds in host memory is its process (`PROCESS_BASELINE_BYTES`) plus, at any moment, one of
the phases below, so its need is the baseline plus the largest phase it goes through. The
ranks of a node share the node's memory (`System.host_memory_bytes`, a hardware file's
`[node] host_memory_gib`): their needs summed must fit in it, less `HOST_RESERVE_FRACTION`.

Per rank, with P its parameters after the tensor, pipeline and expert splits (`parameters_
per_rank`, its e / ep experts at 1/etp), T the model's largest full tensor and S its saved
state (`SAVED_BYTES_PER_PARAMETER` per parameter it owns: under ZeRO 1/(d cp) of each
parameter, an expert's 1/edp, as the optimizer state is sharded), in bytes:

- from Hugging Face weights (`checkpoint.init_from` a model directory): each rank reads
  only its slices, lazily from memory-mapped safetensors, so `HF_START_FACTOR` x 4 P
  (its shard in fp32) + 4 T (one full tensor read before slicing);
- from scratch: 4 T, the seeded full master value of one tensor at a time, sliced
  (`ptdp.model.init.init_tensor`, in fp32 on the host);
- resuming a ptdp checkpoint (`--resume`, or init_from a ptdp run): `RESUME_FACTOR` x S;
- a synchronous save, written from the live tensors: (`checkpoint.writer_threads` +
  `SYNC_SAVE_EXTRA_TENSORS`) x 4 L, L the rank's largest local tensor, staged from the
  device tensor by tensor;
- an asynchronous save (`train.async_save`): `ASYNC_SAVE_FACTOR` x S, the host copy of
  the whole state that the writer thread writes while training goes on.

Before item 6 of issue 52 a start read the whole model on every rank (2.1 to 2.9 times
its bytes); these figures are the loaders' as rebuilt there (DESIGN invariant 5). On a CPU
(`Device.gloo`) the training state itself is host memory, counted by the memory model:
nothing here applies (`applies`).

Letters: h = hidden, f = MLP width, v = vocabulary, e = routed experts, t = tensor size.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ptdp.config.enums import Activation, PositionEmbedding
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.config.shapes import Split, attention_linears
from ptdp.perf.cost.folding import Experts
from ptdp.perf.cost.hardware import GIB, System
from ptdp.perf.cost.parameters import (
    expert_parameters_per_rank,
    parameters_per_rank,
)
from ptdp.rules.layout import Layout

PROCESS_BASELINE_BYTES = 3 * GIB
"""Host memory of one training process before any phase: the CUDA context's host side,
torch and its CUDA libraries (cuBLAS, cuDNN, NCCL) loaded, Python, the data loader and its
index. An estimate (about 3 GB per rank on a GPU node), not measured by ptdp."""
HF_START_FACTOR = 1.5
"""Host bytes per byte of the rank's fp32 shard while it starts from Hugging Face weights:
its slices read from the memory-mapped safetensors, cast to fp32, and the copies on their
way to the device. A bound: on CPU ranks the loader's extra peak was at most 0.83 x (shard +
largest tensor) (BENCHMARKS.md, host memory of loading); the GPU path is unmeasured."""
RESUME_FACTOR = 1.6
"""Host bytes per byte of the rank's saved state while it resumes: DCP's read buffers and
the state they fill before it moves to the device. A bound: on CPU ranks a resume's extra
peak was at most 0.97 x the state (BENCHMARKS.md); the GPU path is unmeasured."""
SYNC_SAVE_EXTRA_TENSORS = 1
"""Largest local tensors in host memory during a synchronous save beside one per writer
thread (`checkpoint.writer_threads`, each holding the device-to-host copy of the tensor it
writes): the serialised bytes of the one being written."""
ASYNC_SAVE_FACTOR = 1.0
"""Host bytes per byte of saved state during an asynchronous save: one (pinned) host copy
of the whole state, written by a background thread while training goes on."""
SAVED_BYTES_PER_PARAMETER = 12
"""What a checkpoint holds per parameter a rank owns: fp32 weights (the master copy in
16-bit training) and AdamW's two fp32 moments (ptdp/checkpoint/sharded.py)."""
FP32 = 4
"""Bytes of one element as read or staged: fp32 (a 16-bit checkpoint reads half; fp32 is
the conservative figure)."""
HOST_RESERVE_FRACTION = 0.1
"""Fraction of a node's host memory left out of what its ranks may use: the kernel, the
page cache and file-system clients, the node's daemons, the driver's own pinned buffers."""


class Start(Enum):
    """How a run starts, for the host memory `ptdp plan` and `simulate` check (`--start`)."""

    ANY = "any"
    """Not known: the larger of HF and RESUME (a run that saves may be resumed)."""
    HF = "hf"
    RESUME = "resume"
    SCRATCH = "scratch"


START_WORDS = {
    Start.HF: "starting from Hugging Face weights",
    Start.RESUME: "resuming from a checkpoint",
    Start.SCRATCH: "starting from scratch",
}


@dataclass(frozen=True)
class HostMemory:
    """Host bytes of one rank of pipeline rank `rank`: the baseline and each phase's own
    (`need` adds them)."""

    rank: int
    baseline: float
    hf_start: float
    scratch: float
    resume: float
    save: float
    async_save: float

    def start(self, start: Start) -> tuple[Start, float]:
        """The start checked for `start` (ANY: the larger of HF and RESUME) and its bytes."""
        if start is Start.ANY:
            start = Start.HF if self.hf_start >= self.resume else Start.RESUME
        phase = {Start.HF: self.hf_start, Start.RESUME: self.resume, Start.SCRATCH: self.scratch}
        return start, phase[start]

    def peak(self, start: Start, async_save: bool) -> tuple[str, float]:
        """The largest phase of a run starting as `start` and saving as it says: what it
        is, in words, and its bytes beside the baseline."""
        start, starting = self.start(start)
        saving = self.async_save if async_save else self.save
        if saving > starting:
            return ("saving asynchronously" if async_save else "saving"), saving
        return START_WORDS[start], starting

    def need(self, start: Start, async_save: bool) -> float:
        """Baseline + the larger of the start and the saves the run makes."""
        return self.baseline + self.peak(start, async_save)[1]


def largest_tensor(model: ModelConfig) -> int:
    """Elements of the model's largest full tensor: the embedding or output v h, the fused QKV,
    the MLP's fc1 (SwiGLU's gate and up together), the shared experts' and all routed
    experts' fc1 of a layer in one (as ptdp builds them, and as `transformers` 5 stores
    them: gate_up_proj [e, 2f, h]). Checkpoints that keep them apart read less."""
    h = model.hidden_size
    parts = 2 if model.activation is Activation.SWIGLU else 1
    sizes = [model.vocab_size * h, *(x.weights for x in attention_linears(model))]
    sizes.append(parts * model.ffn_size * h)
    if model.position_embedding is PositionEmbedding.LEARNED:
        sizes.append(model.seq_length * h)
    if model.num_experts:
        sizes.append(model.num_experts * parts * model.moe_ffn_size * h)
        if model.moe_shared_experts:
            sizes.append(parts * model.moe_shared_ffn_size * h)
    return max(sizes)


def largest_local_tensor(model: ModelConfig, tp: int, ep: int = 1, etp: int | None = None) -> int:
    """Elements of a rank's largest tensor after the splits: `largest_tensor`'s over t (the
    vocabulary padded), the routed experts' e / ep over etp (a bound for every pipeline
    rank: each has its layers' and maybe the embedding's)."""
    h = model.hidden_size
    parts = 2 if model.activation is Activation.SWIGLU else 1
    sizes = [model.padded_vocab_size(tp) // tp * h]
    sizes += [x.weights // (1 if x.split is Split.NONE else tp) for x in attention_linears(model)]
    sizes.append(parts * model.ffn_size * h // tp)
    if model.num_experts:
        width = tp if etp is None else etp
        sizes.append(model.num_experts // ep * parts * model.moe_ffn_size * h // width)
    return max(sizes)


def host_memory(cfg: RunConfig, layout: Layout) -> tuple[HostMemory, ...]:
    """Host bytes per rank of each pipeline rank of `cfg` on `layout` (module doc)."""
    model, tp = cfg.model, layout.tp
    split = layout.stage_layers or (model.num_layers // (layout.pp * layout.vpp),) * (
        layout.pp * layout.vpp
    )
    where = (layout.pp, layout.vpp, split, layout.stages.placement, layout.ep, layout.etp)
    counts = parameters_per_rank(model, tp, *where)
    routed = expert_parameters_per_rank(model, tp, *where)
    sharded = layout.zero >= 1
    dense_owners = layout.dp * layout.cp if sharded else 1
    expert_owners = Experts.of(tp, layout.dp * layout.cp, layout.ep, layout.etp).edp
    expert_owners = expert_owners if sharded else 1
    full = FP32 * largest_tensor(model)
    local = FP32 * largest_local_tensor(model, tp, layout.ep, layout.etp)
    out = []
    for rank, (count, experts) in enumerate(zip(counts, routed)):
        owned = (count - experts) / dense_owners + experts / expert_owners
        saved = SAVED_BYTES_PER_PARAMETER * owned
        out.append(
            HostMemory(
                rank,
                baseline=PROCESS_BASELINE_BYTES,
                hf_start=HF_START_FACTOR * FP32 * count + full,
                scratch=full,
                resume=RESUME_FACTOR * saved,
                save=(cfg.checkpoint.writer_threads + SYNC_SAVE_EXTRA_TENSORS) * local,
                async_save=ASYNC_SAVE_FACTOR * saved,
            )
        )
    return tuple(out)


def applies(system: System) -> bool:
    """Whether host memory is modelled apart: on GPUs (on a CPU it holds the training state)."""
    return not system.device.gloo


@dataclass(frozen=True)
class NodeFit:
    """The fullest node's host memory against its capacity."""

    phase: str
    """What its fullest rank is doing at its peak, in words (`HostMemory.peak`)."""
    per_rank: float
    """The largest need of one rank on that node."""
    ranks: int
    """Ranks on that node."""
    need: float
    """Their needs summed."""
    capacity: float | None
    """The node's host memory (None: the hardware file does not say)."""

    @property
    def usable(self) -> float | None:
        return None if self.capacity is None else self.capacity * (1 - HOST_RESERVE_FRACTION)

    @property
    def fits(self) -> bool:
        return self.usable is None or self.need <= self.usable


def node_fit(
    host: tuple[HostMemory, ...], layout: Layout, system: System, start: Start, async_save: bool
) -> NodeFit:
    """Sum each node's ranks' needs (ranks in order, tp cp dp inside a pipeline rank, pp
    slowest: `ptdp.parallel.mesh`) and give the fullest node."""
    per_node, span = system.gpus_per_node, layout.world_size // layout.pp
    needs = [h.need(start, async_save) for h in host]
    best = (-1.0, 0, 0)
    for first in range(0, layout.world_size, per_node):
        last = min(first + per_node, layout.world_size)
        ranks = range(first // span, (last - 1) // span + 1)
        total = sum(needs[q] * (min(last, (q + 1) * span) - max(first, q * span)) for q in ranks)
        if total > best[0]:
            best = (total, last - first, max(ranks, key=lambda q: needs[q]))
    total, count, fullest = best
    phase = host[fullest].peak(start, async_save)[0]
    return NodeFit(phase, needs[fullest], count, total, system.host_memory_bytes)


def ranks(n: int) -> str:
    return f"{n} rank{'' if n == 1 else 's'}"


def refusal_reason(fit: NodeFit) -> str:
    """Why a layout does not fit in host memory, with the numbers."""
    usable, capacity = fit.usable or 0.0, fit.capacity or 0.0
    return (
        f"host memory: {fit.phase} needs {fit.per_rank / GIB:.1f} GiB per rank, "
        f"{ranks(fit.ranks)} per node = {fit.need / GIB:.1f} GiB > the node's "
        f"{usable / GIB:.0f} GiB usable (of {capacity / GIB:.0f} GiB, "
        f"{100 * HOST_RESERVE_FRACTION:.0f}% reserved)"
    )
