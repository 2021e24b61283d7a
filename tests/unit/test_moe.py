"""The mixture-of-experts block (ptdp/model/moe.py) against a naive per-token loop: output
and every gradient, for each router option, shared experts and capacity drops; ties; the
balancing losses' gradients; the grouped products and their deferral; the config rules."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from ptdp.config.enums import Activation, ScoreFunction
from ptdp.config.files import apply_updates
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.errors import ConfigError
from ptdp.model.dispatch import capacity, plan_dispatch
from ptdp.model.gpt import GPT, TPContext
from ptdp.model.moe import MoE, MoEState
from ptdp.model.router import RouterOptions, route, top_k
from ptdp.parallel.grouped import GemmKernel, choose_gemm, gemm_for_cuda, grouped_mm, grouped_wgrad
from ptdp.parallel.wgrad import WeightGradStore, accumulate_grads, grouped_linear
from ptdp.rules.layout import validate

H, E = 16, 4
BASE = ModelConfig(
    num_layers=2, hidden_size=H, num_heads=2, seq_length=8, vocab_size=32, ffn_hidden_size=24,
    num_experts=E, moe_top_k=2,
)  # fmt: skip


def _block(cfg: ModelConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    block = MoE(cfg, TPContext(), layer=0, state=MoEState())
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.5)
        if block.router.expert_bias is not None:
            block.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    return block.train()


def _expert(block: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e of `block` on one token x [h], written out."""
    fc1, fc2 = block.experts.fc1, block.experts.fc2
    y = fc1.weight[e] @ x + (fc1.bias[e] if fc1.bias is not None else 0)
    if block.experts.swiglu:
        gate, up = y.chunk(2)
        y = F.silu(gate) * up
    else:
        y = F.gelu(y, approximate="tanh")
    return fc2.weight[e] @ y + (fc2.bias[e] if fc2.bias is not None else 0)


def _naive_choice(cfg: ModelConfig, logits: torch.Tensor, bias) -> tuple[list[int], torch.Tensor]:
    """One token's experts (Python sort on (-score, index)) and their weights."""
    softmax = cfg.moe_score_function is ScoreFunction.SOFTMAX
    scores = logits.softmax(-1) if softmax else logits.sigmoid()
    pick = logits if cfg.moe_softmax_after_topk else scores
    shift = [0.0] * E if bias is None else bias.tolist()
    key = [float(v) + shift[i] for i, v in enumerate(pick.detach())]
    allowed = range(E)
    if cfg.moe_router_groups:  # DeepSeek-V3: the best groups by their two best scores
        size = E // cfg.moe_router_groups
        members = [range(g * size, (g + 1) * size) for g in range(cfg.moe_router_groups)]
        score = [sum(sorted((key[i] for i in m), reverse=True)[:2]) for m in members]
        best = sorted(range(len(members)), key=lambda g: (-score[g], g))
        allowed = [i for g in best[: cfg.moe_router_group_top_k] for i in members[g]]
    chosen = sorted(allowed, key=lambda i: (-key[i], i))[: cfg.moe_top_k]
    w = pick[chosen]
    if cfg.moe_softmax_after_topk:
        w = w.softmax(-1)
    if cfg.moe_renormalize:
        w = w / w.sum()
    return chosen, w * cfg.moe_routed_scaling


