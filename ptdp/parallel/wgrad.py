"""Deferred weight gradients: the real B/W split of zero-bubble pipelines (Qi et al. 2023,
arXiv 2401.10241).

Shapes: n = tokens of a microbatch (s * b flattened), k = input features, m = output
features of a linear layer Y = X W^T + b.

The backward of a linear layer is two GEMMs: dX = dY W (needed at once by the previous
layer, and by the previous pipeline stage) and dW = dY^T X (needed only by the optimizer
step). A zero-bubble schedule runs the first in its B action and the second in a later
W action. `linear` below is `F.linear` whose weight-gradient GEMM a `WeightGradStore` can
put off: during a split backward (`WeightGradStore.deferring`) it keeps (X, dY) instead of
computing dW, and `flush` computes the kept GEMMs later. Everything else of the backward
(norms, biases, embeddings, attention) runs in B as usual, so W walks no graph.
`grouped_linear` is the same for a mixture-of-experts layer's experts: weights [e, m, k],
each expert's rows of X times its own matrix, the weight gradients one grouped product at
W (`ptdp.parallel.grouped`).

What a store changes is opted into per microbatch: only a forward run under `capture`
(or recomputed under `deferring`) uses the deferrable function; any other forward is the
plain `F.linear`, so a backward that is not split is autograd's own, bit for bit. Under
`torch.compile` the plain `F.linear` is used too (Dynamo would have to trace the stash, a
Python side effect in backward): compiled layers compute their weight gradients in B.
With float8 GEMMs (precision = fp8, `ptdp.parallel.fp8`) every forward goes through
`_Fp8Linear`, deferrable or not, and a deferred W GEMM runs in float8 too (torchao's own
function under `torch.compile`); the experts' `grouped_linear` likewise
(`ptdp.parallel.fp8_grouped`). `grouped_linear` always runs eager, compiled layer or not
(its shapes are the routing's), so its weight gradients stay deferrable under compile.

No global state: each model chunk owns its store and hands it to its layers; the pipeline
runtime receives the same stores. The store keeps a plain attribute, not a thread-local,
because autograd runs a GPU backward on its own device thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from ptdp.parallel.fp8_grouped import (
    choose_fp8_gemm,
    fp8_grouped_grad_input,
    fp8_grouped_mm,
    fp8_grouped_wgrad,
)
from ptdp.parallel.grouped import GemmKernel, choose_gemm, grouped_mm, grouped_wgrad

if TYPE_CHECKING:  # torchao is optional: only an fp8 run imports ptdp.parallel.fp8
    from ptdp.parallel.fp8 import Fp8Gemms


class Kept(NamedTuple):
    """One weight-gradient GEMM put off: param's gradient is dy^T x."""

    param: torch.Tensor
    x: torch.Tensor
    """[n, k]"""
    dy: torch.Tensor
    """[n, m]"""
    counts: torch.Tensor | None = None
    """Rows per expert of a grouped weight [e, m, k] (`grouped_linear`); None: [m, k]."""
    fp8: Fp8Gemms | None = None
    """The float8 recipe the GEMM runs in (precision = fp8); None: the operands' dtype."""


