"""The memory-bound kernels of one transformer layer pass, each priced at its own measured
bandwidth.

A device calibrated by `ptdp calibrate` carries each memory-bound kernel's achieved
bandwidth over the bytes one call moves, from inside the caches to past them
(`Device.memory_kernels`). There a layer's norms, activation, residual adds and the copies
around attention are priced one by one from the bytes each call moves, instead of as
`Software.elementwise_traffic` times the bytes the layer stores, at one typical bandwidth.
Why: on the 2-core CPU of BENCHMARKS.md the kernels' rates past the caches differ 20 to 40-fold
(GeLU's tanh is compute-bound there, an add streams); priced at the median past the
caches, the memory-bound term of that benchmark's layers came to 3.3-4.1 times the sum of
its kernels each at its own rate, and the one-process steps were predicted up to 30% slow.
On a CPU each rate is timed one call at a time between the other kernels
(`ptdp.perf.calibrate.timing.in_context_seconds`), as a step runs them: timed back to back, a small
kernel keeps its tensors in the core's private caches and ran 2-8 times faster on the Xeon
of BENCHMARKS.md than between other kernels, and the one-process steps there were
predicted 13-31% fast. Devices whose file has no such table (the built-in GPU files) keep
the single term of costs.py.

What one layer runs per microbatch on one rank (ptdp/model/gpt.py, as a profile of its
steps shows), with n tokens, n' = n / t under sequence parallelism, h hidden, q the QKV
width / t (queries a d wide, keys and values g d), f the MLP width / t, e bytes per
element; a read or a write of x elements is x:

forward   2 norms                  n'h in, n'h out                       norm
          2 residual adds          2 n'h in, n'h out                     add
          2 bias adds (with bias)  after the row-parallel linears        add
          bias broadcasts          the column-parallel linears' (addmm) outputs written: n q, n f
          2 copies of n h/t        q to heads, the attention output back add
          activation               GeLU n f in and out; SwiGLU: SiLU on n f, product 3 n f
          2 dropouts (p > 0)       n'h in, n'h out, a byte mask          add
          q/k norms (qk_norm)      n a d/t and n g d/t in and out        norm
backward  2 norms                  input and gradient in, gradient out   norm backward
          2 residual gradient adds 3 n'h                                 add
          activation               GeLU 3 n f; SwiGLU: SiLU 3 n f, product 2 x 3 n f
          the 2 copies back        2 n h/t each                          add
          q, k, v gradients        autograd's slice backward: 3 zero fills of n q, the three
                                   slices copied in (2 n q), 2 adds of 3 n q   add
          2 dropouts (p > 0)       gradient and mask in, gradient out    add
          q/k norms (qk_norm)      input and gradient in, gradient out   norm backward
          bias gradients           a sum over tokens of each linear's output gradient

With the unfused attention core (`train.attention_backend = math`) also its mask, softmax
and dropout on the s x s scores (`core_calls`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.config.enums import Activation, Normalization
from ptdp.config.sections import ModelConfig
from ptdp.perf.cost.hardware import Device
from ptdp.perf.cost.parameters import attention_width, value_width


@dataclass(frozen=True)
class Call:
    """`count` calls of memory-bound `kernel` (a `ptdp calibrate` name), each moving `nbytes`."""

    kernel: str
    nbytes: float
    count: int = 1

    def seconds(self, device: Device) -> float:
        return self.count * self.nbytes / device.kernel_bandwidth(self.kernel, self.nbytes)


def layer_calls(
    model: ModelConfig, *, micro_batch: int, tp: int, sequence_parallel: bool, e: int,
    unfused: bool = False,
) -> tuple[list[Call], list[Call]]:  # fmt: skip
    """(forward, backward) memory-bound calls of one layer, one microbatch, one rank;
    `unfused`: with the unfused attention core's (`core_calls`)."""
    n = micro_batch * model.seq_length
    local = n // tp if sequence_parallel else n  # tokens of the norms, adds and dropouts
    h, t = model.hidden_size, tp
    x = local * h * e  # one [n', h] tensor
    q = attention_width(model)
    kv = model.query_groups * model.head_dim
    heads = n * q // t * e  # q, or the attention output
    qkv = n * (2 * q + value_width(model) if model.is_mla else q + 2 * kv) // t * e
    f = n * model.ffn_size // t * e
    norm = "rms_norm" if model.normalization is Normalization.RMSNORM else "layer_norm"
    forward = [Call(norm, 2 * x, 2), Call("add", 3 * x, 2), Call("add", 2 * heads, 2)]
    backward = [
        Call(f"{norm}_backward", 3 * x, 2),
        Call("add", 3 * x, 2),
        Call("add", 2 * heads, 2),
        Call("add", qkv, 3),  # zero fills
        Call("add", 2 * qkv / 3, 3),  # the slices copied in
        Call("add", 3 * qkv, 2),  # summed
    ]
    if model.qk_norm:  # each query and key head normalised over d
        keys = n * kv // t * e
        forward += [Call(norm, 2 * heads), Call(norm, 2 * keys)]
        backward += [Call(f"{norm}_backward", 3 * heads), Call(f"{norm}_backward", 3 * keys)]
    if model.is_mla:  # the latents' two RMSNorms, on the rank's tokens
        latents = local * (model.q_lora_rank + model.kv_lora_rank) * e
        forward.append(Call("rms_norm", 2 * latents))
        backward.append(Call("rms_norm_backward", 3 * latents))
    if model.activation is Activation.SWIGLU:
        forward += [Call("silu", 2 * f), Call("add", 3 * f)]
        backward += [Call("silu_backward", 3 * f), Call("add", 3 * f, 2)]
    else:
        forward.append(Call("gelu", 2 * f))
        backward.append(Call("gelu_backward", 3 * f))
    if model.dropout > 0:
        mask = x / e
        forward.append(Call("add", 2 * x + mask, 2))
        backward.append(Call("add", 2 * x + mask, 2))
    if model.bias:
        parts = 2 if model.activation is Activation.SWIGLU else 1
        forward.append(Call("add", 2 * x, 2))
        forward.append(Call("add", qkv + parts * f))  # addmm's bias broadcast into QKV, MLP in
        outputs = qkv + 2 * (n * h * e) + parts * f  # QKV, projection, MLP in and out
        backward.append(Call("add", outputs))
    if unfused:
        core_f, core_b = core_calls(model, micro_batch=micro_batch, tp=tp, e=e)
        forward, backward = forward + core_f, backward + core_b
    return forward, backward