def _naive(block: MoE, cfg: ModelConfig, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [s, b, h], aux + z loss) of `block` on x, token by token."""
    s, b, _ = x.shape
    tokens = x.reshape(s * b, H)
    bias = block.router.expert_bias
    choices = []
    for t in range(s * b):
        logits = block.router.weight @ tokens[t]
        choices.append((t, *_naive_choice(cfg, logits, bias)))
    kept = {(t, e) for t, chosen, _ in choices for e in chosen}
    if cfg.moe_capacity_factor:
        cap = math.ceil(cfg.moe_capacity_factor * s * b * cfg.moe_top_k / E)
        kept = set()
        for e in range(E):
            mine = [(float(w.detach()[ch.index(e)]), t) for t, ch, w in choices if e in ch]
            kept |= {(t, e) for _, t in sorted(mine, key=lambda m: (-m[0], m[1]))[:cap]}
    outs = []
    for t, chosen, w in choices:
        out = torch.zeros(H)
        for j, e in enumerate(chosen):
            if (t, e) in kept:
                out = out + w[j] * _expert(block, e, tokens[t])
        outs.append(out)
    out = torch.stack(outs).view(s, b, H)
    if block.shared is not None:
        out = out + block.shared(x)
    logits = tokens @ block.router.weight.t()
    probs = logits.softmax(-1)
    if cfg.moe_score_function is ScoreFunction.SIGMOID:
        probs = logits.sigmoid() / logits.sigmoid().sum(-1, keepdim=True)
    counts = torch.zeros(E)
    for _, chosen, _ in choices:
        counts[chosen] += 1
    aux = E * (counts / (s * b * cfg.moe_top_k) * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    return out, cfg.moe_aux_loss_coeff * aux + cfg.moe_z_loss_coeff * z


def _grads(block: MoE, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    block.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in block.named_parameters()}


VARIANTS = {
    "softmax-topk": {},
    "mixtral": {"moe_softmax_after_topk": True},
    "qwen3": {"moe_renormalize": True, "moe_top_k": 3},
    "deepseek": {
        "moe_score_function": ScoreFunction.SIGMOID, "moe_renormalize": True,
        "moe_routed_scaling": 2.5, "moe_bias_update_rate": 0.001, "moe_shared_experts": 1,
    },
    "swiglu-shared-nobias": {
        "activation": Activation.SWIGLU, "bias": False, "moe_shared_experts": 2,
        "moe_shared_ffn_hidden_size": 20, "moe_ffn_hidden_size": 12,
    },
    "deepseek-groups": {
        "moe_score_function": ScoreFunction.SIGMOID, "moe_renormalize": True,
        "moe_bias_update_rate": 0.001, "moe_router_groups": 2, "moe_router_group_top_k": 1,
    },
    "softmax-groups": {"moe_router_groups": 4, "moe_router_group_top_k": 3},
    "capacity": {"moe_capacity_factor": 1.0},
    "capacity-top1": {"moe_capacity_factor": 1.5, "moe_top_k": 1},
    "losses": {"moe_aux_loss_coeff": 0.3, "moe_z_loss_coeff": 0.05},
}  # fmt: skip


@pytest.mark.parametrize("name", VARIANTS)
def test_block_matches_a_per_token_loop(name: str) -> None:
    """Output and every parameter's and the input's gradient, the balancing losses (if any)
    included as explicit terms of the loss in the reference."""
    cfg = replace(BASE, **VARIANTS[name])
    block = _block(cfg)
    x = torch.randn(6, 3, H, requires_grad=True)
    r = torch.randn(6, 3, H)
    out = block(x)
    got = _grads(block, (out * r).sum())
    got_dx, x.grad = x.grad.clone(), None
    ref, losses = _naive(block, cfg, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    want = _grads(block, (ref * r).sum() + losses)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-5, msg=n)
    torch.testing.assert_close(got_dx, x.grad, rtol=1e-5, atol=1e-5)
    stats = block.state.stats[0]
    assert int(stats.routed.sum()) == 18 * cfg.moe_top_k and stats.microbatches == 1
    if cfg.moe_capacity_factor:
        cap = capacity(cfg.moe_capacity_factor, 18, cfg.moe_top_k, E)
        assert int(stats.dropped) == int((stats.routed - cap).clamp(min=0).sum()) > 0


def test_balancing_gradient_follows_the_step_scale() -> None:
    """grad_scale (1/microbatches x loss scale) scales the losses' gradient, not the output's."""
    cfg = replace(BASE, moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)
    block = _block(cfg)
    x = torch.randn(4, 2, H)
    block.state.begin_step(0.25)
    got = _grads(block, block(x).sum())
    ref, losses = _naive(block, cfg, x)
    want = _grads(block, ref.sum() + 0.25 * losses)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-5, msg=n)
    assert float(block.state.stats[0].aux) > 0 and float(block.state.stats[0].z) > 0


def test_evaluation_records_nothing_and_attaches_no_loss() -> None:
    block = _block(replace(BASE, moe_aux_loss_coeff=1.0)).eval()
    out = block(torch.randn(4, 2, H))
    assert not block.state.stats and out.grad_fn.name() != "_BalancingGradBackward"


def test_ties_go_to_the_lower_index() -> None:
    scores = torch.tensor([[0.1, 0.5, 0.5, 0.5], [0.2, 0.2, 0.2, 0.2]])
    assert top_k(scores, 2).tolist() == [[1, 2], [0, 1]]
    # A bias moves the choice, not the weights: expert 3 wins the tie, weighted unbiased.
    opts = RouterOptions(E, 1)
    logits = torch.zeros(1, E)
    r = route(logits, torch.tensor([0.0, 0.0, 0.0, 1e-3]), opts)
    assert r.experts.tolist() == [[3]] and r.weights.tolist() == [[0.25]]
    # Capacity: equal weights keep the earlier token.
    tied = route(torch.zeros(3, E), None, RouterOptions(E, 1))
    plan = plan_dispatch(tied, E, cap=2)
    assert plan.choice.tolist() == [0, 1] and int(plan.dropped) == 1


def test_group_limited_routing_picks_within_the_best_groups() -> None:
    """8 experts in 4 groups, 2 groups per token: the two best single scores (experts 0 and
    7) lie in groups 0 and 3, but groups 1 and 2 win by the sum of their two best, so the
    top-2 comes from experts 2-5; equal group sums go to the lower group."""
    scores = torch.tensor([[0.9, 0.0, 0.5, 0.5, 0.6, 0.45, 0.0, 0.8]])
    logits = torch.logit(scores.clamp(1e-4, 1 - 1e-4))
    plain = RouterOptions(8, 2, ScoreFunction.SIGMOID)
    assert route(logits, None, plain).experts.tolist() == [[0, 7]]
    grouped = replace(plain, groups=4, group_top_k=2)
    assert route(logits, None, grouped).experts.tolist() == [[4, 2]]
    tied = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    softmax = RouterOptions(8, 3, groups=4, group_top_k=2)
    assert route(tied, None, softmax).experts.tolist() == [[4, 0, 1]]
    # The bias counts in the group scores as in the choice, never in the weights.
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    r = route(logits, bias, grouped)
    assert r.experts.tolist() == [[7, 4]]
    torch.testing.assert_close(r.weights, scores[:, [7, 4]], rtol=1e-3, atol=1e-4)


def test_recomputation_counts_a_layer_once() -> None:
    cfg = replace(BASE, moe_aux_loss_coeff=0.01)
    from ptdp.config.enums import Recompute

    model = GPT(cfg, recompute=Recompute.FULL).train()
    tokens = torch.randint(0, 32, (2, 8))
    model(tokens, tokens).backward()
    assert sorted(model.moe.stats) == [0, 1]
    assert all(s.microbatches == 1 and int(s.routed.sum()) == 32 for s in model.moe.stats.values())


# ---------------------------------------------------------------- grouped products


def test_grouped_kernel_matches_the_loop() -> None:
    """F.grouped_mm (its CPU kernel here), padded (the aligned layout) and not, against the
    loop; unpadded, bit for bit (the same GEMM per expert)."""
    counts = torch.tensor([3, 0, 9, 1])
    x, w, dy = torch.randn(13, 8), torch.randn(4, 8, 16), torch.randn(13, 16)
    want = torch.stack([dy[a:b].t() @ x[a:b] for a, b in ((0, 3), (3, 3), (3, 12), (12, 13))])
    for kernel in GemmKernel:
        got_y, got_w = grouped_mm(x, w, counts, kernel), grouped_wgrad(dy, x, counts, kernel)
        torch.testing.assert_close(got_y, grouped_mm(x, w, counts, GemmKernel.LOOP))
        torch.testing.assert_close(got_w, want)
    loop = grouped_mm(x, w, counts, GemmKernel.LOOP)
    assert torch.equal(grouped_mm(x, w, counts, GemmKernel.UNPADDED), loop)
    assert torch.equal(grouped_wgrad(dy, x, counts, GemmKernel.UNPADDED), want)


def test_gemm_choice() -> None:
    x = torch.randn(4, 8)
    assert choose_gemm(x, torch.randn(2, 8, 8)) is GemmKernel.UNPADDED  # CPU: torch's kernel
    assert choose_gemm(x.double(), torch.randn(2, 8, 8).double()) is GemmKernel.LOOP  # no fp64
    assert choose_gemm(x[:, :6], torch.randn(2, 6, 8)) is GemmKernel.LOOP  # 24-byte rows
    assert choose_gemm(x[:0], torch.randn(2, 8, 8)) is GemmKernel.LOOP  # no rows
    bf16, sm90 = torch.bfloat16, (9, 0)
    assert gemm_for_cuda(bf16, sm90, (64, 128)) is GemmKernel.GROUPED
    assert gemm_for_cuda(bf16, (10, 0), (64, 128)) is GemmKernel.GROUPED
    assert gemm_for_cuda(torch.float32, sm90, (64, 128)) is GemmKernel.LOOP  # no fused fp32
    assert gemm_for_cuda(bf16, (8, 0), (64, 128)) is GemmKernel.LOOP  # torch's own loop
    assert gemm_for_cuda(bf16, sm90, (64, 100)) is GemmKernel.LOOP  # rows not 16-byte aligned


def test_grouped_weight_gradient_is_deferred_to_w() -> None:
    counts = torch.tensor([2, 3, 0])
    w = torch.nn.Parameter(torch.randn(3, 6, 4))
    x = torch.randn(5, 4, requires_grad=True)
    grouped_linear(x, w, counts).square().sum().backward()
    want_w, want_x = w.grad.clone(), x.grad.clone()
    w.grad, x.grad = None, None
    store = WeightGradStore()
    with store.capture():
        y = grouped_linear(x, w, counts, store)
    with store.deferring(7):
        y.square().sum().backward()
    assert w.grad is None and store.keys() == [7]
    torch.testing.assert_close(x.grad, want_x)
    accumulate_grads(store.flush(7))
    torch.testing.assert_close(w.grad, want_w)


# ---------------------------------------------------------------- config


INVALID = [
    ({"moe_top_k": 4}, 1, "model.moe_top_k = 4 set but model.num_experts = 0"),
    ({"moe_aux_loss_coeff": 0.01, "moe_layer_freq": 2}, 1, "drop them"),
    ({"num_experts": 4, "moe_top_k": 5}, 1, "moe_top_k = 5 exceeds model.num_experts = 4"),
    ({"num_experts": 4, "moe_top_k": 0}, 1, "model.moe_top_k = 0 must be >= 1"),
    ({"num_experts": -1}, 1, "model.num_experts = -1 must be >= 0"),
    ({"num_experts": 4, "moe_capacity_factor": 0.5}, 1, "use 0 (dropless) or a factor >= 1"),
    ({"num_experts": 4, "moe_first_dense_layers": 4}, 1, "leaves no MoE layer"),
    ({"num_experts": 4, "moe_layer_freq": 0}, 1, "model.moe_layer_freq = 0 must be >= 1"),
    ({"num_experts": 4, "moe_z_loss_coeff": -1.0}, 1, "model.moe_z_loss_coeff = -1.0 must be"),
    ({"num_experts": 4, "moe_routed_scaling": 0.0}, 1, "model.moe_routed_scaling = 0.0 must"),
    (
        {"num_experts": 4, "moe_softmax_after_topk": True, "moe_score_function": "sigmoid"},
        1,
        "--model.moe_score_function softmax",
    ),
    ({"num_experts": 4, "moe_shared_ffn_hidden_size": 64}, 1, "model.moe_shared_experts = 0"),
    ({"num_experts": 6, "moe_router_groups": 4, "moe_router_group_top_k": 1}, 1, "[1, 2, 3, 6]"),
    ({"num_experts": 8, "moe_router_groups": 4, "moe_router_group_top_k": 5}, 1, "between 1"),
    ({"num_experts": 8, "moe_router_groups": 4}, 1, "model.moe_router_group_top_k = 0 must"),
    ({"num_experts": 8, "moe_router_group_top_k": 2}, 1, "--model.moe_router_groups (e.g."),
    (
        {"num_experts": 8, "moe_top_k": 4, "moe_router_groups": 4, "moe_router_group_top_k": 1},
        1,
        "--model.moe_router_group_top_k 2 or more",
    ),
    ({"moe_router_groups": 2}, 1, "model.moe_router_groups = 2 set but model.num_experts = 0"),
    (
        {"num_experts": 4, "moe_shared_experts": 1, "moe_shared_ffn_hidden_size": 33},
        2,
        "shared expert width 33",
    ),
]


@pytest.mark.parametrize(("model", "world", "message"), INVALID)
def test_moe_configs_are_refused(model: dict, world: int, message: str) -> None:
    parallel = {"tp": world}
    cfg = apply_updates(RunConfig(), {"model": model, "parallel": parallel}, "t")
    with pytest.raises(ConfigError, match=None) as info:
        validate(cfg, world)
    assert message in str(info.value)


def test_capacity_with_context_parallelism_is_refused_and_compile_is_not() -> None:
    updates = {
        "model": {"num_experts": 4, "moe_capacity_factor": 1.25, "seq_length": 32},
        "parallel": {"cp": 2},
        "train": {"compile": True},
    }
    with pytest.raises(ConfigError) as info:
        validate(apply_updates(RunConfig(), updates, "t"), 2)
    text = str(info.value)
    assert "the routing of the whole sequence" in text and "--model.moe_capacity_factor 0" in text
    assert "model.num_experts" not in text.split("train.compile")[-1]  # cp's refusal only
    compiled = {"model": {"num_experts": 4, "seq_length": 32}, "train": {"compile": True}}
    validate(apply_updates(RunConfig(), compiled, "t"), 1)  # compiled MoE: ptdp.model.compile


FP8_WIDTHS = [
    # (model keys, parallel keys, what is refused, the fix it names)
    ({"moe_ffn_hidden_size": 48}, {"tp": 2, "etp": 2},
     "(model.moe_ffn_hidden_size, 48, / parallel.etp = 2)", "use --model.moe_ffn_hidden_size 64"),
    ({"moe_ffn_hidden_size": 40}, {}, "(model.moe_ffn_hidden_size, 40, / parallel.etp = 1)",
     "use --model.moe_ffn_hidden_size 48"),
    ({"moe_shared_experts": 1, "moe_shared_ffn_hidden_size": 48}, {"tp": 2},
     "the shared experts' inner features per rank (model.moe_shared_ffn_hidden_size, 48, / "
     "parallel.tp = 2)", "use --model.moe_shared_ffn_hidden_size 64"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "parallel", "refused", "fix"), FP8_WIDTHS)
def test_fp8_expert_widths_are_refused_with_one_that_works(
    model: dict, parallel: dict, refused: str, fix: str
) -> None:
    """fp8 experts: each rank's expert widths (the routed experts' over etp, the shared
    ones' over tp) a multiple of 16, refused before any process group with the key and a
    width that passes (which then validates)."""
    base = {"num_experts": 4, "hidden_size": 128, "num_heads": 4, "seq_length": 32}
    updates = {"model": base | model, "parallel": parallel, "train": {"precision": "fp8"}}
    world = parallel.get("tp", 1)
    with pytest.raises(ConfigError) as info:
        validate(apply_updates(RunConfig(), updates, "t"), world, gpus=True)
    text = str(info.value)
    assert refused in text and fix in text, text
    key, value = fix.removeprefix("use --model.").split()
    updates["model"] = updates["model"] | {key: int(value)}
    validate(apply_updates(RunConfig(), updates, "t"), world, gpus=True)


def test_moe_layers_follow_first_dense_and_frequency() -> None:
    cfg = replace(BASE, num_layers=7, moe_first_dense_layers=2, moe_layer_freq=2)
    assert [i for i in range(7) if cfg.is_moe_layer(i)] == [2, 4, 6]
    model = GPT(replace(cfg, num_layers=4, moe_first_dense_layers=1, moe_layer_freq=2))
    assert sorted(model.moe_layers()) == [1, 3]
    assert type(model.layers["2"].mlp).__name__ == "MLP"


def test_router_and_expert_output_bias_are_summed_over_tp() -> None:
    from ptdp.parallel.comm import Group

    cfg = replace(BASE, moe_shared_experts=1)
    two = Group(None, 2, 0)  # sizes only: building a model runs no collective
    names = GPT(cfg, tp=two, etp=two, sequence_parallel=True).roles.sequence_parallel
    for i in (0, 1):
        assert {f"layers.{i}.mlp.{n}" for n in ("router.weight", "experts.fc2.bias")} <= names
        assert f"layers.{i}.mlp.shared.fc2.bias" in names  # a row-parallel layer's own
    # Folded (experts whole): the router still routes 1/tp of the tokens per rank, the
    # experts' bias has no partial sums over an expert tensor group of one.
    names = GPT(cfg, tp=two, sequence_parallel=True).roles.sequence_parallel
    assert "layers.0.mlp.router.weight" in names and "layers.0.mlp.experts.fc2.bias" not in names
    assert not GPT(cfg).roles.sequence_parallel  # one rank: nothing to sum
