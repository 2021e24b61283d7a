"""Multi-token prediction (model.mtp_depth, `ptdp.model.mtp`) against a reference written
from DeepSeek-V3's equations on shortened sequences: depth k sees positions 0..s-1-k only,
so its causal layers need no mask and no rolled tokens. Losses and every gradient; the
evaluation loss without it; the bad inputs it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.model.gpt import GPT
from ptdp.model.moe import MoE
from ptdp.rules.layout import validate

MODEL = {
    "num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 8, "vocab_size": 40,
    "position_embedding": "rope", "normalization": "rmsnorm", "activation": "swiglu",
    "bias": False, "dropout": 0.0, "tie_embeddings": False, "mtp_depth": 2,
    "mtp_loss_weight": 0.3, "make_vocab_size_divisible_by": 1,
}  # fmt: skip


def _model(**keys: object) -> GPT:
    cfg = apply_updates(RunConfig(), {"model": MODEL | keys}, "test").model
    torch.manual_seed(0)
    return GPT(cfg).double()


def _reference(gpt: GPT, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """L = L_main + w / D sum_k L_k, with L_k the mean over i < s - k of
    -log p_k(t_{i+k+1} | i), from h^k_i = layer_k(W_k [norm(Emb(t_{i+k})); norm(h^{k-1}_i)])."""
    s = tokens.shape[1]
    hidden = gpt.embed(tokens)
    for layer in gpt.layers.values():
        hidden = layer(hidden, gpt.rotary)
    out = gpt.output.weight
    logits = gpt.final_norm(hidden) @ out.t()  # the loss in float32, as the model's
    main = F.cross_entropy(logits.float().flatten(0, 1), labels.t().flatten())
    losses, h = [], hidden
    for k, module in gpt.mtp.items():
        k = int(k)
        n = s - k  # positions with a token k + 1 ahead
        ahead = labels[:, k - 1 : k - 1 + n]  # t_{i+k} = labels[i + k - 1]
        joined = torch.cat([module.enorm(gpt.embedding(ahead)), module.hnorm(h[:n])], -1)
        h = module.layer(joined @ module.eh_proj.weight.t(), gpt.rotary)
        logits = module.norm(h) @ out.t()
        target = labels[:, k : k + n].t()  # t_{i+k+1} = labels[i + k]
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), target.flatten()))
    return main + gpt.cfg.mtp_loss_weight * sum(losses) / len(losses), losses


@pytest.mark.parametrize("moe", [False, True])
def test_the_loss_and_its_gradients_are_the_equations(moe: bool) -> None:
    # With experts, the MTP layers are MoE as the last layer is (the first layer dense).
    keys = {"num_experts": 4, "moe_top_k": 2, "moe_first_dense_layers": 1} if moe else {}
    gpt = _model(**keys)
    assert all(isinstance(m.layer.mlp, MoE) == moe for m in gpt.mtp.values())
    assert sorted(gpt.moe_layers()) == ([1, 2, 3] if moe else [])
    gen = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(0, 40, (2, 8), generator=gen) for _ in range(2))
    gpt.train()
    loss = gpt(tokens, labels)
    loss.backward()
    ours = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    recorded = [x.item() for x in gpt.mtp_state.losses]
    gpt.zero_grad()
    ref, depths = _reference(gpt, tokens, labels)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    assert recorded == pytest.approx([d.item() for d in depths], rel=1e-6)
    for name, p in gpt.named_parameters():  # float64 weights, float32 losses
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert ours["mtp.2.eh_proj.weight"].abs().sum() > 0  # every depth is trained


def test_evaluation_is_the_language_model_loss_alone() -> None:
    gpt = _model()
    tokens = torch.randint(0, 40, (2, 8))
    labels = torch.randint(0, 40, (2, 8))
    gpt.eval()
    with torch.no_grad():
        evaluated = gpt(tokens, labels)
        gpt.train()
        trained = gpt(tokens, labels)
    hidden = gpt.embed(tokens)
    for layer in gpt.layers.values():
        hidden = layer(hidden, gpt.rotary)
    with torch.no_grad():
        assert evaluated == pytest.approx(gpt.loss(hidden, labels).item(), rel=1e-7)
    assert trained > evaluated  # the weighted MTP losses on top


@pytest.mark.parametrize(
    ("keys", "parallel", "says"),
    [
        ({"mtp_depth": 8}, {}, "model.mtp_depth = 8 leaves no token to predict"),
        ({"mtp_depth": -1}, {}, "model.mtp_depth"),
        ({}, {"cp": 2}, "under context parallelism is not built"),
        ({"tie_embeddings": True}, {"pp": 2}, "--model.tie_embeddings false"),
    ],
)
def test_bad_inputs_are_refused(keys: dict, parallel: dict, says: str) -> None:
    sections = {"model": MODEL | keys, "parallel": parallel}
    sections["train"] = {"micro_batch_size": 1, "global_batch_size": 2}
    cfg = apply_updates(RunConfig(), sections, "test")
    with pytest.raises(ConfigError, match="mtp_depth") as refused:
        validate(cfg, max(2, parallel.get("cp", 1) * parallel.get("pp", 1)))
    assert says in str(refused.value)


def test_a_negative_weight_is_refused() -> None:
    cfg = apply_updates(RunConfig(), {"model": MODEL | {"mtp_loss_weight": -0.1}}, "test")
    with pytest.raises(ConfigError, match="model.mtp_loss_weight"):
        validate(cfg)


def test_the_deepest_depth_the_sequence_allows_trains() -> None:
    # seq_length 8, depth 7: position 0 still has its token 8 ahead; one token per sequence.
    sections = {"model": MODEL | {"mtp_depth": 7}}
    sections["train"] = {"micro_batch_size": 1, "global_batch_size": 1}
    validate(apply_updates(RunConfig(), sections, "test"))
    gpt = _model(mtp_depth=7).train()
    tokens = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(3))
    loss, (ref, depths) = gpt(tokens, tokens), _reference(gpt, tokens, tokens)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    assert len(depths) == 7
