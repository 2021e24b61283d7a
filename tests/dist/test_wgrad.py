"""Deferred weight gradients under tensor parallelism (gloo, tp = 2, one spawn).

The split backward (B then W, `ptdp.parallel.wgrad`) against the fused one (BW) on each
rank's shards, for GPT chunks with and without the embedding and the output layer,
GPT-2 and Llama options, sequence parallelism off and on (the column-parallel layers keep
their all-gathered input), and full recomputation. The single-process cases are
tests/unit/test_wgrad.py.
"""

from __future__ import annotations

import pytest

from ptdp.config.enums import Recompute
from ptdp.parallel.mesh import MeshShape, ParallelMesh
from tests.dist.harness import run_ranks
from tests.helpers import LLAMA
from tests.split_backward import check_split_equals_fused

pytestmark = pytest.mark.dist


def _check_split(rank: int, world_size: int) -> None:
    tp = ParallelMesh.build(MeshShape(tp=world_size, dp=1, pp=1), rank).axis("tp")
    for options in ({}, LLAMA):
        for sp in (False, True):
            # The whole model (GPT-2: tied output weight), the last chunk (its own, padded,
            # vocabulary-parallel output layer), a middle one recomputed in B.
            check_split_equals_fused(options, "whole", Recompute.NONE, tp, sp)
            check_split_equals_fused(options, "last", Recompute.NONE, tp, sp)
            check_split_equals_fused(options, "middle", Recompute.FULL, tp, sp)


def test_split_backward_equals_fused_under_tensor_parallelism() -> None:
    run_ranks(_check_split, 2)
