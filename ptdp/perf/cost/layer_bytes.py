"""Bytes of one transformer layer and of the head (final norm, output layer and loss) per
microbatch: what each stores for backward, and what its backward holds at once.

The per-microbatch terms of the memory model (`ptdp.perf.cost.memory`, whose module doc
says what is counted and what was measured), apart from its walk over the pipeline ranks;
the cost model (`ptdp.perf.cost.costs`) prices its memory-bound kernels on the same bytes.

Letters: s = sequence, b = micro-batch, h = hidden, f = MLP width, v = vocabulary,
t = tensor-parallel size, n = s b tokens.
"""

from __future__ import annotations

from ptdp.config.enums import Activation, Precision, Recompute
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.perf.cost.activations import activation_bytes_per_layer
from ptdp.perf.cost.moe import expert_bytes
from ptdp.perf.cost.parameters import attention_width, element_bytes, value_width


def layer_activation_bytes(
    model: ModelConfig,
    *,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: Recompute = Recompute.NONE,
    precision: Precision = Precision.BF16,
    fused_attention: bool = True,
    autocast_norms: bool = False,
    moe: bool = False,
    native_gqa: bool = False,
    fused_swiglu: bool = False,
    etp: int | None = None,
    discards_outputs: bool = False,
) -> float:
    """Bytes one layer stores for backward per microbatch (Korthikanti et al.).

    SwiGLU's inner tensors (gate and up, silu's output and the product) count as a GeLU MLP
    of twice the width: 4f elements either way; `fused_swiglu` (`Software`): 3f, a fused
    function keeping only gate and up. `native_gqa` (`Software`): K and V kept at their
    groups' width, where ptdp keeps them repeated to every head. `autocast_norms`
    (`fp32_norm_inputs`): the two norms' inputs are kept as the fp32 copies CUDA autocast
    makes, 4 bytes where the paper has 2. `moe`: a mixture-of-experts layer: attention and
    the shared experts' MLP as a dense layer's (its MLP input: the router's and the
    dispatch's), plus what the routed experts on the rank keep (`moe.expert_bytes`, their
    split over `etp`: `ptdp.perf.cost.folding`). `discards_outputs` (`Software`): the two
    norms' outputs (the QKV linear's and the MLP's input) and the routed experts'
    activation output are recomputed in backward, not kept (Megatron-Core's
    output-discarding recomputation).
    """
    if fused_attention and recompute is Recompute.NONE:
        recompute = Recompute.SELECTIVE  # no s x s tensor is kept: the core recomputes
    extra, width = 0.0, model.ffn_size
    if moe:
        e = element_bytes(precision)
        kw = dict(micro_batch=micro_batch, recompute=recompute, e=e, tp=tp, etp=etp)
        extra = expert_bytes(
            model, fused_swiglu=fused_swiglu, discards_outputs=discards_outputs, **kw
        )
        width = model.moe_shared_ffn_size
    f = width * (2 if model.activation is Activation.SWIGLU else 1)
    if fused_swiglu and model.activation is Activation.SWIGLU and recompute is not Recompute.FULL:
        extra -= element_bytes(precision) * model.seq_length * micro_batch * width / tp
    kv = model.query_groups * model.head_dim if native_gqa else None
    if discards_outputs and recompute is not Recompute.FULL:
        shard = tp if sequence_parallel else 1
        extra -= (
            2
            * element_bytes(precision)
            * model.seq_length
            * micro_batch
            * model.hidden_size
            / shard
        )
    return extra + activation_bytes_per_layer(
        seq=model.seq_length,
        micro_batch=micro_batch,
        hidden=model.hidden_size,
        heads=model.num_heads,
        tp=tp,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        bytes_per_element=element_bytes(precision),
        dropout=model.dropout > 0,
        ffn_hidden=f,
        norm_input_bytes=_norm_input_bytes(precision, autocast_norms),
        attention_width=attention_width(model),
        kv_width=kv,
        value_width=value_width(model) if model.is_mla else None,
        latent_width=_latent_activations(model),
    )


def _latent_activations(model: ModelConfig) -> int:
    """Features per token MLA keeps of its latents: the queries' latent and its norm's
    output (2 q_lora), the keys' and values' latent with the rotary key (c + r) and the
    latent's norm output (c); 0 for multi-head attention."""
    if not model.is_mla:
        return 0
    return 2 * model.q_lora_rank + 2 * model.kv_lora_rank + model.qk_rope_head_dim


