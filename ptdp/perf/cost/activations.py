"""Activation memory of one transformer layer: the paper's formula and what we store.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198), Section 4, count the bytes a GPT layer keeps for backward
with 16-bit activations and 1-byte dropout masks:

    no parallelism                 s b h (34 + 5 a s / h)
    tensor parallel                s b h (10 + 24/t + 5 a s / (h t))
    tensor + sequence parallel     s b h (34/t + 5 a s / (h t))
    tensor + selective recompute   s b h (10 + 24/t)
    tensor + sequence + selective  s b h 34/t
    full recompute                 2 s b h

built from attention 11 s b h + 5 a s^2 b, MLP 19 s b h and two layer norms 4 s b h.
`paper_terms` lists those components one by one (generalised to other element sizes,
no dropout and other MLP widths) and `activation_bytes_per_layer` sums them.

`ptdp_terms` is the same list for what PyTorch actually keeps in our GPT-2 layer
(`ptdp.model.gpt.TransformerLayer`, t = 1), where the kernels depart from the paper's
assumptions (`Kernels`): on CPU a dropout mask has the masked tensor's dtype, not one
byte; LayerNorm keeps its mean and 1/std; the math attention kernel keeps scaled copies
of q and k (and, on CPU, computes 16-bit inputs in fp32); fused (flash / memory-efficient)
attention keeps its output and a logsumexp instead of any s x s tensor.
`record_saved_tensors` measures what autograd saves, so the two can be compared.

Letters: s = sequence, b = micro-batch, h = hidden, a = heads, f = MLP width (4h),
t = tensor-parallel size, e = bytes per activation element.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ptdp.config.enums import Recompute

if TYPE_CHECKING:  # the formulas are pure Python; only the measurement needs torch
    import torch
    from torch import nn


@dataclass(frozen=True)
class Term:
    """One stored tensor (or group of equal tensors) of a layer's forward."""

    key: str
    """Stable name shared by `paper_terms` and `ptdp_terms`, to line them up."""
    what: str
    """Human description."""
    elements: float
    bytes_per_element: float
    core: bool = False
    """Inside the attention core (q, k, v -> context), so dropped by selective recompute."""

    @property
    def bytes(self) -> float:
        return self.elements * self.bytes_per_element


def _mode(recompute: Recompute | str) -> Recompute:
    return Recompute(recompute)  # Recompute is a str enum: accepts "none" and Recompute.NONE


