"""The PTD-P equivalence grid: every layout trains like one process.

Each layout below runs 3 fp32 optimizer steps of `ptdp.train.run.train` and must
match the single-process run of the same model: the logged losses, the global gradient
norms (clipping is active, so a wrong norm also changes the weights) and the final
parameters, all within 1e-5 relative. Layouts with the same world size share one spawn,
one after another, so the grid costs three spawns. Small gradient buckets (0.01 MiB)
make every chunk use several buckets, with padding under the distributed optimizer
(ZeRO-1) and several reductions per backward under ZeRO-2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from ptdp.config.sections import RunConfig
from ptdp.parallel.env import LaunchEnv
from ptdp.train.run import train
from tests.dist.harness import run_ranks
from tests.helpers import LLAMA, assert_same_run, tiny_config

pytestmark = pytest.mark.dist


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    schedule: str = "1f1b"
    sp: bool = False
    zero: int = 0
    recompute: str = "none"
    llama: bool = False
    keep: bool = False
    """ZeRO-3: parameters kept gathered from forward to backward."""
    cp: int = 1
    cp_comm: str = "ring"
    moe: str = ""
    """A key of MOE: the MLPs become mixture-of-experts blocks of that variant."""
    ep: int = 1
    """Expert parallelism: the experts split over ep of a stage's tp*cp*dp ranks."""
    etp: int = 1
    """Expert tensor parallelism: each expert split over etp ranks (1: whole, folded)."""
    layers: tuple[int, ...] = ()
    """parallel.pipeline_layers: each stage's layers (empty: an even split)."""
    fp8: bool = False
    """train.precision = fp8 (tensorwise), against one fp8 process (`FP8_GRID`)."""
    overlap: bool = False
    """parallel.moe_overlap: forwards paired with backwards, the dispatch all-to-all async."""
    fp8_norm_rtol: float = 0.01
    """fp8 layouts: the gradient norms' relative tolerance against one fp8 process."""

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        if self.cp > 1:
            parts.insert(1, f"cp{self.cp}" + (f"-{self.cp_comm}" if self.cp_comm != "ring" else ""))
        if self.pp > 1:
            parts += [self.schedule] + ([f"vpp{self.vpp}"] if self.vpp > 1 else [])
        parts += ["sp"] * self.sp + [f"zero{self.zero}"] * (self.zero > 0)
        parts += [f"rc-{self.recompute}"] * (self.recompute != "none") + ["llama"] * self.llama
        parts += ["keep"] * self.keep + [self.moe] * bool(self.moe)
        parts += [f"ep{self.ep}"] * (self.ep > 1) + [f"etp{self.etp}"] * (self.etp > 1)
        parts += [f"L{'-'.join(map(str, self.layers))}"] * bool(self.layers)
        return "-".join(parts + ["fp8"] * self.fp8 + ["overlap"] * self.overlap)


ROTARY_FAMILIES = {"qkv_bias": True, "sliding_window": 6}
"""The llama layouts also carry Qwen2's QKV-only bias (split with the heads) and Mistral's
sliding window (shorter than the 16-token sequence, so attention takes the masked path)."""