def fp32_norm_inputs(cfg: RunConfig) -> bool:
    """Eager 16-bit training: CUDA autocast runs LayerNorm and RMSNorm in fp32, so autograd
    keeps the fp32 copy of each norm's input (measured on an H100, BENCHMARKS.md: 36 bytes
    per s b h in a GPT-2 layer where the paper counts 32). Compiled layers keep their 16-bit
    tensors and recompute the casts in backward; CPU autocast keeps LayerNorm in 16 bits
    (there this counts 4 bytes per s b h too many)."""
    return not cfg.train.compile and element_bytes(cfg.train.precision) < 4


def _norm_input_bytes(precision: Precision, autocast: bool) -> float | None:
    return 4.0 if autocast and element_bytes(precision) < 4 else None


def head_activation_bytes(
    model: ModelConfig,
    *,
    micro_batch: int,
    tp: int = 1,
    precision: Precision = Precision.BF16,
    compiled: bool = False,
    autocast_norms: bool = False,
) -> float:
    """Last stage, per microbatch: final-norm and output-layer inputs, and what the loss's
    backward keeps per logit (`ptdp/parallel/loss.py`). At tp = 1 eager autograd keeps the
    fp32 log-probabilities of the unpadded vocabulary (the padding is sliced off), the
    compiled loss (`train.compile`) the padded logits in the model's precision, recomputing
    the softmax; at tp > 1 the vocabulary-parallel loss keeps its fp32 softmax slice.
    `autocast_norms`: the final norm's input is kept as its fp32 copy (`fp32_norm_inputs`)."""
    n = model.seq_length * micro_batch
    e = element_bytes(precision)
    norm = _norm_input_bytes(precision, autocast_norms) or e
    if tp > 1:
        logits = 4 * model.padded_vocab_size(tp) // tp
    elif compiled:
        logits = element_bytes(precision) * model.padded_vocab_size(tp)
    else:
        logits = 4 * model.vocab_size
    return (norm + e) * n * model.hidden_size + n * logits


def layer_backward_bytes(
    model: ModelConfig,
    *,
    micro_batch: int,
    tp: int = 1,
    precision: Precision = Precision.BF16,
    eager: bool = False,
    weight_gradient: bool = True,
) -> float:
    """Gradients alive at once inside one layer's backward, per microbatch (`cost.memory`):
    dY and dX [n, h], with the MLP's [n, f/t] output-of-activation and [n, parts f/t]
    input-of-activation gradients or attention's dQ, dK, dV and dO, whichever is larger;
    n = s b tokens. `eager`: autograd frees each node's saved tensors as it goes, so the
    peak is in fc2's backward, all of the layer still stored: dY [n, h], fc2's input
    gradient [n, parts f/t] and its weight's [h, f/t]; dX comes later, when the MLP's
    inner tensors are freed (measured on CPU ranks, BENCHMARKS.md). `weight_gradient` False:
    the GEMM accumulates into the gradient buffer itself (Megatron-Core), no [h, f/t] tensor."""
    h, t, e, q = model.hidden_size, tp, element_bytes(precision), attention_width(model)
    n, v = model.seq_length * micro_batch, value_width(model)
    kv = q + v if model.is_mla else 2 * model.query_groups * model.head_dim  # dK and dV
    parts = 2 if model.activation is Activation.SWIGLU else 1
    if eager:
        wgrad = h * model.ffn_size // t if weight_gradient else 0
        return e * (n * (h + parts * model.ffn_size // t) + wgrad)
    mlp = model.ffn_size * (1 + parts) // t
    attention = (q + kv + v) // t  # dQ, dK, dV and dO
    return e * n * (2 * h + max(mlp, attention))


def head_backward_bytes(
    model: ModelConfig,
    *,
    micro_batch: int,
    tp: int = 1,
    precision: Precision = Precision.BF16,
    compiled: bool = False,
) -> float:
    """What the loss's backward holds at its peak on the last stage, beside the head's
    stored activations (measured on an H100 and traced on CPU, BENCHMARKS.md):

    - eager, tp = 1: the fp32 gradients [s b, v] of the loss (nll) and of log_softmax, both
      alive in log_softmax's backward; later the 16-bit copy and its padded width, which
      is more only in fp32;
    - compiled, tp = 1: the loss writes the logits' gradient into the saved logits' own
      buffer, so only the output weight's 16-bit gradient [v, h] is new;
    - tp > 1 (the vocabulary-parallel loss): the fp32 gradient of the logits [s b, v/t] and
      its 16-bit copy (not measured).
    """
    n, e = model.seq_length * micro_batch, element_bytes(precision)
    padded = model.padded_vocab_size(tp)
    if tp > 1:
        return n * padded // tp * (4 + e)
    if compiled:
        return e * padded * model.hidden_size
    return max(8 * n * model.vocab_size, e * n * (model.vocab_size + padded))
