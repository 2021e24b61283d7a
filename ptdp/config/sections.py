"""Typed run configuration: defaults < TOML file < `--section.key value` overrides.

Every field carries a type, a default and an attribute docstring; the docstrings are
what `ptdp train --help` prints. `ptdp.rules.layout.validate()` holds every cross-field
rule and runs before any process group exists, so a layout that cannot work fails in the
shell, not an hour into a cluster job. Derived numbers live in its `Layout`, never written
back.

This module holds the dataclasses. The enums of their choices are in `ptdp.config.enums`;
reading a config from TOML and the command line, writing it back and the help text are in
`ptdp.config.files`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ptdp.config.enums import (
    Activation,
    AttentionBackend,
    AttentionKind,
    CpComm,
    Fp8Recipe,
    Normalization,
    OnNan,
    PositionEmbedding,
    Precision,
    Recompute,
    Recovery,
    Resume,
    RopeScaling,
    Schedule,
    ScoreFunction,
)

LAYOUT_ONLY_MODEL_KEYS = frozenset({"make_vocab_size_divisible_by"})
"""Model settings that change how tensors are laid out in memory, not the model: a run
may resume with other values."""


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """The network itself, the same in every parallel layout: a checkpoint records it and
    loads into any layout."""

    num_layers: int = 4
    """Transformer layers."""
    hidden_size: int = 256
    """Model width h."""
    num_heads: int = 4
    """Attention heads; must divide hidden_size unless model.head_size is set."""
    head_size: int = 0
    """Width of one attention head; 0 = hidden_size / num_heads. Qwen3 sets it apart (e.g.
    128 for a 1024-wide model with 16 heads): the output projection then takes
    num_heads * head_size inputs."""
    num_query_groups: int = 0
    """Key/value heads for grouped-query attention; 0 = num_heads (plain multi-head)."""
    ffn_hidden_size: int = 0
    """MLP inner width; 0 = 4h for gelu, 8h/3 rounded up to a multiple of 64 for swiglu."""
    vocab_size: int = 0
    """Vocabulary size; 0 = take it from the data's tokenizer."""
    make_vocab_size_divisible_by: int = 128
    """Pad the embedding and output rows to a multiple of this times tp, so the output
    layer's matrix product has aligned shapes (GPT-2's 50,257 -> 50,304). The padded rows
    are masked out of the loss and never stored: results and checkpoints do not depend
    on it. 1 = no padding beyond a multiple of tp."""
    seq_length: int = 256
    """Tokens per training sample (context length)."""
    position_embedding: PositionEmbedding = PositionEmbedding.LEARNED
    """Positions: learned (GPT-2) or rope (Llama)."""
    rope_theta: float = 10000.0
    """Rotary base frequency (Llama 3: 500000, Qwen2.5: 1000000)."""
    rope_scaling: RopeScaling = RopeScaling.NONE
    """Rotary frequency scaling for a longer context: none, llama3 (Llama 3.1+, the four
    keys below: slow rotations turn slower, fast ones are kept, the band between blends),
    or yarn (DeepSeek-V3, Qwen3 and Kimi K2 long-context configs: the factor, the original
    context and the beta and mscale keys below)."""
    rope_scaling_factor: float = 8.0
    """llama3 and yarn: how many times slower the slow rotations turn (yarn: the context
    is stretched this many times, DeepSeek-V3 40, Qwen3 4)."""
    rope_low_freq_factor: float = 1.0
    """llama3: rotations with a wavelength over rope_original_max_positions / this are slowed."""
    rope_high_freq_factor: float = 4.0
    """llama3: rotations with a wavelength under rope_original_max_positions / this are kept."""
    rope_original_max_positions: int = 8192
    """llama3 and yarn: the context length the model was first trained at."""
    rope_beta_fast: float = 32.0
    """yarn: pairs turning more than this many times over the original context are kept."""
    rope_beta_slow: float = 1.0
    """yarn: pairs turning fewer than this many times are slowed by the factor (between
    the two betas the frequency blends linearly in the pair index)."""
    rope_mscale: float = 0.0
    """yarn: the attention temperature's coefficient; with rope_mscale_all_dim both set,
    the rotated queries and keys are scaled by m(mscale) / m(mscale_all_dim), m(c) =
    0.1 c ln(factor) + 1 (DeepSeek-V3: 1 and 1, so 1); 0 = scaled by m(1) as YaRN's
    paper (Peng et al. 2023, arXiv 2309.00071) and `transformers`."""
    rope_mscale_all_dim: float = 0.0
    """yarn: see rope_mscale (0 = not set)."""
    normalization: Normalization = Normalization.LAYERNORM
    """layernorm (GPT-2) or rmsnorm (Llama)."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers."""
    activation: Activation = Activation.GELU
    """MLP: gelu (GPT-2) or swiglu (Llama)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output layer."""
    bias: bool = True
    """Biases in linear layers and LayerNorm (Llama uses none)."""
    qkv_bias: bool = False
    """A bias on the query/key/value projection even when model.bias is false (Qwen2)."""
    qk_norm: bool = False
    """Normalise each query and key head over its head_size before the rotary positions
    (Qwen3's q_norm and k_norm): one gain vector of head_size for all query heads, one for
    all key heads, with model.normalization's kind."""
    sliding_window: int = 0
    """Sliding-window attention (Mistral): a position attends to itself and the
    sliding_window - 1 positions before it; 0 = every earlier position."""
    attention: AttentionKind = AttentionKind.MHA
    """mha: multi-head attention with num_query_groups key/value heads (grouped-query);
    mla: DeepSeek's multi-head latent attention (DeepSeek-V2/V3, Kimi K2), keys and values
    up-projected from a shared latent of kv_lora_rank per token, with a rotary key of
    qk_rope_head_dim shared by all heads (`ptdp.model.latent_attention`)."""
    q_lora_rank: int = 0
    """mla: width of the queries' latent (DeepSeek-V3 1536); 0 = queries projected from
    the hidden state directly (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 0
    """mla: width of the keys' and values' shared latent (DeepSeek-V3 512)."""
    qk_nope_head_dim: int = 0
    """mla: per head, the query and key features without rotary positions (DeepSeek-V3 128)."""
    qk_rope_head_dim: int = 0
    """mla: per head, the query and key features with rotary positions (DeepSeek-V3 64);
    the key's are one vector shared by all heads."""
    v_head_dim: int = 0
    """mla: width of one head's value (DeepSeek-V3 128)."""
    dropout: float = 0.0
    """Dropout on attention probabilities and residual branches."""
    init_std: float = 0.02
    """Std of the normal initialisation; residual output layers use init_std/sqrt(2L)."""
    num_experts: int = 0
    """Routed experts of each mixture-of-experts (MoE) layer, which replaces the MLP of the
    layers that moe_first_dense_layers and moe_layer_freq pick; 0 = a dense model (every
    other moe_* key must then stay at its default)."""
    moe_top_k: int = 2
    """Experts each token is routed to (Mixtral 2, Qwen3-MoE 8, DeepSeek-V3 8)."""
    moe_ffn_hidden_size: int = 0
    """Inner width of one routed expert; 0 = the MLP width (model.ffn_hidden_size)."""
    moe_score_function: ScoreFunction = ScoreFunction.SOFTMAX
    """Router scores from its logits: softmax over the experts (Mixtral, Qwen3-MoE) or an
    independent sigmoid per expert (DeepSeek-V3)."""
    moe_softmax_after_topk: bool = False
    """Mixtral's order: pick the top-k logits, then softmax over the chosen; false = softmax
    over all experts, then the top-k of it (Qwen3-MoE). Softmax scores only."""
    moe_renormalize: bool = False
    """Renormalise each token's chosen weights to sum to 1 (Qwen3's norm_topk_prob,
    DeepSeek-V3)."""
    moe_routed_scaling: float = 1.0
    """Multiplier of the routed experts' weights (DeepSeek-V3: 2.5)."""
    moe_router_groups: int = 0
    """Group-limited routing (DeepSeek-V3: 8): the experts split into this many equal
    groups of consecutive experts, and each token picks its top-k only among its
    moe_router_group_top_k best groups, a group scored by the sum of its two best
    choice scores (bias included); 0 = no groups."""
    moe_router_group_top_k: int = 0
    """Groups a token's experts may come from (DeepSeek-V3: 4); needs moe_router_groups."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss (Switch/GShard): coeff * E * sum_e f_e * P_e per microbatch, f_e the
    share of the token-choices routed to expert e and P_e its mean router probability; 0 =
    off (e.g. 0.01)."""
    moe_z_loss_coeff: float = 0.0
    """Router z-loss (ST-MoE): coeff * mean(logsumexp(logits)^2), keeping the logits small;
    0 = off (e.g. 0.001)."""
    moe_bias_update_rate: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores for
    the choice only, moved by this rate after each step towards the mean load (bias_e +=
    rate * sign(mean load - load_e), loads over the global batch); 0 = off (e.g. 0.001)."""
    moe_shared_experts: int = 0
    """Shared experts every token goes through besides its routed ones (DeepSeek-V3 1),
    built as one MLP of width moe_shared_ffn_hidden_size."""
    moe_shared_ffn_hidden_size: int = 0
    """Width of the shared experts' MLP; 0 = moe_shared_experts * the routed expert width."""
    moe_first_dense_layers: int = 0
    """Leading layers that keep a dense MLP (DeepSeek-V3: 3)."""
    moe_layer_freq: int = 1
    """After the first dense layers, every this-many-th layer is MoE (1 = all of them)."""
    moe_capacity_factor: float = 0.0
    """0 = dropless (every token-choice is computed); >= 1 caps each expert at
    ceil(factor * tokens * top_k / num_experts) token-choices per microbatch and layer,
    keeping the highest-weighted (ties: the earlier token) and dropping the rest, which then
    pass through the residual alone."""
    mtp_depth: int = 0
    """Multi-token prediction (DeepSeek-V3: 1; `ptdp.model.mtp`): modules after the last
    layer, module k predicting the token k + 1 positions ahead from module k - 1's hidden
    state and the embedding of the token k positions ahead, each with one transformer
    layer (dense or MoE as the last layer) and the shared output layer; 0 = off. Training
    only: evaluation and generation ignore them."""
    mtp_loss_weight: float = 0.1
    """The step's loss adds this times the mean of the depths' losses (DeepSeek-V3: 0.3 for
    its first 10T tokens, then 0.1)."""

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_heads

    @property
    def is_mla(self) -> bool:
        return self.attention is AttentionKind.MLA

    @property
    def qk_head_dim(self) -> int:
        """Width of one query (and key) head: nope + rope features under mla."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Features of a head that rotary positions turn: the rope part under mla."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Rows of the embedding and output layer across tp ranks (see
        make_vocab_size_divisible_by)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    @property
    def moe_ffn_size(self) -> int:
        """Inner width of one routed expert."""
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def moe_shared_ffn_size(self) -> int:
        """Width of the shared experts' MLP (0 without shared experts)."""
        return self.moe_shared_ffn_hidden_size or self.moe_shared_experts * self.moe_ffn_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (global index) has a mixture-of-experts block for its MLP."""
        after = layer - self.moe_first_dense_layers
        return self.num_experts > 0 and after >= 0 and after % max(1, self.moe_layer_freq) == 0

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.activation is Activation.SWIGLU:
            return -(-(8 * self.hidden_size // 3) // 64) * 64
        return 4 * self.hidden_size


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """How the model and each batch are split over the ranks (tensor, context, pipeline and
    data parallelism) and what each rank keeps; checked against the number of processes
    before any process group starts."""

    tp: int = 1
    """Tensor-parallel size (ranks that split each layer)."""
    pp: int = 1
    """Pipeline-parallel size (ranks that split the layers into stages)."""
    dp: int = 0
    """Data-parallel size; 0 = world_size / (tp * cp * pp)."""
    cp: int = 1
    """Context-parallel size (ranks that split each sequence; 2*cp chunks, rank i holding
    chunks i and 2*cp-1-i so causal attention work is balanced)."""
    ep: int = 1
    """Expert-parallel size (mixture-of-experts models): each MoE layer's routed experts are
    split over ep ranks, tokens reaching their experts by one all-to-all; 1 = every rank
    holds every expert. The experts are laid out apart from attention ("parallel folding"):
    over one pipeline stage's tp * cp * dp ranks, etp fastest, then ep, then the expert
    data-parallel replicas (ep * etp divides tp * cp * dp, ep divides model.num_experts)."""
    etp: int = 1
    """Expert tensor-parallel size: ranks that split each routed expert's matrices (as tp
    splits the dense MLP's), taken from the same ranks as attention's, fastest first; 1 =
    every expert whole on its rank. parallel.etp = parallel.tp with ep over dp * cp is the
    layout of experts split like the dense layers."""
    cp_comm: CpComm = CpComm.RING
    """How attention sees the other ranks' keys and values under cp > 1: ring (blocks rotated
    point to point, overlapped with compute) or allgather (gathered once per layer)."""
    vpp: int = 1
    """Model chunks per pipeline rank: >= 2 for the interleaved schedule, 2 for zb-v and
    dualpipev (taken when not given), 1 for the others."""
    pipeline_layers: tuple[int, ...] = ()
    """Layers of each virtual stage in stage order, pp * vpp entries summing to
    model.num_layers (e.g. 3,4,4,3 on the command line or [3, 4, 4, 3] in TOML, to give the
    stages holding the embedding and the loss one layer fewer); the first and the last entry
    may be 0 (a stage of the embedding alone, one of the final norm, output layer and loss
    alone: 0,7,7,0), every other is at least 1; empty = an even split."""
    schedule: Schedule = Schedule.ONE_F_ONE_B
    """Pipeline schedule: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v (vpp = 2) or dualpipev
    (vpp = 2, at least 2 * pp microbatches: DeepSeek's DualPipeV, whose steady state pairs a
    forward with a backward)."""
    moe_overlap: bool = False
    """Mixture-of-experts models only, with pp = 1 or schedule 1f1b or dualpipev: pair each
    steady-state forward with the backward of an earlier microbatch (1f1b then runs twice its
    warm-up forwards, 2 (pp - rank) microbatches in flight) and issue the expert-parallel
    dispatch all-to-all asynchronously, overlapped with the shared experts' compute (in
    forward, and its gradient's in backward). Exact: the same losses and gradients."""
    sequence_parallel: bool = False
    """Split norm/dropout activations along the sequence over the tensor group."""
    recompute: Recompute = Recompute.NONE
    """Activation recomputation: none, selective (attention core) or full (whole layer)."""
    scatter_gather: bool = True
    """Pipeline sends of 1/tp of each boundary tensor, all-gathered by the receiver (tp > 1)."""
    bucket_mb: float = 25.0
    """Size of a data-parallel gradient bucket in MiB of fp32 gradient."""
    overlap_grad_reduce: bool = True
    """Start each bucket's data-parallel reduction during the last backward, not after it."""
    zero: int = -1
    """Sharding of the model state over the data-parallel group (ZeRO level): 0 = none
    (replicated), 1 = fp32 master weights and AdamW moments, 2 = also the gradients
    (reduce-scattered per microbatch, full buffers freed after), 3 = also the parameters
    (all-gathered per layer just before use, the next layer's gather prefetched); -1 = from
    optim.distributed (1 if true, else 0)."""
    zero3_reshard_after_forward: bool = True
    """ZeRO-3: free a layer's gathered parameters after its forward and gather them again
    for its backward (false: keep them from forward to backward, one gather per microbatch
    instead of two, for more memory; under pipelining every microbatch in flight holds
    them)."""
    zero3_fp8_all_gather: bool = False
    """ZeRO-3 with train.precision = fp8 (tensorwise): all-gather the linear layers' weights
    as float8 bytes (1 byte an element instead of 2) with their scales (taken once per step,
    one small all-reduce), and run their GEMMs on the gathered float8 weights; the 16-bit
    full weights are then never allocated. The same float8 operands as without it (the
    training differs at most by float32 rounding: other bucket cuts, another order of the
    gradient norm's sums)."""


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Where the training tokens come from (one preprocessed dataset or a weighted blend) and
    how a training window is read."""

    path: str = ""
    """Prefix of a preprocessed dataset (PREFIX.bin / PREFIX.idx), from `ptdp preprocess`."""
    paths: tuple[str, ...] = ()
    """A weighted blend instead of data.path, weights and prefixes alternating (Megatron's
    spelling): ["0.7", "a/prefix", "0.3", "b/prefix"] in TOML, 0.7,a/prefix,0.3,b/prefix on
    the command line. Weights are normalised; the datasets must share one tokenizer. Set in a
    later place than data.path (the command line over --config), it replaces it, and the
    other way round."""
    tokenizer: str = ""
    """Tokenizer for generation and checks: bytes, a tokenizer.json or a Hugging Face model
    directory; empty = the data's own."""
    valid_fraction: float = 0.05
    """Fraction of the token stream (at its end) held out for validation."""
    document_mask: bool = False
    """Attend only within each document of a packed training window; documents as the
    dataset's .idx records them (each ends with its end-of-document token under `ptdp
    preprocess`)."""
    reset_positions: bool = False
    """With document_mask: positions restart at 0 at each document's first token."""


