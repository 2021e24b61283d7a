"""Tensor and sequence parallelism against one process (gloo on CPU).

Each layer against its nn.Linear / nn.Embedding / cross_entropy counterpart on the
gathered weights; the whole model (GPT and Llama options, sequence parallelism off and
on) against the single-process model: loss, every gradient gathered back to full shape,
and the parameters after 3 optimizer steps; the number of collectives per layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.model.gpt import GPT, TPContext, TransformerLayer
from ptdp.model.init import apply_init
from ptdp.parallel import comm
from ptdp.parallel.comm import Group
from ptdp.parallel.grads import clip_gradients, reduce_sequence_parallel_grads
from ptdp.parallel.init import ShardSpec, full_tensor, padded, rank_rng, shard_spec
from ptdp.parallel.loss import vocab_parallel_cross_entropy
from ptdp.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def assert_rel(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = rel_error(a, b)
    assert err < tol, f"{what}: relative error {err:.2e}"


def split(x: torch.Tensor, tp: Group, dim: int) -> torch.Tensor:
    return x.chunk(tp.size, dim=dim)[tp.rank]


# ----------------------------------------------------------------------------- layers


def _column(tp: Group, sp: bool, parts: int, gather: bool) -> None:
    torch.manual_seed(0)
    s, b, n_in, n_out = 8, 3, 6, 8 * parts
    weight, bias = torch.randn(n_out, n_in), torch.randn(n_out)
    x_ref = torch.randn(s, b, n_in, requires_grad=True)
    probe = torch.randn(s, b, n_out)
    y_ref = F.linear(x_ref, weight, bias)
    (y_ref * probe).sum().backward()

    layer = ColumnParallelLinear(
        n_in, n_out, tp=tp, sequence_parallel=sp, parts=parts, gather_output=gather
    )
    spec = ShardSpec(dim=0, full_size=n_out, padded_size=n_out, size=tp.size, parts=parts)
    with torch.no_grad():
        layer.weight.copy_(spec.shard(weight, tp.rank))
        layer.bias.copy_(spec.shard(bias, tp.rank))
    x = (split(x_ref, tp, 0) if sp else x_ref).detach().requires_grad_()
    y = layer(x)
    if gather:
        expect, local_probe = y_ref, probe
    else:
        expect = spec.shard(y_ref.movedim(-1, 0), tp.rank).movedim(0, -1)
        local_probe = spec.shard(probe.movedim(-1, 0), tp.rank).movedim(0, -1)
    assert_rel(y, expect, f"column output sp={sp} parts={parts}")
    (y * local_probe).sum().backward()
    assert_rel(x.grad, split(x_ref.grad, tp, 0) if sp else x_ref.grad, "column dX")
    assert_rel(layer.weight.grad, spec.shard(_grad_w(x_ref, probe), tp.rank), "column dW")
    assert_rel(layer.bias.grad, spec.shard(probe.sum((0, 1)), tp.rank), "column db")


def _grad_w(x: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    """dW of sum(probe * (x W^T + b)) = probe^T x, over all tokens."""
    return probe.flatten(0, 1).t() @ x.detach().flatten(0, 1)


def _row(tp: Group, sp: bool) -> None:
    torch.manual_seed(1)
    s, b, n_in, n_out = 8, 3, 8, 6
    weight, bias = torch.randn(n_out, n_in), torch.randn(n_out)
    x_ref = torch.randn(s, b, n_in, requires_grad=True)
    probe = torch.randn(s, b, n_out)
    y_ref = F.linear(x_ref, weight, bias)
    (y_ref * probe).sum().backward()

    layer = RowParallelLinear(n_in, n_out, tp=tp, sequence_parallel=sp)
    with torch.no_grad():
        layer.weight.copy_(split(weight, tp, 1))
        layer.bias.copy_(bias)
    x = split(x_ref, tp, -1).detach().requires_grad_()
    y = layer(x)
    assert_rel(y, split(y_ref, tp, 0) if sp else y_ref, f"row output sp={sp}")
    (y * (split(probe, tp, 0) if sp else probe)).sum().backward()
    assert_rel(x.grad, split(x_ref.grad, tp, -1), "row dX")
    assert_rel(layer.weight.grad, split(_grad_w(x_ref, probe), tp, 1), "row dW")
    bias_grad = layer.bias.grad.clone()
    if sp:  # each rank saw a sequence slice; the trainer sums these over the group
        comm.all_reduce_sum_(bias_grad, tp)
    assert_rel(bias_grad, probe.sum((0, 1)), "row db")


def _embedding_and_loss(tp: Group, sp: bool, divisible_by: int = 1) -> None:
    """10 rows: padded to 12 at tp = 4; with divisible_by = 4 to 16, 8 and 4 at tp = 4, 2
    and 1: rank i holds ids [3i, 3i + 3) (tp = 4) then zero rows."""
    torch.manual_seed(2)
    vocab, h, b, s = 10, 6, 3, 8
    weight = torch.randn(vocab, h, requires_grad=True)
    tokens = torch.randint(0, vocab, (b, s))
    probe = torch.randn(s, b, h)
    ref = F.embedding(tokens, weight).transpose(0, 1)
    (ref * probe).sum().backward()

    layer = VocabParallelEmbedding(vocab, h, tp=tp, sequence_parallel=sp, divisible_by=divisible_by)
    full = padded(vocab, divisible_by * tp.size)
    spec = ShardSpec(dim=0, full_size=vocab, padded_size=full, size=tp.size)
    assert layer.weight.shape == (full // tp.size, h)
    with torch.no_grad():
        layer.weight.copy_(spec.shard(weight.detach(), tp.rank))
    out = layer(tokens)
    assert_rel(out, split(ref, tp, 0) if sp else ref, f"embedding sp={sp}")
    (out * (split(probe, tp, 0) if sp else probe)).sum().backward()
    assert_rel(layer.weight.grad, spec.shard(weight.grad, tp.rank), "embedding dW")

    logits_ref = torch.randn(s, b, vocab, requires_grad=True)
    target = torch.randint(0, vocab, (s, b))
    loss_ref = F.cross_entropy(logits_ref.flatten(0, 1), target.flatten())
    loss_ref.backward()
    local = spec.shard(logits_ref.detach().movedim(-1, 0), tp.rank).movedim(0, -1)
    local.requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, tp, vocab)
    loss.backward()
    assert_rel(loss, loss_ref, "vocab-parallel cross-entropy")
    expect = spec.shard(logits_ref.grad.movedim(-1, 0), tp.rank).movedim(0, -1)
    assert_rel(local.grad, expect, "cross-entropy dlogits (padded columns zero)")


def _count_layer_collectives(tp: Group, sp: bool) -> dict[str, int]:
    """Collectives of one transformer layer, forward and backward, by kind."""
    cfg = apply_updates(
        RunConfig(),
        {
            "model": {
                "num_layers": 1,
                "hidden_size": 16,
                "num_heads": 4,
                "seq_length": 8,
                "vocab_size": 16,
            }
        },
        "t",
    ).model
    layer = TransformerLayer(cfg, TPContext(tp, sp))
    counts: dict[str, int] = {}
    originals = {
        name: getattr(comm, name) for name in ("_all_reduce", "_all_gather", "_reduce_scatter")
    }

    def counting(name):
        def wrapper(*args, **kwargs):
            counts[f"{phase}{name}"] = counts.get(f"{phase}{name}", 0) + 1
            return originals[name](*args, **kwargs)

        return wrapper

    for name in originals:
        setattr(comm, name, counting(name))
    try:
        x = torch.randn(8 // tp.size if sp else 8, 2, 16, requires_grad=True)
        phase = "forward"
        y = layer(x)
        phase = "backward"
        y.sum().backward()
    finally:
        for name, fn in originals.items():
            setattr(comm, name, fn)
    return counts


def _scatters(tp: Group) -> None:
    """Keep a slice forward, all-gather the gradient backward (last dim, then sequence)."""
    torch.manual_seed(3)
    x, probe = torch.randn(8, 3, 8, requires_grad=True), torch.randn(8, 3, 8)
    for op, dim in ((comm.scatter_to_tp, -1), (comm.scatter_to_sp, 0)):
        x.grad = None
        y = op(x, tp)
        assert torch.equal(y, split(x.detach(), tp, dim))
        (y * split(probe, tp, dim)).sum().backward()
        assert torch.equal(x.grad, probe)


def _check_layers(rank: int, world_size: int) -> None:
    tp = Group(None, world_size, rank)
    _scatters(tp)
    for sp in (False, True):
        _column(tp, sp, parts=1, gather=False)
        _column(tp, sp, parts=2, gather=False)
        _row(tp, sp)
        _embedding_and_loss(tp, sp)
        _embedding_and_loss(tp, sp, divisible_by=4)
    _column(tp, False, parts=1, gather=True)
    counts = _count_layer_collectives(tp, sp=False)
    assert counts == {"forward_all_reduce": 2, "backward_all_reduce": 2}, counts
    counts = _count_layer_collectives(tp, sp=True)
    assert counts == {
        "forward_all_gather": 2,
        "forward_reduce_scatter": 2,
        "backward_all_gather": 2,
        "backward_reduce_scatter": 2,
    }, counts


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_their_single_process_counterparts(tp: int) -> None:
    run_ranks(_check_layers, tp)


def test_layers_at_tp1_are_plain() -> None:
    tp = Group.single()
    for sp in (False, True):  # sequence parallelism is a no-op on one rank
        _column(tp, sp, parts=2, gather=False)
        _row(tp, sp)
        _embedding_and_loss(tp, sp)
        _embedding_and_loss(tp, sp, divisible_by=4)


# ----------------------------------------------------------------------------- whole model

FAMILIES = {  # gpt2 pads the vocabulary to a multiple of 128 * t (the default), llama of t
    "gpt2": {},
    "llama": {
        "make_vocab_size_divisible_by": 1,
        "position_embedding": "rope",
        "normalization": "rmsnorm",
        "activation": "swiglu",
        "num_query_groups": 4,
        "tie_embeddings": False,
        "bias": False,
    },
}
# Qwen2's QKV-only bias (split over ranks with its heads) and Mistral's sliding window
# (shorter than the 16-token sequence: the explicit-mask path), with Llama 3.1's rotary.
FAMILIES["qwen2-window"] = FAMILIES["llama"] | {
    "qkv_bias": True,
    "sliding_window": 5,
    "rope_scaling": "llama3",
    "rope_original_max_positions": 16,
}
# Qwen3: per-head q/k norms (replicated gains, gradients summed over tp) and a head size
# apart from hidden / heads (8 heads of 6 in a 32-wide model).
FAMILIES["qwen3"] = FAMILIES["llama"] | {"qk_norm": True, "head_size": 6}


def _model_cfg(options: dict):
    base = {
        "num_layers": 2,
        "hidden_size": 32,
        "num_heads": 8,
        "seq_length": 16,
        "vocab_size": 51,
    }  # 51: padded at tp = 2 and 4 whatever the multiple
    return apply_updates(RunConfig(), {"model": {**base, **options}}, "t").model


def _unpadded(t: torch.Tensor, ref_param: torch.Tensor) -> torch.Tensor:
    """A single-process tensor without its padded vocabulary rows, as full_tensor gives."""
    return full_tensor(t, shard_spec(ref_param), Group.single())


def _compare_params(model: GPT, ref: GPT, tp: Group, degenerate: set[str], what: str) -> None:
    """Every parameter within 1e-5 relative, and the whole model too.

    A parameter whose true gradient is zero (the key bias: softmax ignores a shift of all
    scores) gets only rounding noise as gradient, which Adam normalises into real updates
    of different sign in different layouts; it is held to an absolute bound instead.
    """
    ref_params = dict(ref.named_parameters())
    diff = total = 0.0
    for name, p in model.named_parameters():
        r = ref_params[name]
        full, expect = full_tensor(p, shard_spec(p), tp), _unpadded(r, r)
        diff, total = diff + (full - expect).norm() ** 2, total + expect.norm() ** 2
        if name in degenerate:
            assert (full - expect).abs().max() < 1e-3, f"{what}: {name}"
        elif "qkv.bias" in name:  # the key rows are degenerate, the query/value rows not
            assert_rel(full, expect, f"{what}: {name}", tol=1e-3)
        else:
            assert_rel(full, expect, f"{what}: {name}")
    assert (diff / total) ** 0.5 < 1e-5, f"{what}: whole model"


def _gathered(x: torch.Tensor, tp: Group) -> list[torch.Tensor]:
    return list(comm.gather_full(x.contiguous(), tp, 0).chunk(tp.size))


def _check_dropout_streams(tp: Group) -> None:
    """Replicated regions: the same random numbers on every rank; split regions: not."""
    torch.manual_seed(11)  # the shared stream, seeded alike on every rank
    shared = torch.rand(4)
    with rank_rng(tp, torch.device("cpu")):
        own = torch.rand(4)
    after = torch.rand(4)
    shared_all, own_all, after_all = (_gathered(t, tp) for t in (shared, own, after))
    assert all(torch.equal(t, shared_all[0]) for t in shared_all)
    assert all(torch.equal(t, after_all[0]) for t in after_all)  # stream stays in step
    assert len({tuple(t.tolist()) for t in own_all}) == tp.size  # one stream per rank

    cfg = _model_cfg({"dropout": 0.5})
    for sp in (False, True):
        torch.manual_seed(12)
        layer = TransformerLayer(cfg, TPContext(tp, sp)).train()
        apply_init(layer, seed=3, base_std=0.02, num_layers=1, tp=tp)
        x = torch.randn(16 // tp.size if sp else 16, 2, 32)
        if not sp:
            x = _gathered(x, tp)[0]  # a replicated input
        out = _gathered(layer(x), tp)
        if sp:  # sequence slices: masks differ, so no two slices' outputs are alike
            assert not torch.allclose(out[0], out[1])
        else:  # the residual-dropout masks agree: the replicated output is identical
            assert all(torch.equal(o, out[0]) for o in out)


def _check_model(rank: int, world_size: int) -> None:
    tp = Group(None, world_size, rank)
    _check_dropout_streams(tp)
    for family, options in FAMILIES.items():
        for sp in (False, True):
            cfg = _model_cfg(options)
            ref = GPT(cfg, seed=5)
            model = GPT(cfg, seed=5, tp=tp, sequence_parallel=sp)
            for name, p in model.named_parameters():  # identical start, any layout
                r = dict(ref.named_parameters())[name]
                assert_rel(
                    full_tensor(p, shard_spec(p), tp),
                    _unpadded(r, r),
                    f"{family} sp={sp} init {name}",
                    tol=1e-7,
                )
            # Adam divides by sqrt(v) + eps: with eps = 1e-8 a gradient at rounding level
            # becomes a full-size step whose sign is noise; 1e-6 keeps rounding as rounding.
            opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
            torch.manual_seed(7)
            for step in range(3):
                tokens = torch.randint(0, cfg.vocab_size, (2, 17))
                loss_ref = ref(tokens[:, :-1], tokens[:, 1:])
                loss = model(tokens[:, :-1], tokens[:, 1:])
                assert_rel(loss, loss_ref, f"{family} sp={sp} loss at step {step}")
                loss_ref.backward()
                loss.backward()
                # The replicated weights' partial gradients (norms under sp; q/k norms always).
                reduce_sequence_parallel_grads(model, model.roles, tp)
                norm_ref = clip_gradients(ref, ref.roles, 0.5, Group.single())
                norm = clip_gradients(model, model.roles, 0.5, tp)
                assert_rel(norm, norm_ref, f"{family} sp={sp} grad norm")
                if step == 0:
                    ref_grads = {n: _unpadded(p.grad, p) for n, p in ref.named_parameters()}
                    degenerate = {n for n, g in ref_grads.items() if g.abs().max() < 1e-7}
                    for name, p in model.named_parameters():
                        assert_rel(
                            full_tensor(p.grad, shard_spec(p), tp),
                            ref_grads[name],
                            f"{family} sp={sp} grad {name}",
                        )
                opt_ref.step(), opt.step()
                opt_ref.zero_grad(), opt.zero_grad()
            _compare_params(model, ref, tp, degenerate, f"{family} sp={sp} after 3 steps")
            # Generation path: full logits, padding dropped.
            with torch.no_grad():
                tokens = torch.randint(0, cfg.vocab_size, (1, 16))
                assert_rel(model.eval()(tokens), ref.eval()(tokens), f"{family} logits")


@pytest.mark.parametrize("tp", [2, 4])
def test_model_matches_single_process(tp: int) -> None:
    run_ranks(_check_model, tp)