def paper_terms(
    *,
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: Recompute | str = "none",
    bytes_per_element: float = 2,
    dropout: bool = True,
    ffn_hidden: int | None = None,
    norm_input_bytes: float | None = None,
    attention_width: int | None = None,
    kv_width: int | None = None,
    value_width: int | None = None,
    latent_width: int = 0,
) -> list[Term]:
    """Korthikanti et al.'s per-layer components (Section 4.1-4.2), one Term each.

    Tensors inside the tensor-parallel regions (Q, K, V, scores, projection input, MLP
    inner activations) are split over t; the rest (layer-norm inputs, the inputs of the
    QKV and fc1 linears, residual dropout masks) are replicated unless sequence parallel.
    Without dropout there are no masks and the softmax output is the only s x s tensor
    (the score-times-V product reads it directly). Full recompute keeps the layer input,
    split over t under sequence parallelism (the paper's table gives 2sbh, without SP).
    `norm_input_bytes` (default: the activations' size) is what a norm's saved input costs
    per element: 4 under CUDA autocast, which runs the norms in fp32 and keeps the fp32 copy.
    `attention_width` (default h): the heads' a d, the width of Q, K, V and the projection
    input where model.head_size sets the heads apart from h; `kv_width` (default the same):
    K's and V's, grouped-query attention's groups x d where its kernel keeps them ungrouped.
    `value_width` (default: V as K, the projection input as Q): V's and the projection
    input's, multi-head latent attention's a dv; `latent_width`: its latents' features per
    token (the down-projections' and their norms' outputs), kept as the replicated tensors
    are. The latent terms are ptdp's estimate, not measured.
    """
    s, b, h, a, t, e = seq, micro_batch, hidden, heads, tp, bytes_per_element
    norm = e if norm_input_bytes is None else norm_input_bytes
    f = 4 * h if ffn_hidden is None else ffn_hidden
    rep = t if sequence_parallel else 1  # divisor of the "replicated" tensors
    n, scores, inner = s * b * h, a * s * s * b, s * b * f
    heads_n = n if attention_width is None else s * b * attention_width
    kv_n = heads_n if kv_width is None else s * b * kv_width
    v_n = kv_n if value_width is None else s * b * value_width
    out_n = heads_n if value_width is None else v_n
    mode = _mode(recompute)
    if mode is Recompute.FULL:
        return [Term("input", "layer input", n / rep, e)]
    terms = [
        Term("norm_inputs", "LayerNorm 1 and 2 inputs", 2 * n / rep, norm),
        Term("qkv_input", "QKV linear input", n / rep, e),
        Term("qkv", "Q, K (QK^T inputs) and V", (heads_n + kv_n + v_n) / t, e),
        Term("proj_input", "attention output projection input", out_n / t, e),
        Term("fc1_input", "fc1 input", n / rep, e),
        Term("gelu_input", "GeLU input (fc1 output)", inner / t, e),
        Term("fc2_input", "fc2 input (GeLU output)", inner / t, e),
    ]
    if latent_width:
        latents = s * b * latent_width / rep
        terms.append(Term("latents", "MLA's latents and their norms' outputs", latents, e))
    if dropout:
        terms += [
            Term("attn_mask", "attention residual dropout mask", n / rep, 1),
            Term("mlp_mask", "MLP residual dropout mask", n / rep, 1),
        ]
    if mode is Recompute.NONE:
        terms.append(Term("softmax", "softmax output", scores / t, e, core=True))
        if dropout:
            terms += [
                Term("score_mask", "attention-probability dropout mask", scores / t, 1, True),
                Term("score_dropout", "dropout output (times V input)", scores / t, e, True),
            ]
    return terms


def activation_bytes_per_layer(
    *,
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: Recompute | str = "none",
    bytes_per_element: float = 2,
    dropout: bool = True,
    ffn_hidden: int | None = None,
    norm_input_bytes: float | None = None,
    attention_width: int | None = None,
    kv_width: int | None = None,
    value_width: int | None = None,
    latent_width: int = 0,
) -> float:
    """Bytes one layer keeps for backward, after Korthikanti et al. 2022 (arXiv 2205.05198).

    With the defaults (16-bit, dropout, f = 4h) this is exactly the paper's table, e.g.
    s b h (34 + 5 a s / h) for t = 1 and no recomputation; `bytes_per_element` = 4 gives
    fp32 activations (masks stay 1 byte), `dropout=False` drops the masks and the dropout
    output, `ffn_hidden` sets the MLP width and `attention_width` the heads' a d (default
    h; `value_width` and `latent_width`: `paper_terms`). `recompute` is "none",
    "selective" (drop the attention core's s x s tensors) or "full" (keep only the layer
    input).
    """
    terms = paper_terms(
        seq=seq,
        micro_batch=micro_batch,
        hidden=hidden,
        heads=heads,
        tp=tp,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        bytes_per_element=bytes_per_element,
        dropout=dropout,
        ffn_hidden=ffn_hidden,
        norm_input_bytes=norm_input_bytes,
        attention_width=attention_width,
        kv_width=kv_width,
        value_width=value_width,
        latent_width=latent_width,
    )
    return sum(term.bytes for term in terms)


# --------------------------------------------------------------------------- our layer