@dataclass(kw_only=True, frozen=True)
class OptimConfig:
    """AdamW and its learning rate: linear warm-up to lr, then cosine decay to min_lr."""

    lr: float = 3e-4
    """Peak learning rate, reached after warm-up."""
    min_lr: float = 3e-5
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 100
    """Steps of linear warm-up from 0 to lr."""
    decay_steps: int = 0
    """Steps of warm-up plus cosine decay; 0 = train.steps."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not norms, biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 = no clipping."""
    distributed: bool = False
    """Old spelling of parallel.zero = 1: shard fp32 master weights and AdamW state over the
    data-parallel group. Implied by parallel.zero >= 1."""
    initial_loss_scale: float = 65536.0
    """fp16 only: the first dynamic loss scale."""
    loss_scale_window: int = 1000
    """fp16 only: double the loss scale after this many steps without inf/NaN gradients."""


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """The training loop: batch sizes, steps, precision, logging, validation, and saving and
    keeping checkpoints."""

    micro_batch_size: int = 8
    """Samples per microbatch on one data-parallel rank."""
    global_batch_size: int = 8
    """Samples per optimizer step over all ranks = micro_batch_size * microbatches * dp."""
    steps: int = 1000
    """Optimizer steps to train."""
    seed: int = 1234
    """Seed of the weights, the data order and dropout; weights do not depend on the layout."""
    run_dir: str = "runs/default"
    """Directory for config.toml, metrics.jsonl, checkpoints and TensorBoard files."""
    log_interval: int = 10
    """Log a line and a metrics.jsonl entry every this many steps."""
    eval_interval: int = 100
    """Validation loss every this many steps (and at the end); 0 = never."""
    eval_iters: int = 10
    """Microbatches averaged for one validation loss (shared out over data-parallel ranks)."""
    save_interval: int = 0
    """Checkpoint every this many steps (and at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept on disk; 0 = keep all."""
    async_save: bool = False
    """Write checkpoints in a background thread while training continues."""
    precision: Precision = Precision.FP32
    """fp32; bf16 (16-bit weights and compute, fp32 master weights and gradient
    accumulation); fp16 (the same with dynamic loss scaling); fp8 (bf16, with the
    column- and row-parallel linears', the experts' and the output layer's GEMMs in float8
    through torchao: pip install torchao; MFU is still logged against the dense bf16 peak)."""
    fp8_recipe: Fp8Recipe = Fp8Recipe.TENSORWISE
    """precision = fp8 only: how torchao scales each GEMM operand into float8: tensorwise
    (one scale per tensor, torchao's default recipe) or rowwise (one scale per row, powers of
    2); each rank scales its own shard."""
    device: str = "auto"
    """cpu, cuda, or auto (cuda when available)."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard events under run_dir/tensorboard."""
    wandb_project: str = ""
    """Also log the metrics to this Weights & Biases project (needs pip install wandb;
    WANDB_MODE=offline works); empty = off."""
    wandb_run_name: str = ""
    """Name of the Weights & Biases run; empty = wandb picks one."""
    peak_tflops: float = 0.0
    """Dense peak TFLOP/s of one device at the run's precision, for the logged MFU; 0 = look
    the GPU up by name (ptdp/perf/cost/flops.py), none on a CPU."""
    progress: bool = True
    """Show a progress bar (on an interactive terminal)."""
    profile_timeline: bool = False
    """Write the last step's per-rank timeline (timeline.json for Perfetto, timeline.png)
    beside its prediction."""
    resume: Resume = Resume.AUTO
    """Continue from the newest complete checkpoint in run_dir: auto (when the launcher
    restarted the job: torchrun --max-restarts, a SLURM requeue; a first launch continues
    only with --resume), always (as --resume), never (a run_dir holding a previous run is
    refused, as a first launch without --resume is)."""
    overwrite: bool = False
    """A new run (not resuming) in a run_dir that holds a previous run's files (config.toml,
    metrics.jsonl, events.jsonl, checkpoints, TensorBoard and timeline files): delete them
    first and start afresh; false = such a run_dir is refused (--resume continues it)."""
    on_nan: OnNan = OnNan.STOP
    """A step with a non-finite loss or gradient norm (not an fp16 overflow): stop (save the
    last good step, the bad update not applied, and end with an error naming it), skip
    (leave the step out), or rollback (reload the last checkpoint and skip the batches
    since it, the bad one included), or retry (replay the step from memory, which needs
    train.recovery = in_process; one that repeats falls back to the restart path)."""
    recovery: Recovery = Recovery.RESTART
    """What a fault every process survives costs (an exception on one rank, a collective
    timeout or communication error, a non-finite step under on_nan = retry): restart (the
    processes exit; the launcher restarts them from the last checkpoint) or in_process
    (the ranks agree through the launcher's store, re-create their process groups and
    replay the step from memory; ptdp/train/faults/recovery.py; not with async_save).
    restart is the default, after measuring (docs/in-process-recovery.md): in_process recovers
    only a fault before the optimizer update, waits a collective timeout for the blocked
    ranks, and a dead rank still needs the restart. Under in_process a silent (frozen)
    rank is failed only after the second timeout, 2 x collective_timeout_s (restart:
    after a quarter of it): one continued within it rejoins and the step is replayed."""
    collective_timeout_s: float = 300.0
    """Seconds a collective or pipeline receive may wait; a rank that dies or hangs is
    named and every other rank stops within this time (ptdp/train/faults/watchdog.py)."""
    straggler_factor: float = 0.0
    """Log where every rank is when a step runs longer than this multiple of the median
    step time (e.g. 3); 0 = off. Multi-process runs only."""
    compile: bool = False
    """Compile each transformer layer and the loss with torch.compile (fused bias+GeLU,
    bias+dropout+residual and softmax kernels); the first steps are slower while it
    compiles. With parallel.tp > 1 it needs torch 2.13 or newer (2.11's compiled
    tensor-parallel backward gives wrong gradients). In an MoE layer the routing's dispatch,
    the experts' products and the all-to-alls run eager between compiled graphs."""
    cuda_graphs: bool = False
    """With train.compile on a CUDA device: capture each compiled region in CUDA graphs
    (torch.compile's mode "reduce-overhead"), so a small model's step pays one launch per
    region instead of one per kernel. Static steps only: no pipeline or context
    parallelism, no MoE, no ZeRO-3."""
    attention_backend: AttentionBackend = AttentionBackend.AUTO
    """The attention kernel tried first: auto (on CUDA, time flash, cudnn and efficient
    once on the model's shape and keep the fastest that runs; elsewhere PyTorch's own
    choice), flash, cudnn, efficient or math (the reference); a call it refuses (a mask,
    a dtype) takes the next kernel that accepts it."""


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Which weights a run starts from and how checkpoint files are written; when to save
    and how many to keep is set under [train] (save_interval, keep_checkpoints,
    async_save)."""

    init_from: str = ""
    """Start from these weights: a ptdp run or step directory (any layout) or a Hugging
    Face model directory (config.json + safetensors); fresh optimizer, step 0, data from
    the start; the model settings come from it. A run that already has checkpoints
    continues from its own with --resume instead. Empty = a fresh initialisation."""
    writer_threads: int = 2
    """Threads per rank writing a checkpoint's files, each its own file
    (`__<rank>_<i>.distcp`), checksummed as written. On a 2-core VM one rank saved 1.28x
    faster with 2 than with 1, and within 4% of 4 (BENCHMARKS.md, "Checkpoint bandwidth and
    async save"); more may help on a parallel file system or several NVMe drives."""


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(RunConfig)}  # type: ignore[misc]
