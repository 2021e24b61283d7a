"""What the training code does that changes its speed, apart from the hardware (`Software`),
and the runtimes the performance model knows by name (`SOFTWARE`): ptdp's own and the
published codes it is checked against."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Software:
    """What the training code does that changes its speed (not the hardware)."""

    fused_attention: bool = True
    """Flash/memory-efficient attention (ptdp's SDPA on GPUs); False = the s x s scores are
    materialised, soft-maxed and dropped out in HBM (Megatron-LM in 2021)."""
    elementwise_traffic: float = 1.6
    """HBM bytes moved by memory-bound kernels in forward per activation byte stored.
    Calibrated on Korthikanti et al.'s Table 4: one 22B layer (t = 8, b = 4) takes 7.7 ms
    forward on A100s."""
    backward_traffic_ratio: float = 1.6
    """Backward / forward HBM traffic of the memory-bound kernels (they read the saved
    input and the incoming gradient and write the outgoing one, against a read and a
    write forward). Calibrated on the same layer's 11.9 ms backward, whose code hid the
    two backward all-reduces behind the weight-gradient GEMMs."""
    grad_reduce_bytes: int = 4
    """Bytes per gradient element in the data-parallel reduction (ptdp: fp32 buffers)."""
    causal_fraction: float = 0.5
    """Share of the s x s score blocks a fused causal kernel computes."""
    fused_backward_ratio: float = 2.5
    """Fused attention backward / forward time (5 GEMMs against 2, FlashAttention-2)."""
    blocking_p2p: bool = False
    """Pipeline transfers block the rank until done (Megatron-LM in 2021 synchronised after
    each batch of sends and receives); False = ptdp's runtime, which waits for a receive
    only when its tensor is needed and for sends at the end of the step."""
    split_backward: bool = True
    """The zero-bubble schedules (ZB-H1, ZB-H2: B and W apart) exist; Megatron-LM in 2021
    had none, so the planner does not search them for it."""
    elementwise_kernels: int = 8
    """Memory-bound kernels one layer launches in forward (two norms, two residual adds, the
    activation, the copies around attention), each paying the device's kernel overhead;
    backward launches `backward_traffic_ratio` times as many. A fixed cost per layer that
    weighs most where the per-rank tensors are small (small h / t)."""
    tp_comm_overlap: bool = False
    """Tensor-parallel collectives run in chunks under the GEMMs that consume or produce
    them (Megatron-Core's --tp-comm-overlap through Transformer Engine): only what outlasts
    a pass's GEMMs is exposed. ptdp runs them between its GEMMs (False)."""
    overlap_param_gather: bool = False
    """The distributed optimizer's all-gather of updated weights runs under the next step's
    first forward (Megatron-Core's --overlap-param-gather): only what outlasts that forward
    is exposed. ptdp gathers after the step (False)."""
    max_zero: int = 3
    """Highest ZeRO level the software has; the planner searches up to it (Megatron-LM in
    2021 had none: 0)."""
    sharded_comm_efficiency: float = 1.0
    """Fraction of the ring model's bandwidth that ZeRO-2/3's per-layer gathers and
    reduce-scatters reach (`ptdp.perf.cost.zero`); 1 = NCCL on flat buckets."""
    overlap_grad_reduce: bool = True
    """The data-parallel reduction can overlap the backward (`parallel.overlap_grad_reduce`)."""
    overlap_needs_pp1: bool = False
    """...and only without pipeline parallelism: Megatron-LM in 2021 overlapped it through
    torch DDP (--DDP-impl torch, no_sync until the last microbatch), which its pipelined
    schedules did not drive, so with p > 1 it reduced after the backward (--DDP-impl local)."""
    sequence_parallel: bool = True
    """Sequence parallelism exists (Korthikanti et al. 2022 added it, and selective
    recomputation with it); the 2021 code had neither."""
    accumulation_bytes: int = 4
    """Bytes per element of the buffers each microbatch's gradients are added into, in a
    pass of their own once autograd has written them: ptdp's `GradBuffers` hook adds into
    fp32 buffers (4), the 2021 code's into buffers of the gradients' 16 bits (2); 0 = no such
    pass: Megatron-Core's weight-gradient GEMMs accumulate into the buffer themselves
    (`--gradient-accumulation-fusion`, on by default; what stays unfused there, the norms,
    biases and input embedding, is not counted)."""
    autocast_norms: bool = True
    """The norms run under PyTorch's autocast, which computes them in fp32 and, in eager
    16-bit training, keeps each norm input's fp32 copy for backward (`ptdp.perf.cost.memory`);
    Megatron's fused LayerNorm kernels keep the 16-bit input (False)."""
    native_gqa: bool = False
    """Grouped-query attention's kernel reads K and V at their groups' width, so only those
    are kept; ptdp repeats them to every query head before SDPA, which keeps the copies
    (measured on CPU ranks, BENCHMARKS.md)."""
    fused_swiglu: bool = False
    """SwiGLU as one fused function keeping only its [n, 2f] input (and fc2 its [n, f] input):
    3f per token where ptdp's silu(gate) * up also keeps silu's output, 4f."""
    moe_load_imbalance: float = 1.0
    """Mixture of experts: the busiest routed expert's token-choices over the mean, scaling
    the routed experts' GEMM time (`ptdp.perf.cost.moe`); 1.0 = a perfect balance, or
    ptdp's grouped GEMM on a rank holding every expert."""
    moe_node_dedup: bool = False
    """The dispatch sends a token once to each other node holding any of its experts, which
    fans it out over NVLink there (DeepEP: Megatron-Core's --moe-enable-deepep, DeepSeek-V3
    section 3.2.2); false: one row per token-choice, as ptdp's all-to-all
    (`ptdp.perf.cost.experts.dedup_seconds`)."""
    moe_a2a_overlap: bool = False
    """The expert-parallel all-to-alls of one microbatch run behind the compute of another,
    as `parallel.moe_overlap` makes ptdp's 1f1b and dualpipev do, under any schedule
    (Megatron-Core's --overlap-moe-expert-parallel-comm, interleaved included)."""
    moe_overlap_fraction: float = 0.2
    """Of the paired pass's compute, the part the all-to-alls hide behind when overlapped
    (`experts.overlapped`): 0.2 reproduces the one published pair with and without the
    overlap (Megatron-MoE-ModelZoo, Qwen3-235B on 256 H100: 19.7 s a step, 17.6 s with it;
    `ptdp.perf.validate.published_moe`), the comm kernels taking SMs and only parts of a
    pass lining up with the other's; unmeasured for ptdp's runtime."""
    discards_outputs: bool = False
    """The norms' and the routed experts' activation outputs are not kept but recomputed in
    backward (Megatron-Core's output-discarding --recompute-modules layernorm moe_act;
    `ptdp.perf.cost.layer_bytes`); ptdp keeps them."""
    captures_graphs: bool = True
    """The runtime can replay its compiled regions from CUDA graphs (ptdp's
    `train.cuda_graphs`); the other profiles' codes are modelled without, and a config
    asking for graphs there is refused (`ptdp.perf.cost.switches`)."""
    cuda_graphs: bool = False
    """This run replays each compiled region (a layer's forward, its backward, the loss) from
    a CUDA graph: one launch per replay instead of one per kernel (`Compute.replayed`). Set
    from the config by `ptdp.perf.cost.switches.run_software`, not by a profile."""
    math_kernel: bool = False
    """PyTorch's math attention runs the core (`train.attention_backend = math` on a runtime
    with fused attention): unfused, and eager its scaled q and k copies kept
    (`ptdp.perf.cost.switch_bytes`). Set by `run_software`; the 2021 codes' own unfused core
    keeps no such copies."""


PTDP = Software()
"""This runtime: SDPA (fused attention), non-blocking transfers, fp32 gradient buffers."""
MEGATRON_2021 = Software(
    fused_attention=False,
    grad_reduce_bytes=2,
    blocking_p2p=True,
    split_backward=False,
    max_zero=0,
    overlap_needs_pp1=True,
    sequence_parallel=False,
    accumulation_bytes=2,
    autocast_norms=False,
    captures_graphs=False,
)
"""The code of the paper's measurements: unfused attention, fp16 gradients all-reduced (its
default for fp16 training), overlapping the backward only at p = 1 (torch DDP), blocking
pipeline transfers, no zero-bubble schedules, no sequence parallelism or selective
recomputation."""

MEGATRON_CORE = Software(
    grad_reduce_bytes=2,
    tp_comm_overlap=True,
    overlap_param_gather=True,
    accumulation_bytes=0,
    autocast_norms=False,
    native_gqa=True,
    fused_swiglu=True,
    captures_graphs=False,  # its own CUDA graphs (--enable-cuda-graph) are not modelled
)
"""Megatron-Core as its published H100 weak-scaling runs used it (`ptdp.perf.validate.published`):
fused attention (reading grouped K and V as they are), overlapped tensor-parallel, gradient
and parameter communication, gradients reduced in bf16 (its default, grad_reduce_in_fp32
off), and its fused SwiGLU (bias_swiglu, which keeps only its input)."""
DEEPSPEED_2021 = replace(
    MEGATRON_2021, max_zero=3, sharded_comm_efficiency=0.094, overlap_grad_reduce=False
)
"""The paper's ZeRO-3 baseline (section 5.2: DeepSpeed on the same model code), its reduction
after the backward as the constant below was fitted with: its
per-layer collectives reached 0.094 of the ring model's bandwidth, about one 16 GB/s per
GPU where NCCL's rings over a node's 8 cards give 170; one constant fitted to the paper's
GPT-3 175B row on 1536 GPUs and checked on its other five ZeRO-3 rows (BENCHMARKS.md)."""

SOFTWARE: dict[str, Software] = {
    "ptdp": PTDP,
    "megatron-2021": MEGATRON_2021,
    "megatron-core": MEGATRON_CORE,
    "megatron-core-deepep": replace(MEGATRON_CORE, moe_node_dedup=True),
    "deepspeed-2021": DEEPSPEED_2021,
}
"""The runtimes by name, as `--software` of `ptdp simulate` and `ptdp plan` takes them."""
