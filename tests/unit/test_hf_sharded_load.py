"""Loading Hugging Face weights by region: every rank's slices equal those cut from the
whole converted state, and the reader never reads more than the slice (ptdp/checkpoint/
lazy.py, ptdp/parallel/init.py `read_local`, ptdp/convert/hf_files.py `HfWeights`)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ptdp.checkpoint.full import local_model_state
from ptdp.checkpoint.keys import named_parameters
from ptdp.checkpoint.lazy import Held, Joined, Narrowed, Stacked, Stored, Transposed, whole
from ptdp.convert.hf import from_hf_state, hf_sources, read_hf_weights
from ptdp.convert.hf_files import HfWeights, read_hf_config
from ptdp.errors import CheckpointError
from ptdp.model.gpt import GPT
from ptdp.parallel.comm import Group
from ptdp.parallel.init import ExpertSplit, ShardSpec, local_part, read_local
from ptdp.parallel.roles import rank_roles
from tests.helpers import save_tiny_hf

pytest.importorskip("transformers", reason="needs transformers (pip install .[hf])")

FAMILIES = ("gpt2", "llama", "qwen2", "mixtral", "qwen3_moe")
"""GPT-2's Conv1D layout, untied and tied embeddings (Qwen2), per-expert modules."""
LAYOUTS = {  # name: (tp, ep, etp, stage of pp = 2 or None)
    "tp2": (2, 1, 2, None),
    "pp2-first": (1, 1, 1, 0),
    "pp2-last": (1, 1, 1, 1),
    "tp2-pp2-last": (2, 1, 2, 1),
    "ep2": (1, 2, 1, None),
    "ep2-etp2": (2, 2, 2, None),
    "ep2-folded": (2, 2, 1, 0),
}


def _region_numel(region: tuple[slice, ...]) -> int:
    return math.prod(s.stop - s.start for s in region)


def _count_reads(monkeypatch) -> list[int]:
    """The elements of every region read from the files, as they are read."""
    reads: list[int] = []
    stored_read = Stored.read

    def read(self: Stored, region: tuple[slice, ...]) -> torch.Tensor:
        reads.append(_region_numel(region))
        return stored_read(self, region)

    monkeypatch.setattr(Stored, "read", read)
    return reads


def _chunk(cfg, tp: int, ep: int, etp: int, stage: int | None, rank: int) -> GPT:
    """One rank's model of a layout, built alone (no collective runs at construction)."""
    groups = {"tp": Group(None, tp, rank % tp), "ep": Group(None, ep, rank % ep)}
    groups["etp"] = Group(None, etp, rank % etp)
    kwargs = {}
    if stage is not None:
        half = cfg.num_layers // 2
        layers = range(0, half) if stage == 0 else range(half, cfg.num_layers)
        kwargs = {"layers": layers, "has_embedding": stage == 0, "has_head": stage == 1}
    moe = {"ep": groups["ep"], "etp": groups["etp"]} if cfg.num_experts else {}
    return GPT(cfg, tp=groups["tp"], **moe, **kwargs)


