"""What train.attention_backend = math and train.cuda_graphs keep in memory beyond the
tensors of the unfused core and the graphed regions (`ptdp.perf.cost.memory` adds them).

Apart from `ptdp.perf.cost.switches`, which prices the switches' time through the
`Software` profile and refuses what cannot run: bytes here, time and rules there.
"""

from __future__ import annotations

from ptdp.config.enums import AttentionBackend, Recompute
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.perf.cost.parameters import attention_width, element_bytes

LABEL_BYTES = 8
"""Bytes per label token (int64), an input of the loss's graph."""


def math_attention(cfg: RunConfig) -> bool:
    """The run asks for PyTorch's reference (unfused) attention."""
    return cfg.train.attention_backend is AttentionBackend.MATH


def math_copies_bytes(cfg: RunConfig, model: ModelConfig, tp: int) -> float:
    """Per layer and microbatch, what eager PyTorch's math attention keeps beyond the unfused
    core's tensors: q and k scaled by d^-1/4, two new [s, b, a d / t] copies (measured on CPU,
    `activations.ptdp_terms`). Compiled layers let Inductor's partitioner choose what to keep
    (not measured: not counted); recomputation of the core (selective, full) keeps neither."""
    if not math_attention(cfg) or cfg.train.compile or cfg.parallel.recompute is not Recompute.NONE:
        return 0.0
    e = element_bytes(cfg.train.precision)
    return 2.0 * e * model.seq_length * cfg.train.micro_batch_size * attention_width(model) / tp


def graph_input_bytes(cfg: RunConfig, model: ModelConfig, tp: int) -> float:
    """Under CUDA graphs, the inputs PyTorch's cudagraph trees copy into their private pool:
    an input that is neither a parameter nor the output of an earlier graph of the tree is
    copied to a buffer of the pool at every replay (torch/_inductor/cudagraph_trees.py,
    `_allocate_and_copy_recording_inputs`). In ptdp's step that is the first layer's input,
    the eager embedding's output ([s, b, h], split over t under sequence parallelism), and the
    loss's labels ([b, s] int64); every other layer's input and every saved tensor is an
    earlier graph's output, in the pool already. One microbatch at a time (pp = 1)."""
    if not cfg.train.cuda_graphs:
        return 0.0
    b, s = cfg.train.micro_batch_size, model.seq_length
    shard = tp if cfg.parallel.sequence_parallel else 1
    hidden = element_bytes(cfg.train.precision) * s * b * model.hidden_size / shard
    return hidden + LABEL_BYTES * s * b