@dataclass(frozen=True)
class Kernels:
    """Where PyTorch's kernels store differently from the paper's assumptions."""

    fused_attention: bool = False
    """Flash / memory-efficient SDPA: keeps its output and an fp32 logsumexp [b, a, s]
    rather than s x s tensors (on CPU only without dropout; the math kernel otherwise)."""
    mask_bytes: float | None = 1
    """Bytes per dropout-mask element: 1 is the paper's assumption and CUDA's native_dropout
    bool mask; None = the masked tensor's own element size (CPU's dropout multiplies by a
    mask of the input dtype)."""
    norm_stat_bytes: float = 4
    """Element size of LayerNorm's saved mean and 1/std ([s, b] each)."""
    attention_bytes: float | None = None
    """Element size the math SDPA kernel computes in; None = the activations'. On CPU it
    upcasts 16-bit inputs to fp32."""

    @classmethod
    def cpu(cls, bytes_per_element: float, *, fused_attention: bool) -> Kernels:
        """PyTorch's CPU kernels (measured with torch 2.13)."""
        return cls(
            fused_attention=fused_attention,
            mask_bytes=None,
            norm_stat_bytes=bytes_per_element,
            attention_bytes=4,
        )


def ptdp_terms(
    *,
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    kernels: Kernels,
    recompute: Recompute | str = "none",
    bytes_per_element: float = 4,
    dropout: bool = True,
    ffn_hidden: int | None = None,
) -> list[Term]:
    """What autograd keeps for our GPT-2 layer (LayerNorm, tanh GeLU, multi-head attention,
    t = 1), term by term; `record_saved_tensors` measures the same bytes.

    Departures from `paper_terms`: LayerNorm mean and 1/std (2 x 2 s b elements); masks of
    `kernels.mask_bytes`; q, k, v are views of the QKV linear's output, so whichever of them
    is kept holds that whole [s, b, 3h] buffer; the math kernel keeps q and k scaled by
    1/sqrt(sqrt(d)) (two new copies) and, computing in fp32 on CPU, fp32 copies of them and
    v; a fused kernel keeps the attention output (the projection's input, one storage) and
    a logsumexp. Selective recompute keeps q, k, v as checkpoint inputs (the paper's Q, K,
    V) and drops everything else of the core; full recompute keeps only the layer input.
    """
    s, b, h, a, e = seq, micro_batch, hidden, heads, bytes_per_element
    f = 4 * h if ffn_hidden is None else ffn_hidden
    n, scores, inner = s * b * h, a * s * s * b, s * b * f
    mode = _mode(recompute)
    if mode is Recompute.FULL:
        return [Term("input", "layer input (the checkpoint's only saved tensor)", n, e)]
    mask = e if kernels.mask_bytes is None else kernels.mask_bytes
    terms = [
        Term("norm_inputs", "LayerNorm 1 and 2 inputs", 2 * n, e),
        Term(
            "norm_stats",
            "LayerNorm mean and 1/std (paper: omitted)",
            4 * s * b,
            kernels.norm_stat_bytes,
        ),
        Term("qkv_input", "QKV linear input", n, e),
        Term("proj_input", "projection input", n, e),
        Term("fc1_input", "fc1 input", n, e),
        Term("gelu_input", "GeLU input (tanh GeLU saves only its input)", inner, e),
        Term("fc2_input", "fc2 input (GeLU output)", inner, e),
    ]
    if dropout:
        terms += [
            Term("attn_mask", "attention residual dropout mask", n, mask),
            Term("mlp_mask", "MLP residual dropout mask", n, mask),
        ]
    if mode is Recompute.SELECTIVE:
        return terms + [
            Term("qkv", "q, k, v: checkpoint inputs, views of the QKV output", 3 * n, e)
        ]
    if kernels.fused_attention:
        return terms + [
            Term("qkv", "q, k, v: views of the QKV output", 3 * n, e),
            # The kernel's output is also saved, but it is the projection input's storage.
            Term("lse", "logsumexp (fp32) instead of s x s tensors", a * s * b, 4, True),
        ]
    c = e if kernels.attention_bytes is None else kernels.attention_bytes
    core_mask = c if kernels.mask_bytes is None else kernels.mask_bytes
    if c == e:  # v is a view: the whole QKV output stays alive
        terms.append(Term("qkv", "QKV output, kept whole by the saved view v", 3 * n, e))
    else:  # computed in another precision: the QKV output is freed, a copy of v is kept
        terms.append(Term("qkv", f"v cast to {c}-byte elements", n, c))
    terms += [
        Term("qk_scaled", "q, k scaled by d^-1/4: copies made by the math kernel", 2 * n, c, True),
        Term("softmax", "softmax output", scores, c, True),
    ]
    if dropout:
        terms += [
            Term("score_mask", "attention-probability dropout mask", scores, core_mask, True),
            Term("score_dropout", "dropout output (times V input)", scores, c, True),
        ]
    return terms


