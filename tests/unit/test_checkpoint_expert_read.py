"""Expert-split tensors are read by slice (ptdp/checkpoint/sharded.py): at ep = 2 a rank's
DCP read items for an expert tensor cover only its own experts, half the tensor, and what
it loads is exactly its rows (also with the experts' tensor split over etp)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ptdp.checkpoint.keys import MODEL
from ptdp.checkpoint.sharded import load_plan, unpack
from ptdp.checkpoint.store import load_entries
from ptdp.parallel.init import ExpertSplit, ShardSpec
from ptdp.parallel.roles import NO_ROLES


class _Experts(nn.Module):
    """One grouped expert weight [e_local, f_local, h] carrying its expert and tensor split."""

    def __init__(self, split: ExpertSplit, spec: ShardSpec | None, shape: tuple[int, ...]):
        super().__init__()
        self.roles = NO_ROLES
        self.w = nn.Parameter(torch.zeros(shape))
        self.w.ep_split = split
        if spec is not None:
            self.w.tp_shard = spec


def _read_items(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every read item the file-system reader is asked for, recorded."""
    seen: list = []
    original = dcp.FileSystemReader.read_data

    def read_data(self, plan, planner):
        seen.extend(plan.items)
        return original(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", read_data)
    return seen


@pytest.mark.parametrize("etp", [1, 2])
def test_expert_tensor_read_is_this_ranks_experts_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, etp: int
) -> None:
    full = torch.arange(4 * 6 * 3, dtype=torch.float32).view(4, 6, 3)  # 4 experts
    dcp.save({MODEL + "w": full}, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    metadata = dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata
    seen = _read_items(monkeypatch)
    for ep_rank in (0, 1):
        for etp_rank in range(etp):
            seen.clear()
            split = ExpertSplit(num_experts=4, size=2, rank=ep_rank, etp_rank=etp_rank)
            spec = ShardSpec(dim=1, full_size=6, padded_size=6, size=etp) if etp > 1 else None
            chunk = _Experts(split, spec, (2, 6 // etp, 3))
            state, plan = load_plan([chunk], metadata, None, tp_rank=0)
            load_entries(tmp_path, state)
            elements = sum(math.prod(item.lengths) for item in seen)
            assert elements == full.numel() // 2  # half the tensor: its 2 experts of 4
            assert all(item.dest_offsets[0] == 0 for item in seen)
            assert {item.storage_offsets[0] for item in seen} == {2 * ep_rank}
            masters, _ = unpack(plan, tp_rank=0)
            want = full[2 * ep_rank : 2 * ep_rank + 2]
            if etp > 1:
                want = want.chunk(etp, dim=1)[etp_rank]
            assert torch.equal(masters[chunk.w], want)
