"""Regional compilation: each transformer layer compiled with `torch.compile` (train.compile).

Only the layers are compiled, not the whole model: every layer of a model runs the same
code on the same shapes, so Dynamo traces one layer and reuses its graph for the others
(the parameters are graph inputs), and compile time does not grow with depth. The loss
(`GPT.loss`: final norm, output layer, vocabulary padding slice or mask, float32 upcast and
cross-entropy) is a second region: uncompiled, each of those steps writes a [s, b, v]
tensor, which on a GPU can take as long as the output layer's matrix product for
GPT-2-sized models. The embedding and the pipeline runtime stay eager, so schedules,
point-to-point transfers and gradient hooks are untouched.

What Inductor fuses inside a layer: the bias add of each linear layer with the GeLU (or
the SwiGLU product), the residual-branch bias + dropout + residual add, layer norm with
its neighbours, and the reshapes around attention; attention itself stays
`scaled_dot_product_attention` with `is_causal=True` (flash kernels on GPUs, no mask).

Tensor parallelism: the layer's collectives (`ptdp.parallel.comm`, autograd functions
around `dist.all_reduce` / `all_gather`) are traced by Dynamo as functional collectives,
so a tensor-parallel layer is still one graph, forward and backward; tests/dist checks
tp = 2 against the eager single-process model.

Mixture-of-experts layers (`ptdp.model.moe`): what depends on the routing's values runs
eager, each a `torch.compiler.disable` function that Dynamo calls between graphs instead of
tracing: `plan_dispatch` (bincounts and sorts of the token-choices; a capacity cut's kept
rows are data-sized), the experts' products (`ptdp.parallel.wgrad.grouped_linear`: the loop
reads the counts on the host, the grouped kernel's padded layout is sized by them, and a
zero-bubble W may take their weight gradients), the dispatch and combine
(`ptdp.model.dispatch.dispatch_combine`: the rows' gather and weighted scatter-add by the
plan's indices, expert parallelism's exchange of counts and all-to-alls with split sizes
on the host; under moe_overlap the shared experts too, which run inside it while the rows
travel) and `MoE._balance` (the step's figures in `MoEState`, a Python side effect, and a
scale that changes with the fp16 loss scale). The router, the shared experts and the rest
of the layer are compiled: a few graphs per layer, the same for every layer. A
capacity cut keeps a number of rows that varies between microbatches; the graphs after the
dispatch take it as a size Dynamo may make dynamic (its automatic dynamic shapes).

Numerics: the compiled layer computes the same function; on CPU float32 the losses agree
with eager to float32 rounding (reductions may be ordered differently). Dropout draws its
masks from Inductor's own random stream, so with dropout > 0 a compiled run's masks differ
from an eager run's (same distribution); equivalence checks use dropout = 0. Under tensor
parallelism with dropout > 0, the per-rank random stream of the split regions
(`ptdp.parallel.init.rank_rng`, which reads a seed with `.item()`) breaks the layer's graph
into several smaller ones: still correct (the ranks keep identical replicated masks), with
fewer fusions.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def compile_mode(cuda_graphs: bool) -> str | None:
    """torch.compile's mode: "reduce-overhead" records each region's kernels in a CUDA
    graph (PyTorch's cudagraph trees) and replays it with one launch (train.cuda_graphs);
    the default mode launches each fused kernel from Python."""
    return "reduce-overhead" if cuda_graphs else None


def apply_compile(chunks: Iterable[nn.Module], *, cuda_graphs: bool = False) -> int:
    """Compile each transformer layer of `chunks`, and the loss of the chunk that has the
    output layer, in place (lazily: on the first call); returns the number of layers.
    Parameter names and the state dict are unchanged. `cuda_graphs`: CUDA devices only
    (`ptdp.rules.speed` refuses the rest before this runs)."""
    mode = compile_mode(cuda_graphs)
    count = 0
    for chunk in chunks:
        for layer in chunk.layers.values():
            layer.compile(mode=mode)
            count += 1
        if chunk.has_head:
            chunk.loss = torch.compile(chunk.loss, mode=mode)
    return count


def mark_step(cuda_graphs: bool) -> None:
    """Before a microbatch's forward under CUDA graphs: a new replay may reuse the memory
    of the previous one's outputs (consumed by its backward by then)."""
    if cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()