def core_calls(
    model: ModelConfig, *, micro_batch: int, tp: int, e: int
) -> tuple[list[Call], list[Call]]:
    """(forward, backward) memory-bound calls of the unfused attention core (PyTorch's math
    kernel, `train.attention_backend = math`) on its [b, a/t, s, s] scores of S bytes: the
    causal mask written into them (S in, S out) and the softmax (S in, S out); backward the
    softmax's (output, gradient in, gradient out: 3 S); with dropout, its mask and output
    each way. The fused kernels keep all of it on chip."""
    scores = micro_batch * model.num_heads // tp * model.seq_length**2 * e
    forward = [Call("add", 2 * scores), Call("softmax", 2 * scores)]
    backward = [Call("softmax_backward", 3 * scores)]
    if model.dropout > 0:
        dropout = Call("add", 2 * scores + scores / e)
        forward, backward = forward + [dropout], backward + [dropout]
    return forward, backward


def layer_traffic(
    model: ModelConfig, *, micro_batch: int, tp: int, sequence_parallel: bool, e: int,
    device: Device, unfused: bool = False,
) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) seconds of one layer's memory-bound calls on `device`."""
    forward, backward = layer_calls(
        model, micro_batch=micro_batch, tp=tp, sequence_parallel=sequence_parallel, e=e,
        unfused=unfused,
    )  # fmt: skip
    return sum(c.seconds(device) for c in forward), sum(c.seconds(device) for c in backward)