@pytest.fixture(scope="module", params=FAMILIES)
def hf_dir(request, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    save_tiny_hf(directory, request.param, positions=32)
    return directory


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_its_own_slices(hf_dir: Path, layout: str, rank: int, monkeypatch) -> None:
    cfg = replace(read_hf_config(hf_dir), seq_length=32)
    tp, ep, etp, stage = LAYOUTS[layout]
    if ep > 1 and not cfg.num_experts:
        pytest.skip("expert parallelism needs experts")
    chunk = _chunk(cfg, tp, ep, etp, stage, rank)
    tp_group = Group(None, tp, rank % tp)
    expected = local_model_state([chunk], from_hf_state(cfg, read_hf_weights(hf_dir)), tp_group)

    reads = _count_reads(monkeypatch)
    with HfWeights(hf_dir) as weights:
        sources = hf_sources(cfg, weights.tensors)
        loaded = local_model_state([chunk], sources, tp_group)
        params = dict(named_parameters([chunk]))
        for name, p in params.items():
            assert torch.equal(loaded[p], expected[p]), name
            assert loaded[p].shape == p.shape, name
        # Per tensor, the reader reads each element of the rank's slice once, nothing more.
        roles = rank_roles([chunk])
        for name, p in params.items():
            reads.clear()
            read_local(sources[roles.original(name)].read, p, tp_group.rank)
            assert max(reads) <= p.numel(), name
            assert sum(reads) <= p.numel(), name
            unpadded = p.numel() if "embedding" not in name and "output" not in name else None
            if unpadded is not None:
                assert sum(reads) == unpadded, name


def test_the_whole_model_is_read_once_in_one_process(tmp_path: Path, monkeypatch) -> None:
    save_tiny_hf(tmp_path, "mixtral", positions=32)
    cfg = replace(read_hf_config(tmp_path), seq_length=32)
    held = sum(t.shape.numel() for t in read_hf_weights(tmp_path).values())
    reads = _count_reads(monkeypatch)
    with HfWeights(tmp_path) as weights:
        local_model_state([GPT(cfg)], hf_sources(cfg, weights.tensors), Group.single())
    assert sum(reads) == held  # every stored element once, no tensor read twice


@pytest.mark.parametrize(
    "spec",
    [
        ShardSpec(0, 12, 12, 2),
        ShardSpec(1, 12, 12, 3),
        ShardSpec(0, 12, 12, 2, parts=2),  # SwiGLU's [gate; up]
        ShardSpec(0, 10, 12, 4),  # a padded vocabulary
        ShardSpec(0, 5, 8, 4),  # the last rank holds padding only
    ],
)
@pytest.mark.parametrize("experts", [None, 2])
def test_read_local_equals_local_part(spec: ShardSpec, experts: int | None) -> None:
    base = (spec.full_size, 6) if spec.dim == 0 else (6, spec.full_size)
    shape = (4, *base) if experts else base
    full = torch.randn(shape)
    for rank in range(spec.size):
        local_shape = list(shape)
        dim = spec.dim + (1 if experts else 0)
        local_shape[dim] = spec.local_size
        for ep_rank in range(experts or 1):
            if experts:
                local_shape[0] = 4 // experts
            param = torch.empty(local_shape)
            param.tp_shard = replace(spec, dim=dim)
            if experts:
                param.ep_split = ExpertSplit(4, experts, ep_rank, etp_rank=rank)
            reads: list[tuple[slice, ...]] = []

            def read(region, reads=reads):
                reads.append(region)
                return full[region]

            got = read_local(read, param, rank)
            assert torch.equal(got, local_part(full, param, rank))
            assert sum(_region_numel(r) for r in reads) <= param.numel()


def test_lazy_expressions_read_regions_of_what_they_describe() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(4, 6, generator=gen) for _ in range(3))
    cases = {
        "joined": (Joined((Held(a), Held(b))), torch.cat([a, b])),
        "joined dim 1": (Joined((Held(a), Held(b)), dim=1), torch.cat([a, b], 1)),
        "narrowed": (Narrowed(Held(c), 1, 2, 3), c[:, 2:5]),
        "transposed": (Transposed(Held(a)), a.t()),
        "stacked": (Stacked((Held(a), Held(b), Held(c))), torch.stack([a, b, c])),
        "nested": (
            Stacked(
                (Joined((Narrowed(Held(a), 0, 1, 2), Held(b))), Joined((Held(c[:2]), Held(a))))
            ),
            torch.stack([torch.cat([a[1:3], b]), torch.cat([c[:2], a])]),
        ),
    }
    for name, (lazy, want) in cases.items():
        assert lazy.shape == tuple(want.shape), name
        assert torch.equal(lazy.full(), want), name
        for _ in range(20):
            region = []
            for n in want.shape:
                lo = int(torch.randint(0, n, (1,), generator=gen))
                hi = int(torch.randint(lo + 1, n + 1, (1,), generator=gen))
                region.append(slice(lo, hi))
            assert torch.equal(lazy.read(tuple(region)), want[tuple(region)]), (name, region)
        assert lazy.read(whole(want.shape)).shape == want.shape


def test_index_naming_a_tensor_twice_or_elsewhere_is_refused(tmp_path: Path) -> None:
    import json

    from safetensors.torch import save_file

    one, two = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({"a": torch.zeros(2), "b": torch.zeros(2)}, tmp_path / one)
    save_file({"b": torch.ones(2)}, tmp_path / two)
    index = {"weight_map": {"a": one, "b": two}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'b' is held by two files"):
        HfWeights(tmp_path)
    save_file({"a": torch.zeros(2)}, tmp_path / one)
    index["weight_map"]["a"] = two
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="places tensor 'a' in model-00002.*no file holds"):
        HfWeights(tmp_path)
    save_file({"a": torch.zeros(2), "z": torch.zeros(2)}, tmp_path / one)
    index["weight_map"]["z"] = one  # file one is read, and holds 'a' too
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="places tensor 'a' in model-00002.*but it is in"):
        HfWeights(tmp_path)
    save_file({"a": torch.zeros(2)}, tmp_path / one)
    del index["weight_map"]["z"]
    index["weight_map"]["c"] = "model-00003-of-00002.safetensors"
    index["weight_map"]["a"] = one
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00003-of-00002.safetensors is missing"):
        HfWeights(tmp_path)