# --------------------------------------------------------------------------- measurement


@dataclass(frozen=True)
class Saved:
    """One tensor autograd saved for backward during a forward."""

    where: str
    """Submodule path that saved it ("" = the module itself); "(checkpoint input)" marks
    tensors that torch.utils.checkpoint keeps to recompute its region."""
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    """Bytes of its storage, or 0 when that storage was already counted (a view of an
    earlier saved tensor) or holds a parameter, a buffer or a copy of a parameter (weights
    are not activations)."""


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


def _inside_checkpoint() -> bool:
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        frame = frame.f_back
    return False


def _is_weight_copy(tensor: torch.Tensor, params: set[int]) -> bool:
    """A tensor computed from one parameter alone (autocast's 16-bit weight copy, or a
    view of it): walk back through single-input autograd nodes to a parameter's leaf."""
    node = tensor.grad_fn
    for _ in range(8):
        if node is None:
            return False
        inputs = [fn for fn, _ in node.next_functions if fn is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf
            return id(node.variable) in params
    return False


def record_saved_tensors(
    module: nn.Module, *args: object, forward: Callable[..., object] | None = None
) -> tuple[object, list[Saved]]:
    """Run `forward(*args)` (default `module(*args)`) and list what autograd saves.

    Uses `torch.autograd.graph.saved_tensors_hooks`. Storages are counted once, so views
    (q, k, v of one QKV output) are not counted twice, and the storages of the module's
    parameters and buffers, and copies of a parameter (autocast's 16-bit weights), are not
    counted at all. Tensors saved inside a non-reentrant checkpoint region go to the
    checkpoint's own hooks, which drop them, so they are not seen here; the checkpoint's
    inputs are. Empty tensors hold nothing and are not listed. Submodule paths come from
    forward hooks, so the labels are only as fine as the modules. Returns (output, records);
    the saved tensors live until backward runs on the output (or the output is dropped).
    """
    import torch

    params = {id(p) for p in module.parameters()}
    weights = {t.untyped_storage().data_ptr() for t in module.parameters()}
    weights |= {t.untyped_storage().data_ptr() for t in module.buffers()}
    counted: set[int] = set()
    path: list[str] = []
    records: list[Saved] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == 0:  # holds nothing (torch 2.11's checkpoint saves one)
            return tensor
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in counted and _is_weight_copy(tensor, params):
            weights.add(ptr)
        new = ptr not in weights and ptr not in counted
        counted.add(ptr)
        where = path[-1] if path else ""
        if _inside_checkpoint():
            where = f"{where} (checkpoint input)".lstrip()
        dtype = str(tensor.dtype).removeprefix("torch.")
        records.append(Saved(where, tuple(tensor.shape), dtype, storage.nbytes() if new else 0))
        return tensor

    def enter(name: str) -> Callable[..., None]:
        return lambda *_: path.append(name)

    def leave(*_: object) -> None:  # returns None: a forward hook's result replaces the output
        path.pop()

    handles = []
    for name, sub in module.named_modules():
        handles.append(sub.register_forward_pre_hook(enter(name)))
        handles.append(sub.register_forward_hook(leave, always_call=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = (forward or module)(*args)
    finally:
        for handle in handles:
            handle.remove()
    return out, records


def measure_saved_activation_bytes(module: nn.Module, *args: object) -> int:
    """Bytes of activations autograd keeps for the backward of `module(*args)`."""
    _, records = record_saved_tensors(module, *args)
    return sum(r.nbytes for r in records)