class WeightGradStore:
    """Weight-gradient GEMMs put off by split backwards, keyed by microbatch (any key)."""

    def __init__(self) -> None:
        self._capturing = False
        self._key: Hashable | None = None
        self._pending: dict[Hashable, list[Kept]] = {}

    @property
    def active(self) -> bool:
        """Whether a linear layer run now must be the deferrable one."""
        return self._capturing or self._key is not None

    @property
    def deferring_key(self) -> Hashable | None:
        return self._key

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Forward of a microbatch whose backward will be split (B then W)."""
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    @contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """A B action: the backward run inside keeps its weight-gradient GEMMs under `key`.
        A recomputed forward (activation checkpointing) inside is deferrable too."""
        self._key = key
        try:
            yield
        finally:
            self._key = None

    def put(
        self,
        param: torch.Tensor,
        x: torch.Tensor,
        dy: torch.Tensor,
        counts: torch.Tensor | None = None,
        fp8: Fp8Gemms | None = None,
    ) -> None:
        """Keep x [n, k] and dy [n, m] for param [m, k] (or [e, m, k] with each expert's
        rows `counts`) under the current key; `fp8`: the GEMM runs in float8."""
        self._pending.setdefault(self._key, []).append(Kept(param, x, dy, counts, fp8))

    def flush(self, key: Hashable) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The W action: compute the GEMMs kept under `key`, in the order B produced them;
        returns (parameter, gradient) pairs, each gradient in the parameter's dtype, as
        autograd would accumulate it (the GEMM runs in the forward's compute dtype)."""
        grads = []
        for param, x, dy, counts, fp8 in self._pending.pop(key, []):
            if counts is not None and fp8 is not None:
                grad = fp8_grouped_wgrad(fp8, dy, x, counts)
            elif counts is not None:
                grad = grouped_wgrad(dy, x, counts)
            else:
                grad = dy.t().mm(x) if fp8 is None else fp8.grad_weight(dy, x)
            grads.append((param, grad.to(param.dtype)))
        return grads

    def keys(self) -> list[Hashable]:
        """Keys (microbatches) with GEMMs still kept, in the order their B ran."""
        return list(self._pending)

    def __len__(self) -> int:
        """Microbatches with GEMMs still kept."""
        return len(self._pending)