_MOE = {"num_experts": 4, "moe_top_k": 2, "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}
MOE = {
    "moe": _MOE,
    # DeepSeek-V3's options: sigmoid scores renormalised, a shared expert, the balancing bias
    # moved by the global batch's loads, a dense first layer, group-limited routing (each
    # token's two experts from the better of two groups).
    "moe-shared-bias": _MOE | {
        "moe_score_function": "sigmoid", "moe_renormalize": True, "moe_routed_scaling": 2.5,
        "moe_shared_experts": 1, "moe_bias_update_rate": 0.01, "moe_first_dense_layers": 1,
        "moe_router_groups": 2, "moe_router_group_top_k": 1,
    },
    # DeepSeek-V3 whole: those options under multi-head latent attention (llama layouts:
    # rotary, with their sliding window; no QKV bias, no key/value groups under MLA).
    "deepseek": _MOE | {
        "moe_score_function": "sigmoid", "moe_renormalize": True, "moe_routed_scaling": 2.5,
        "moe_shared_experts": 1, "moe_bias_update_rate": 0.01, "moe_first_dense_layers": 1,
        "moe_router_groups": 2, "moe_router_group_top_k": 1,
        "attention": "mla", "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 6,
        "qk_rope_head_dim": 4, "v_head_dim": 10, "qkv_bias": False, "num_query_groups": 0,
    },
    # DeepSeek-V3 with multi-token prediction: two depths after the last layer (MoE layers, as
    # the last), the shared embedding's copy on the last stage under pipelines.
    "deepseek-mtp": _MOE | {
        "moe_score_function": "sigmoid", "moe_renormalize": True, "moe_routed_scaling": 2.5,
        "moe_shared_experts": 1, "moe_bias_update_rate": 0.01, "moe_first_dense_layers": 1,
        "attention": "mla", "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 6,
        "qk_rope_head_dim": 4, "v_head_dim": 10, "qkv_bias": False, "num_query_groups": 0,
        "mtp_depth": 2, "mtp_loss_weight": 0.3,
    },
    # Latent attention of widths float8 can run (every linear's features per rank a multiple
    # of 16 at tp = 2), its experts too; each token to all 4 experts, so that float8's
    # rounding cannot flip a routing choice (one flip moves the gradient norm by ~5%).
    "deepseek-fp8": _MOE | {"moe_top_k": 4,
        "attention": "mla", "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16, "v_head_dim": 16, "qkv_bias": False, "num_query_groups": 0,
        "moe_ffn_hidden_size": 32,
    },
    # Capacity drops (per microbatch, so with dp the same samples drop the same choices),
    # every other layer MoE.
    "moe-capacity": _MOE | {"moe_capacity_factor": 1.0, "moe_layer_freq": 2},
}  # fmt: skip
"""Mixture-of-experts variants (model keys): 4 experts, 2 per token, every layout routes
every token as one process does (tests compare the per-step expert loads exactly)."""

I = "interleaved"
GRID = [
    # world 2
    Layout(dp=2, zero=1),
    Layout(dp=2, recompute="full", llama=True),
    Layout(tp=2, sp=True, recompute="selective"),
    Layout(tp=2, llama=True),
    Layout(pp=2),
    Layout(pp=2, vpp=2, schedule=I, recompute="full"),
    Layout(pp=2, schedule="zb-h1", recompute="selective", llama=True),
    Layout(pp=2, schedule="zb-h2", llama=True),
    Layout(pp=2, vpp=2, schedule="zb-v"),  # tied: embedding and output layer on rank 0
    Layout(dp=2, zero=2),
    Layout(dp=2, zero=3, recompute="full"),
    Layout(cp=2),
    Layout(cp=2, cp_comm="allgather", llama=True),
    Layout(cp=2, recompute="selective", llama=True),  # GQA, RoPE, a window across chunks
    # stages without layers: the embedding alone first, the norm, output layer and loss last
    Layout(pp=2, layers=(0, 8)),
    Layout(pp=2, vpp=2, schedule=I, layers=(0, 4, 4, 0), llama=True),
    Layout(pp=2, vpp=2, schedule="zb-v", layers=(0, 3, 5, 0)),  # both ends on rank 0, tied
    Layout(pp=2, vpp=2, schedule="dualpipev"),  # tied, in ZB-V's V; paired F and BW, B and W
    Layout(pp=2, vpp=2, schedule="dualpipev", layers=(0, 4, 4, 0), llama=True),
    # latent attention: heads split, latents gathered under sp, keys and values of two widths
    # across the cp ring or gathered, the down-projections' weight gradients put off to W
    Layout(tp=2, sp=True, recompute="selective", llama=True, moe="deepseek"),
    Layout(cp=2, llama=True, moe="deepseek"),
    Layout(cp=2, cp_comm="allgather", recompute="full", llama=True, moe="deepseek"),
    Layout(pp=2, schedule="zb-h1", llama=True, moe="deepseek"),
    Layout(dp=2, zero=1, llama=True, moe="deepseek", ep=2),
    # multi-token prediction: its layers split over tp, on the last stage (its copy of the
    # embedding summed with stage 0's), its experts over ep
    Layout(tp=2, sp=True, recompute="selective", llama=True, moe="deepseek-mtp"),
    Layout(pp=2, llama=True, moe="deepseek-mtp"),
    Layout(pp=2, vpp=2, schedule=I, recompute="full", llama=True, moe="deepseek-mtp"),
    Layout(dp=2, zero=3, llama=True, moe="deepseek-mtp", ep=2),
    Layout(dp=2, llama=True, moe="deepseek-fp8", ep=2),
    # world 4
    Layout(tp=2, dp=2, sp=True, zero=1),
    Layout(tp=2, dp=2, recompute="selective", llama=True),
    Layout(pp=2, dp=2, zero=1),
    Layout(pp=2, dp=2, vpp=2, schedule=I, zero=1, recompute="full"),
    Layout(pp=2, dp=2, schedule="zb-h1", zero=2, llama=True),  # ZeRO-2 under B/W split
    Layout(tp=2, pp=2, sp=True),
    Layout(tp=2, pp=2, vpp=2, schedule=I, recompute="selective"),
    Layout(tp=2, pp=2, schedule="zb-h1", sp=True, recompute="full", llama=True),
    Layout(pp=4),
    Layout(pp=4, vpp=2, schedule=I, llama=True),
    Layout(pp=4, schedule="zb-h1", recompute="selective"),
    Layout(pp=4, schedule="zb-h2", recompute="full"),
    Layout(pp=4, vpp=2, schedule="zb-v", recompute="selective"),
    Layout(pp=4, vpp=2, schedule="dualpipev", recompute="selective"),
    Layout(pp=2, dp=2, vpp=2, schedule="dualpipev", zero=1),
    Layout(pp=2, dp=2, vpp=2, schedule="zb-v", zero=1),
    Layout(tp=2, pp=2, vpp=2, schedule="zb-v", sp=True, llama=True),
    Layout(dp=4),
    Layout(dp=4, zero=1),
    Layout(dp=4, zero=2, recompute="full"),
    Layout(tp=2, dp=2, zero=2, sp=True),
    Layout(pp=2, dp=2, zero=2),  # tied embedding: a deferred bucket on both stages
    Layout(pp=2, dp=2, vpp=2, schedule=I, zero=2, recompute="selective"),
    Layout(dp=4, zero=3, llama=True),
    Layout(tp=2, dp=2, zero=3, sp=True, recompute="selective"),
    Layout(pp=2, dp=2, zero=3),  # tied embedding: a deferred bucket on both stages
    Layout(pp=2, dp=2, vpp=2, schedule=I, zero=3, keep=True),
    Layout(pp=2, dp=2, schedule="zb-h1", zero=3, recompute="full", llama=True),
    Layout(cp=4, recompute="full"),
    Layout(tp=2, cp=2, sp=True, llama=True),
    Layout(cp=2, pp=2),
    Layout(cp=2, pp=2, vpp=2, schedule=I, llama=True),
    Layout(cp=2, dp=2, zero=3),  # parameters and state sharded over the 4 replicas of dp*cp
    Layout(cp=2, pp=2, schedule="zb-h1", llama=True),
    Layout(cp=2, dp=2, zero=2, recompute="full"),
    Layout(tp=2, pp=2, sp=True, recompute="selective", layers=(8, 0)),
    Layout(pp=2, dp=2, vpp=2, schedule=I, zero=3, layers=(0, 4, 4, 0)),  # a unit of no layer
    Layout(cp=2, pp=2, schedule="zb-h1", layers=(0, 8), llama=True),
    # mixture of experts, world 2 and 4
    Layout(tp=2, sp=True, moe="moe"),
    Layout(tp=2, recompute="full", llama=True, moe="moe", etp=2),  # SwiGLU experts split as MLPs
    Layout(tp=2, sp=True, moe="moe", ep=2),  # folded: ep over the tensor ranks, experts whole
    Layout(pp=2, moe="moe"),
    Layout(pp=2, schedule="zb-h1", moe="moe"),  # expert weight gradients deferred to W
    Layout(dp=2, zero=1, moe="moe", ep=2),  # experts split over the 2 replicas
    Layout(dp=2, zero=3, recompute="selective", moe="moe"),
    Layout(cp=2, moe="moe"),  # the balancing loss over the whole sequence
    Layout(dp=2, moe="moe-shared-bias", ep=2),
    Layout(dp=2, moe="moe-capacity", ep=2),  # dropped before the all-to-all, as one process
    Layout(cp=2, moe="moe", ep=2),  # experts split over the context-parallel ranks
    Layout(dp=2, recompute="full", llama=True, moe="moe", ep=2),
    Layout(pp=2, vpp=2, schedule="zb-v", moe="moe-shared-bias"),
    Layout(tp=2, dp=2, sp=True, zero=1, moe="moe-shared-bias", ep=2),
    Layout(tp=2, pp=2, schedule="zb-h1", sp=True, llama=True, moe="moe-capacity", etp=2),
    Layout(tp=2, pp=2, zero=1, moe="moe-shared-bias"),  # expert state sharded over tp ranks
    Layout(tp=2, dp=2, moe="moe", ep=2, etp=2),  # ep over dp, each expert split over tp
    Layout(tp=2, dp=2, sp=True, moe="moe", ep=4),  # ep over tp * dp
    Layout(tp=2, dp=2, zero=3, sp=True, moe="moe", ep=2),  # folded ep, ZeRO-3 over edp = dp
    Layout(tp=2, pp=2, zero=2, recompute="full", moe="moe-shared-bias"),  # edp = the tp ranks
    Layout(cp=2, pp=2, recompute="full", moe="moe-shared-bias"),
    Layout(pp=2, dp=2, vpp=2, schedule=I, zero=2, moe="moe-capacity", ep=2),
    Layout(dp=4, moe="moe", ep=4),
    Layout(pp=2, dp=2, moe="moe", ep=2),
    Layout(pp=2, dp=2, schedule="zb-h1", moe="moe-shared-bias", ep=2),
    Layout(dp=4, zero=3, moe="moe", ep=2),  # expert shards over their 2 replicas
    Layout(cp=2, dp=2, zero=1, llama=True, moe="moe", ep=2),  # edp = 2, over dp
    # DualPipeV and parallel.moe_overlap (the async dispatch needs ep > 1 and shared experts)
    Layout(pp=2, vpp=2, schedule="dualpipev", moe="moe"),
    Layout(pp=2, moe="moe", overlap=True),  # 1F1B paired
    Layout(dp=2, moe="moe-shared-bias", ep=2, overlap=True),  # no pipeline: paired accumulation
    Layout(tp=2, sp=True, moe="moe-shared-bias", ep=2, overlap=True),  # folded: tp's MLP in flight
    Layout(pp=4, vpp=2, schedule="dualpipev", moe="moe-shared-bias"),
    Layout(pp=2, dp=2, moe="moe-shared-bias", ep=2, overlap=True),
    Layout(pp=2, dp=2, vpp=2, schedule="dualpipev", moe="moe-shared-bias", ep=2, overlap=True),
    Layout(tp=2, dp=2, sp=True, zero=3, llama=True, moe="deepseek", ep=2),
    Layout(tp=2, pp=2, vpp=2, schedule="zb-v", llama=True, moe="deepseek"),
    Layout(tp=2, pp=2, vpp=2, schedule="zb-v", llama=True, moe="deepseek-mtp"),  # ends on rank 0
    # world 8
    Layout(tp=2, pp=2, dp=2, sp=True, zero=1),
    Layout(tp=2, pp=2, dp=2, sp=True, zero=1, moe="moe", ep=2),  # folded, pp and ZeRO-1
    Layout(tp=2, pp=2, dp=2, vpp=2, schedule=I, sp=True, zero=1, recompute="full"),
    Layout(tp=2, pp=2, dp=2, schedule="zb-h1", recompute="selective", zero=2, llama=True),
    Layout(pp=4, dp=2, vpp=2, schedule=I, zero=1),
    Layout(pp=4, dp=2, recompute="full", llama=True),
    Layout(tp=2, pp=4, sp=True),
    Layout(tp=2, pp=4, vpp=2, schedule=I, recompute="selective", zero=1),
    Layout(tp=2, pp=4, schedule="zb-h1", sp=True, recompute="full"),
    Layout(tp=2, pp=2, dp=2, vpp=2, schedule="zb-v", zero=1, recompute="full"),
    Layout(tp=2, pp=2, dp=2, vpp=2, schedule=I, sp=True, zero=3, recompute="full"),
    Layout(tp=2, cp=2, pp=2, schedule="zb-h1", sp=True, llama=True, zero=1),
    Layout(cp=2, pp=2, dp=2, vpp=2, schedule="zb-v", cp_comm="allgather"),
    Layout(tp=2, cp=2, pp=2, sp=True, llama=True, moe="deepseek", ep=2),
]

FP8_GRID = [
    Layout(tp=2, sp=True, fp8=True),
    Layout(pp=2, schedule="zb-h1", recompute="selective", llama=True, fp8=True),
    Layout(dp=2, zero=3, recompute="full", fp8=True),
    Layout(cp=2, llama=True, fp8=True),
    Layout(dp=2, moe="moe", ep=2, fp8=True),  # fp8 experts: rows of both replicas per expert
    Layout(tp=2, sp=True, moe="moe", etp=2, fp8=True),  # each rank scales its expert shards
    # MLA's five linears: its losses within FP8_RTOL, its gradient norms within 5% (step 3:
    # one fp8 process's own norm is 5.5% off the fp32 one's there, this layout 2.1% off it)
    Layout(tp=2, sp=True, llama=True, moe="deepseek-fp8", fp8=True, fp8_norm_rtol=0.05),
]
"""fp8 layouts, each against one fp8 process: each rank scales its own shard of a tensor
(a tensor-parallel slice of a weight, a context-parallel slice of the tokens, an expert's
rows from several replicas), so they agree to float8's rounding, not float32's
(`FP8_RTOL`)."""
FP8_RTOL = 0.01
"""Relative tolerance of fp8 layouts' losses and gradient norms against one fp8 process."""


def _config(
    data: str, run_dir: Path, layout: Layout | None, llama: bool, moe: str = "", fp8: bool = False
) -> RunConfig:
    model = {"num_layers": 8, "hidden_size": 32, "num_heads": 4, "seq_length": 16}
    model |= LLAMA | ROTARY_FAMILIES if llama else {"tie_embeddings": True}
    model |= MOE.get(moe, {})
    parallel = {"bucket_mb": 0.01}
    if layout is not None:
        parallel |= {
            "tp": layout.tp,
            "pp": layout.pp,
            "vpp": layout.vpp,
            "schedule": layout.schedule,
            "sequence_parallel": layout.sp,
            "recompute": layout.recompute,
            "zero": layout.zero,
            "zero3_reshard_after_forward": not layout.keep,
            "cp": layout.cp,
            "cp_comm": layout.cp_comm,
            "ep": layout.ep,
            "etp": layout.etp,
            "pipeline_layers": layout.layers,
            "moe_overlap": layout.overlap,
        }
    return tiny_config(
        data,
        run_dir,
        model=model,
        parallel=parallel,
        # eps = 1e-6: see tests/dist/test_tensor.py (rounding-level gradients under Adam);
        # grad_clip below the norms seen here, so that clipping is exercised.
        optim={"eps": 1e-6, "grad_clip": 0.5},
        # fp8: a microbatch's 2 * 16 tokens (16 per rank under cp = 2), as float8 GEMMs need
        train={"micro_batch_size": 1, "global_batch_size": 8, "steps": 3}
        | ({"micro_batch_size": 2, "precision": "fp8"} if fp8 else {}),
    )


def _run_layouts(rank: int, world_size: int, data: str, root: str, names: list[str]) -> None:
    for layout in (x for x in GRID + FP8_GRID if x.name in names):
        run_dir = Path(root) / layout.name
        cfg = _config(data, run_dir, layout, layout.llama, layout.moe, layout.fp8)
        result = train(cfg, env=LaunchEnv(rank, world_size, rank))
        if rank == 0:
            (run_dir / "result.json").write_text(
                json.dumps(
                    {
                        "losses": result.losses,
                        "grad_norms": result.grad_norms,
                        "optimizer_bytes": result.optimizer_bytes,
                    }
                )
            )


def _reference(
    data: str, root: Path, llama: bool, moe: str = "", fp8: bool = False
) -> tuple[Path, dict, dict]:
    run_dir = root / "-".join(["single"] + ["llama"] * llama + [moe] * bool(moe) + ["fp8"] * fp8)
    result = train(_config(data, run_dir, None, llama, moe, fp8))
    as_json = json.loads(json.dumps({"l": result.losses, "g": result.grad_norms}))
    return run_dir, as_json["l"], as_json["g"]


@pytest.fixture(scope="module")
def references(tiny_data: str, tmp_path_factory: pytest.TempPathFactory):
    """`_reference` once per kind of model for the whole module: the three world sizes and
    the fp8 layouts share the single-process runs they are compared with."""
    root, done = tmp_path_factory.mktemp("grid_references"), {}

    def reference(llama: bool, moe: str = "", fp8: bool = False) -> tuple[Path, dict, dict]:
        if (llama, moe, fp8) not in done:
            done[(llama, moe, fp8)] = _reference(tiny_data, root, llama, moe, fp8)
        return done[(llama, moe, fp8)]

    return reference


def _moe_figures(run_dir: Path) -> list[tuple]:
    """Each step's expert loads per layer (exact: counts) and dropped choices."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["moe_load"], r.get("moe_dropped")) for r in records if "moe_load" in r]


def test_grid_covers_the_issue() -> None:
    """At least 24 layouts, world size <= 8, every value of every dimension present."""
    assert len(GRID) >= 24 and len({x.name for x in GRID}) == len(GRID)
    assert all(x.world <= 8 for x in GRID)
    for attr, values in {
        "tp": {1, 2}, "pp": {1, 2, 4}, "dp": {1, 2}, "vpp": {1, 2},
        "schedule": {"1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev"},
        "sp": {True, False}, "overlap": {True, False},
        "zero": {0, 1, 2, 3}, "recompute": {"none", "selective", "full"}, "cp": {1, 2, 4},
        "cp_comm": {"ring", "allgather"}, "moe": {"", *MOE},
    }.items():  # fmt: skip
        assert values <= {getattr(x, attr) for x in GRID}, attr
    # Stages without layers (the embedding alone first, the loss alone last) under each kind
    # of schedule: one chunk per rank, interleaved, and ZB-V's V (both ends on rank 0).
    ends = {x.schedule for x in GRID if x.layers and 0 in (x.layers[0], x.layers[-1])}
    assert {"1f1b", "interleaved", "zb-v"} <= ends
    moe = {x for x in GRID if x.moe}
    ep = {x for x in moe if x.ep > 1}
    for attr, value in {
        "tp": 2, "sp": True, "pp": 2, "schedule": "zb-h1", "zero": 3, "cp": 2, "recompute": "full",
    }.items():  # fmt: skip
        assert any(getattr(x, attr) == value for x in moe), attr
        assert any(getattr(x, attr) == value for x in ep), ("ep", attr)
    assert {x.ep for x in ep} == {2, 4} and {x.moe for x in ep} == set(MOE)
    assert {x.zero for x in ep} >= {1, 3} and {x.schedule for x in ep if x.pp > 1} >= {"1f1b"}
    assert any(x.ep < x.dp * x.cp for x in ep if x.zero)  # expert state sharded over edp


# Over pytest's 300 s default when the machine is loaded (world 4's 54 layouts: ~2 min alone,
# over 5 under two suites at once); `run_ranks` bounds each spawn by its layouts.
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_layout_matches_one_process(
    tiny_data: str, tmp_path: Path, world: int, references
) -> None:
    layouts = [x for x in GRID if x.world == world]
    kinds = {(x.llama, x.moe) for x in layouts}
    refs = {kind: references(*kind) for kind in kinds}
    run_ranks(
        _run_layouts, world, tiny_data, str(tmp_path), [x.name for x in layouts],
        timeout_s=120 * len(layouts),
    )  # fmt: skip
    results = {}
    for layout in layouts:
        single, losses, norms = refs[(layout.llama, layout.moe)]
        run_dir = tmp_path / layout.name
        got = json.loads((run_dir / "result.json").read_text())
        results[layout] = got
        assert got["losses"].keys() == losses.keys() == {"1", "2", "3"}, layout.name
        for step, norm in norms.items():
            assert got["grad_norms"][step] == pytest.approx(norm, rel=1e-5), (layout.name, step)
        assert_same_run(single, run_dir, losses, got["losses"])
        if layout.moe:  # the same tokens went to the same experts, every layer and step
            assert _moe_figures(run_dir) == _moe_figures(single), layout.name
    # The distributed optimizer keeps 1/dp of the state (up to one bucket's padding).
    for layout, got in results.items():
        if layout.zero and layout.dp > 1:
            full = results.get(replace(layout, zero=0))
            if full is not None:
                per_rank = full["optimizer_bytes"] / (layout.dp * layout.cp)
                assert got["optimizer_bytes"] == pytest.approx(per_rank, rel=0.05), layout.name


def test_fp8_layouts_match_one_fp8_process(tiny_data: str, tmp_path: Path, references) -> None:
    """tp + sp, pp with the zero-bubble split (W in fp8), ZeRO-3 with full recomputation,
    cp, and an MoE model's experts split over ep = 2 (each expert's float8 casts over the
    rows both replicas send it) and over etp = 2 (each rank's expert shards), each in fp8
    against one fp8 process: losses and gradient norms within `FP8_RTOL`. A pipeline splits
    no tensor, so there each rank's casts are one process's and the run is one process's to
    float32 rounding, final weights included.
    (Elsewhere the weights are not compared: Adam moves a weight whose gradient is near zero
    by ~lr a step either way, and float8 rounding flips such signs.)"""
    pytest.importorskip("torchao")
    assert {2} == {x.world for x in FP8_GRID}  # one spawn
    refs = {(x.llama, x.moe): references(x.llama, x.moe, fp8=True) for x in FP8_GRID}
    names = [x.name for x in FP8_GRID]
    run_ranks(_run_layouts, 2, tiny_data, str(tmp_path), names, timeout_s=120 * len(names))
    for layout in FP8_GRID:
        single, losses, norms = refs[(layout.llama, layout.moe)]
        got = json.loads((tmp_path / layout.name / "result.json").read_text())
        assert got["losses"].keys() == losses.keys() == {"1", "2", "3"}, layout.name
        for step in losses:
            assert got["losses"][step] == pytest.approx(losses[step], rel=FP8_RTOL), layout.name
            assert got["grad_norms"][step] == pytest.approx(norms[step], rel=layout.fp8_norm_rtol)
        if layout.world == layout.pp:
            assert_same_run(single, tmp_path / layout.name, losses, got["losses"])