def accumulate_grads(grads: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Add each gradient into its (leaf) parameter's `.grad` through autograd itself, so that
    everything hooked on the accumulation (`register_post_accumulate_grad_hook`: the
    data-parallel buffers) runs exactly as after a fused backward. Gradients of the same
    parameter (a tied embedding) are summed first: one accumulation per parameter."""
    summed: dict[torch.Tensor, torch.Tensor] = {}
    for param, grad in grads:
        summed[param] = summed[param] + grad if param in summed else grad
    if summed:
        torch.autograd.backward(list(summed), list(summed.values()))


class _DeferrableLinear(torch.autograd.Function):
    """Y = X W^T + b; backward: dX = dY W and db now, dW = dY^T X now or kept in the store."""

    @staticmethod
    def forward(ctx, x, weight, bias, param, store):
        ctx.save_for_backward(x, weight)
        (ctx.param,) = param  # in a tuple: not an autograd input of its own
        ctx.store, ctx.has_bias = store, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])  # [n, m]
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])  # [n, k]
            if ctx.store.deferring_key is not None:
                ctx.store.put(ctx.param, x2, dy2)
            else:  # not a split backward: the GEMM now
                dw = dy2.t().mm(x2)
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        # dW flows to `weight` (a cast copy under autocast, else `param` itself).
        return dx, dw, db, None, None


class _Fp8Linear(torch.autograd.Function):
    """`_DeferrableLinear` with its three GEMMs in float8 (`ptdp.parallel.fp8`): the
    operands are kept in their own dtype and cast by each GEMM, dW's at W if deferred."""

    @staticmethod
    def forward(ctx, x, weight, bias, param, store, fp8):
        ctx.save_for_backward(x, weight)
        (ctx.param,) = param
        ctx.store, ctx.fp8, ctx.has_bias = store, fp8, bias is not None
        # ZeRO-3's fp8 all-gather (`ptdp.parallel.zero3_fp8`): the gathered float8 weight,
        # whose bytes stay valid through the unit's backward (gathered again for it); the
        # 16-bit weight is then never allocated and must not be read.
        ctx.w8 = getattr(ctx.param, "fp8_weight", None)
        y = fp8.forward(x.reshape(-1, x.shape[-1]), weight, ctx.w8)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        fp8, store = ctx.fp8, ctx.store
        dy2 = dy.reshape(-1, dy.shape[-1])  # [n, m]
        dx = None
        if ctx.needs_input_grad[0]:
            dx = fp8.grad_input(dy2, weight, ctx.w8).reshape(*dy.shape[:-1], weight.shape[-1])
        dw = None
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])  # [n, k]
            if store is not None and store.deferring_key is not None:
                store.put(ctx.param, x2, dy2, fp8=fp8)
            else:
                dw = fp8.grad_weight(dy2, x2)
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    store: WeightGradStore | None = None,
    fp8: Fp8Gemms | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, whose weight gradient `store` may defer (see module doc),
    with its GEMMs in float8 when `fp8` is given (always through this module's function,
    deferrable or not; torchao's own under torch.compile).

    `weight` must be a leaf (a parameter): a deferred gradient is accumulated into it.
    Under autocast the operands are cast here as autocast would cast them, and the
    function runs with autocast off, so it computes in the same dtype as `F.linear` would.
    """
    compiling = torch.compiler.is_compiling()
    if fp8 is None and (store is None or not store.active or compiling):
        return F.linear(x, weight, bias)
    param, device = weight, x.device.type
    autocast = torch.is_autocast_enabled(device)
    if autocast:
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
        if fp8 is None:
            return _DeferrableLinear.apply(x, weight, bias, (param,), store)
        if compiling:
            y = fp8.compiled(x, weight)
            return y if bias is None else y + bias
        store = store if store is not None and store.active else None
        return _Fp8Linear.apply(x, weight, bias, (param,), store, fp8)


class _DeferrableGroupedLinear(torch.autograd.Function):
    """Y_i = X_i W_i^T per expert i; backward: dX now, dW now or kept in the store. The
    kernel chosen in forward (`choose_gemm`, or `choose_fp8_gemm` in float8) runs the
    backward's products too; `fp8`: all three GEMMs in float8 (`ptdp.parallel.fp8_grouped`)."""

    @staticmethod
    def forward(ctx, x, weight, counts, param, store, kernel, fp8):
        ctx.save_for_backward(x, weight, counts)
        (ctx.param,) = param
        ctx.store, ctx.kernel, ctx.fp8 = store, kernel, fp8
        if fp8 is not None:
            return fp8_grouped_mm(fp8, x, weight, counts, kernel)
        return grouped_mm(x, weight.transpose(1, 2), counts, kernel)

    @staticmethod
    def backward(ctx, dy):
        x, weight, counts = ctx.saved_tensors
        fp8, kernel = ctx.fp8, ctx.kernel
        dx = dw = None
        if ctx.needs_input_grad[0]:
            if fp8 is not None:
                dx = fp8_grouped_grad_input(fp8, dy, weight, counts, kernel)
            else:
                dx = grouped_mm(dy, weight, counts, kernel)
        if ctx.needs_input_grad[1]:
            store = ctx.store
            if store is not None and store.deferring_key is not None:
                store.put(ctx.param, x, dy, counts, fp8)
            elif fp8 is not None:
                dw = fp8_grouped_wgrad(fp8, dy, x, counts, kernel)
            else:
                dw = grouped_wgrad(dy, x, counts, kernel)
        return dx, dw, None, None, None, None, None


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: torch.Tensor,
    store: WeightGradStore | None = None,
    kernel: GemmKernel | None = None,
    fp8: Fp8Gemms | None = None,
) -> torch.Tensor:
    """x [n, k], rows grouped by expert (`counts` [e] each), times each expert's
    weight [e, m, k] transposed -> [n, m]: the experts' `linear`, whose weight gradient
    `store` may defer to W as `linear`'s is, with its GEMMs in float8 when `fp8` is given
    (a deferred W too). Computed in the autocast dtype under autocast, as `linear` is.
    `weight` must be a leaf (a parameter). Under torch.compile it runs eager (a graph
    break, `torch.compiler.disable`): the counts are data, the loop reads them on the host
    and the grouped kernel's padded layout is sized by them."""
    return _grouped_linear(x, weight, counts, store, kernel, fp8)


@torch.compiler.disable
def _grouped_linear(x, weight, counts, store, kernel, fp8):
    param, device = weight, x.device.type
    store = store if store is not None and store.active else None
    autocast = torch.is_autocast_enabled(device)
    if autocast:
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
    with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
        if kernel is None:
            kernel = (
                choose_gemm(x, weight) if fp8 is None else choose_fp8_gemm(fp8.recipe, x, weight)
            )
        return _DeferrableGroupedLinear.apply(x, weight, counts, (param,), store, kernel, fp8)
