"""`ptdp convert`: GPT-2, Llama, Qwen3 and MoE checkpoints to and from `transformers`, checked
by logits."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ptdp import checkpoint as ckpt
from ptdp.checkpoint import full_model_state
from ptdp.cli import main
from ptdp.config.files import apply_updates, load_toml
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.convert.hf import export_hf, fuse_qkv, import_hf, split_qkv
from ptdp.errors import ConfigError
from ptdp.model.gpt import GPT
from ptdp.parallel.comm import Group
from ptdp.sample import load_model
from ptdp.train.run import train
from tests.helpers import LLAMA

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install .[hf])")
pytest.importorskip("safetensors", reason="needs safetensors (pip install .[hf])")

SHAPE = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 16, "vocab_size": 64}
LLAMA31 = {"rope_scaling": "llama3", "rope_theta": 500.0, "rope_original_max_positions": 32}
"""Llama 3.1's scaling on a context where every band shows: head size 8, theta 500 gives
wavelengths 6.3 (kept: < 32/4), 30 (blended) and 140, 660 (slowed: > 32/1)."""
YARN = {"rope_scaling": "yarn", "rope_theta": 500.0, "rope_original_max_positions": 32}
YARN |= {"rope_scaling_factor": 4.0}
"""YaRN on the same context: of the 4 pairs, the first kept, the second blended, the last
two slowed 4x; the rotated queries and keys scaled by 0.1 ln 4 + 1."""
MOE = LLAMA | {"num_experts": 4, "moe_top_k": 2, "moe_softmax_after_topk": True}
MOE |= {"ffn_hidden_size": 24}
"""Mixtral: four experts of width 24, two per token, softmax over the chosen logits."""
QWEN3_MOE = LLAMA | {"qk_norm": True, "head_size": 12, "num_experts": 4, "moe_top_k": 3}
QWEN3_MOE |= {"moe_renormalize": True, "moe_ffn_hidden_size": 16, "moe_first_dense_layers": 1}
"""Qwen3-MoE: a dense first layer (mlp_only_layers), then experts of width 16."""
MLA = LLAMA | {"attention": "mla", "q_lora_rank": 12, "kv_lora_rank": 16}
MLA |= {"qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 10}
"""Latent attention: queries from a 12-wide latent, keys and values from a 16-wide one,
heads of 6 + 4 query/key features and 10 value features."""
DEEPSEEK_V3 = MLA | {"num_experts": 8, "moe_top_k": 2, "moe_ffn_hidden_size": 12}
DEEPSEEK_V3 |= {"moe_score_function": "sigmoid", "moe_renormalize": True}
DEEPSEEK_V3 |= {"moe_routed_scaling": 2.5, "moe_shared_experts": 1, "moe_first_dense_layers": 1}
DEEPSEEK_V3 |= {"moe_router_groups": 4, "moe_router_group_top_k": 2}
DEEPSEEK_V3 |= {"moe_bias_update_rate": 0.001}
"""DeepSeek-V3: a dense first layer, then sigmoid routing in 4 groups (2 per token) with
its balancing bias, one shared expert."""
FAMILIES = {
    "gpt2": {},
    "gpt2-untied": {"tie_embeddings": False},
    "llama": LLAMA,  # grouped-query: 4 heads in 2 groups, untied
    "llama-tied-bias": LLAMA | {"tie_embeddings": True, "bias": True, "num_query_groups": 1},
    "llama3.1": LLAMA | LLAMA31,
    "mistral": LLAMA | {"sliding_window": 5},  # shorter than the 16-token sequence
    "qwen2": LLAMA | {"qkv_bias": True, "rope_theta": 1e6},
    "qwen2-tied-window": LLAMA | {"qkv_bias": True, "tie_embeddings": True, "sliding_window": 5},
    "qwen3": LLAMA | {"qk_norm": True, "head_size": 12},  # 4 heads of 12 in a 32-wide model
    "qwen3-window": LLAMA | {"qk_norm": True, "sliding_window": 5},
    "qwen3-yarn": LLAMA | {"qk_norm": True} | YARN,
    "llama-yarn-mscale": LLAMA | YARN | {"rope_mscale": 1.0, "rope_mscale_all_dim": 0.5},
    "mixtral": MOE,
    "mixtral-renormalize": MOE | {"moe_softmax_after_topk": False, "moe_renormalize": True},
    "qwen3_moe": QWEN3_MOE,
    "qwen3_moe-softmax-after": QWEN3_MOE | {"moe_softmax_after_topk": True},
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v3-mtp": DEEPSEEK_V3 | {"mtp_depth": 2},  # layers 2 and 3: transformers skips
    "deepseek_v3-dense-yarn": MLA | {"q_lora_rank": 0} | YARN | {"rope_mscale_all_dim": 1.0},
    "deepseek_v2": DEEPSEEK_V3
    | {"moe_score_function": "softmax", "moe_router_groups": 0}
    | {"moe_router_group_top_k": 0, "moe_bias_update_rate": 0.0, "moe_renormalize": False},
}
KINDS = {k: k for k in ("gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")}
KINDS |= {"deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v2"}
TOL = 1e-5


def _model_config(**options: object) -> ModelConfig:
    """Options coerced as a TOML file's would be (strings to enums)."""
    return apply_updates(RunConfig(), {"model": SHAPE | options}, "a test").model


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from init (norm gains and biases included), so a layout slip shows."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _tokens(vocab: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, seq), generator=torch.Generator().manual_seed(7))


def _compare(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    assert ours.std() > 0.3  # not a vacuous comparison of near-zero logits
    assert (ours - theirs).abs().max().item() < TOL


def full_state(model: GPT) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: full shapes, without the padded vocabulary rows."""
    return full_model_state([model], Group.single())


def _write_checkpoint(run_dir: Path, cfg: ModelConfig, model: GPT, tokenizer: str) -> Path:
    run_cfg = replace(RunConfig(), model=cfg)
    state = {"model": full_state(model), "step": 1, "tokenizer": tokenizer}
    return ckpt.save_checkpoint(run_dir, 1, state, run_cfg, None)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_matches_transformers(family: str, tmp_path: Path) -> None:
    cfg = _model_config(**FAMILIES[family])
    model = GPT(cfg, seed=3)
    _randomize(model, 3)
    _write_checkpoint(tmp_path / "run", cfg, model, "bytes")
    assert main(["convert", "--to", "hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert not (tmp_path / "hf" / "tokenizer.json").exists()  # the byte tokenizer has none
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    kind = KINDS[family.split("-")[0].removesuffix("3.1")]
    assert hf.config.model_type == kind
    tokens = _tokens(cfg.vocab_size, cfg.seq_length)
    with torch.no_grad():
        _compare(model.eval()(tokens), hf(tokens).logits)


ROTARY = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16,
    "rms_norm_eps": 1e-5,
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500.0,
}
YARN_SCALING = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500.0,
}
DEEPSEEK = ROTARY | {"num_key_value_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 6}
DEEPSEEK |= {"qk_rope_head_dim": 4, "v_head_dim": 10, "n_routed_experts": 8, "n_shared_experts": 1}
DEEPSEEK |= {"num_experts_per_tok": 2, "moe_intermediate_size": 12, "first_k_dense_replace": 1}
HF_FAMILIES = {
    "gpt2": lambda v: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=24, vocab_size=v,
                                n_inner=48)
    ),
    "llama": lambda v: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**ROTARY, vocab_size=v, rope_theta=500.0)
    ),
    "llama3.1": lambda v: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**ROTARY, vocab_size=v, rope_scaling=LLAMA3_SCALING)
    ),
    "mistral": lambda v: transformers.MistralForCausalLM(
        transformers.MistralConfig(**ROTARY, vocab_size=v, sliding_window=5)
    ),
    "qwen2": lambda v: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**ROTARY, vocab_size=v, rope_theta=1e6)
    ),
    "qwen2-tied": lambda v: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**ROTARY, vocab_size=v, tie_word_embeddings=True)
    ),
    "qwen2-window": lambda v: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            **ROTARY, vocab_size=v, use_sliding_window=True, sliding_window=5, max_window_layers=0
        )
    ),
    "qwen3": lambda v: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**ROTARY, vocab_size=v, head_dim=12)
    ),
    "qwen3-yarn": lambda v: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**ROTARY, vocab_size=v, head_dim=12, rope_scaling=YARN_SCALING)
    ),
    "llama-yarn-mscale": lambda v: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**ROTARY, vocab_size=v, rope_scaling=YARN_SCALING
                                 | {"mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0})
    ),
    "mixtral": lambda v: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**ROTARY, vocab_size=v, num_local_experts=4,
                                   num_experts_per_tok=2)
    ),
    "mixtral-window": lambda v: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**ROTARY, vocab_size=v, num_local_experts=4,
                                   num_experts_per_tok=2, sliding_window=5)
    ),
    "qwen3_moe": lambda v: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**ROTARY, vocab_size=v, head_dim=12, num_experts=4,
                                    num_experts_per_tok=3, moe_intermediate_size=16,
                                    norm_topk_prob=True, mlp_only_layers=[0])
    ),
    "deepseek_v3": lambda v: transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**DEEPSEEK, vocab_size=v, q_lora_rank=12, n_group=4,
                                      topk_group=2, routed_scaling_factor=2.5,
                                      rope_scaling=YARN_SCALING | {"mscale": 1.0,
                                                                   "mscale_all_dim": 1.0})
    ),
    "deepseek_v2": lambda v: transformers.DeepseekV2ForCausalLM(
        transformers.DeepseekV2Config(**DEEPSEEK, vocab_size=v, q_lora_rank=None,
                                      topk_method="greedy", norm_topk_prob=False)
    ),
    "qwen3_moe-step": lambda v: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**ROTARY | {"num_hidden_layers": 4}, vocab_size=v,
                                    num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=16, decoder_sparse_step=2)
    ),
}  # fmt: skip
"""Tiny random `transformers` models; the rotary ones with grouped-query attention."""


def _hf_model(family: str, vocab_size: int = 64) -> torch.nn.Module:
    model = HF_FAMILIES[family](vocab_size)
    _randomize(model, 5)
    return model.eval()


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_import_matches_transformers(family: str, tmp_path: Path) -> None:
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    result = import_hf(tmp_path / "hf", tmp_path / "run", seq_length=16)
    assert result.path == ckpt.find_checkpoint(tmp_path / "run")
    assert result.family == family.split("-")[0].removesuffix("3.1")
    model = load_model(result.path).eval()
    assert model.cfg.seq_length == 16
    if family == "deepseek_v3":  # transformers names an MTP layer it does not save
        assert model.cfg.mtp_depth == 0
        assert "names 1 multi-token-prediction layer(s), of which 1 were not read" in str(
            result.notes
        )
    tokens = _tokens(64, 16)
    with torch.no_grad():
        ours = model(tokens)
        _compare(ours, hf(tokens).logits)
    state = ckpt.load_checkpoint(result.path)
    assert state["step"] == 0 and state["optimizer"]["state"] == {}
    # The run's config.toml is the checkpoint's, so `ptdp train --config` resumes it.
    assert load_toml(tmp_path / "run" / "config.toml") == ckpt.load_config(result.path)
    # Each family's own option is live: without it the logits are not the same.
    cfg = model.cfg
    own = {"llama3.1": {"rope_scaling": "none"}, "mistral": {"sliding_window": 0}}
    own |= {"qwen2-window": {"sliding_window": 0}, "mixtral-window": {"sliding_window": 0}}
    own |= {"qwen3": {"qk_norm": False}, "qwen3_moe": {"moe_renormalize": False}}
    own |= {"qwen3-yarn": {"rope_scaling": "llama3"}}
    own |= {"llama-yarn-mscale": {"rope_mscale": 0.0, "rope_mscale_all_dim": 0.0}}
    own |= {"deepseek_v3": {"rope_mscale": 0.0, "rope_mscale_all_dim": 0.0}}
    if family in own:
        plain = apply_updates(RunConfig(model=cfg), {"model": own[family]}, "a test").model
        other = GPT(plain)
        other.load_state_dict(model.state_dict(), strict=family != "qwen3")  # q/k norms
        with torch.no_grad():
            assert (other.eval()(tokens) - ours).abs().max() > 100 * TOL
    # And back: `transformers` loads the export with the same logits.
    export_hf(tmp_path / "run", tmp_path / "back")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again) is type(hf)
    with torch.no_grad():
        _compare(again(tokens).logits, ours)


def test_training_starts_from_an_import(tiny_data: str, tmp_path: Path, capsys) -> None:
    _hf_model("llama", vocab_size=257).save_pretrained(tmp_path / "hf")  # the bytes vocabulary
    run = tmp_path / "run"
    assert main(["convert", "--from", "hf", str(tmp_path / "hf"), str(run)]) == 0
    # Any layout resolves from the imported config (checked here for tp=2, pp=2).
    args = ["train", "--config", str(run / "config.toml"), "--data.path", tiny_data]
    layout = ["--parallel.tp", "2", "--parallel.pp", "2", "--dry-run", "--world-size", "4"]
    assert main(args + layout) == 0
    assert "tp=2" in capsys.readouterr().out.replace(" ", "")
    updates = {
        "data": {"path": tiny_data},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "train": {"steps": 2, "micro_batch_size": 4, "global_batch_size": 8, "device": "cpu"},
    }
    result = train(apply_updates(load_toml(run / "config.toml"), updates, "a test"), resume=True)
    assert (result.start_step, result.final_step) == (0, 2)
    before = ckpt.load_checkpoint(run / "checkpoints" / "step_00000000")["model"]
    after = ckpt.load_checkpoint(ckpt.find_checkpoint(run))["model"]
    assert after.keys() == before.keys()
    for name in before:  # two small AdamW steps from the imported weights, not a fresh init
        assert 0 < (after[name] - before[name]).abs().max() < 0.01, name


@pytest.mark.parametrize(
    "options", [LLAMA, DEEPSEEK_V3 | {"mtp_depth": 2, "num_query_groups": 0}], ids=["llama", "mtp"]
)
def test_round_trip_keeps_weights(tmp_path: Path, options: dict) -> None:
    # DeepSeek-V3 with two multi-token-prediction modules, written as its layers 2 and 3
    # (each with copies of the embedding and output layer) and read back.
    cfg = _model_config(**options)
    model = GPT(cfg, seed=4)
    _write_checkpoint(tmp_path / "a", cfg, model, "bytes")
    export_hf(tmp_path / "a", tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "b")
    back = ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path / "b"))["model"]
    want = full_state(model) | model.state_buffers()  # the routers' balancing biases
    assert back.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(back[name], value, rtol=0, atol=0)
    assert ckpt.load_config(ckpt.find_checkpoint(tmp_path / "b")).model == cfg


def test_qkv_split_is_group_by_group() -> None:
    cfg = _model_config(num_query_groups=2)  # 2 query heads per group, d = 8
    rows = torch.arange(2 * (2 + 2) * 8)
    q, k, v = split_qkv(rows, cfg)
    assert q[:16].tolist() == list(range(16))  # group 0's two query heads
    assert k[:8].tolist() == list(range(16, 24)) and v[:8].tolist() == list(range(24, 32))
    assert q[16:].tolist() == list(range(32, 48))
    assert torch.equal(fuse_qkv(q, k, v, cfg), rows)


def test_tokenizer_is_exported(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "to", "be", "or", "not", "[UNK]"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    cfg = _model_config()
    step_dir = _write_checkpoint(tmp_path / "run", cfg, GPT(cfg, seed=1), "tokenizer.json")
    tok.save(str(step_dir / "tokenizer.json"))
    export_hf(tmp_path / "run", tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok("to be or not")["input_ids"] == [1, 2, 3, 4]
    assert hf_tok.eos_token == "<|endoftext|>"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == 0
    # And back: the imported run records the tokenizer for `ptdp generate`.
    import_hf(tmp_path / "hf", tmp_path / "back")
    back = ckpt.find_checkpoint(tmp_path / "back")
    assert ckpt.load_checkpoint(back)["tokenizer"] == "tokenizer.json"
    assert (back / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    "options,named",
    [
        ({"bias": False}, "model.bias"),
        ({"normalization": "rmsnorm"}, "model.normalization"),
        ({"num_query_groups": 2}, "model.num_query_groups"),
        ({**LLAMA, "activation": "gelu"}, "model.activation"),
        ({**LLAMA, "sliding_window": 4, "bias": True}, "Mistral, .* model.bias = true"),
        ({"sliding_window": 4}, "model.sliding_window = 4"),
        (MOE | {"moe_shared_experts": 1}, "model.moe_shared_experts = 1 .*it needs 0"),
        (MOE | {"moe_score_function": "sigmoid"}, "model.moe_score_function = sigmoid"),
        (MOE | {"moe_bias_update_rate": 0.001}, "model.moe_bias_update_rate"),
        (MOE | {"moe_routed_scaling": 2.5}, "model.moe_routed_scaling = 2.5"),
        (MOE | {"moe_softmax_after_topk": False}, "Mixtral, .*model.moe_renormalize = false"),
        (MOE | {"moe_first_dense_layers": 1}, "Mixtral, .*model.moe_first_dense_layers = 1"),
        (MOE | {"bias": True}, "model.bias = true"),
        ({"head_size": 4}, "GPT-2, .*model.head_size = 4"),
        (DEEPSEEK_V3 | {"tie_embeddings": True}, "DeepSeek-V3, .*model.tie_embeddings = true"),
        (DEEPSEEK_V3 | {"moe_shared_experts": 0}, "DeepSeek-V3, .*model.moe_shared_experts = 0"),
        (LLAMA | {"qk_norm": True, "qkv_bias": True}, "Qwen3, .*model.qkv_bias = true"),
    ],
)
def test_export_refuses_options_without_equivalent(
    options: dict, named: str, tmp_path: Path
) -> None:
    cfg = _model_config(**options)
    _write_checkpoint(tmp_path / "run", cfg, GPT(cfg, seed=1), "bytes")
    with pytest.raises(ConfigError, match=named):
        export_hf(tmp_path / "run", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "family,change,named",
    [
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                       "attention_factor": 1.5}}, "attention_factor"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
                   "layer_types": ["full_attention", "sliding_attention"]}, "layer_types mixing"),
    ],
)  # fmt: skip
def test_import_refuses_what_ptdp_lacks(
    family: str, change: dict, named: str, tmp_path: Path
) -> None:
    _hf_model(family).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ConfigError, match=named):
        import_hf(tmp_path / "hf", tmp_path / "run")


def test_import_refuses_exact_gelu(tmp_path: Path) -> None:
    hf = _hf_model("gpt2")
    hf.config.activation_function = "gelu"
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match="activation_function"):
        import_hf(tmp_path / "hf", tmp_path / "run")
    assert main(["convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 2


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_import_reads_fused_experts(family: str, tmp_path: Path) -> None:
    """transformers 5 can save experts as fused [e, 2f, h] gate_up_proj and [e, h, f]
    down_proj tensors; they import to the same weights as one module per expert."""
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path / "split")
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    states = []
    for name in ("split", "fused"):
        import_hf(tmp_path / name, tmp_path / f"run-{name}")
        states.append(ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path / f"run-{name}"))["model"])
    assert states[0].keys() == states[1].keys()
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]), key


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_imported_moe_generates_as_transformers(family: str, tmp_path: Path) -> None:
    """Greedy generation (ptdp's KV cache) of an imported MoE model picks transformers'
    tokens."""
    from ptdp.model.generate import generate

    hf = _hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    model = load_model(import_hf(tmp_path / "hf", tmp_path / "run").path).eval()
    prompt = _tokens(64, 5)
    ours = generate(model, prompt, 8, temperature=0.0)
    theirs = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0,
                         eos_token_id=None, attention_mask=torch.ones_like(prompt))  # fmt: skip
    assert ours.shape == (3, 13)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    "family,change,named",
    [
        ("mixtral", {"model_type": "qwen2_moe"}, "'qwen2_moe' .*shared_expert_gate"),
        ("mixtral", {"model_type": "phimoe"}, "'phimoe' .*converts .*'mixtral'"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func = 'softmax'"),
        ("deepseek_v3", {"rope_interleave": False}, "rope_interleave = false"),
        ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
         "topk_method = 'group_limited_greedy'"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise = 0.1"),
        ("qwen3_moe", {"attention_bias": True}, "attention_bias = True"),
        ("qwen3_moe-step", {"mlp_only_layers": [2], "decoder_sparse_step": 1},
         "mlp_only_layers and decoder_sparse_step = \\(\\[2\\], 1\\)"),  # MoE: 0, 1, 3
    ],
)  # fmt: skip
def test_import_refuses_moe_configs_ptdp_lacks(
    family: str, change: dict, named: str, tmp_path: Path
) -> None:
    _hf_model(family).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ConfigError, match=named):
        import_hf(tmp_path / "hf", tmp_path / "run")


def test_import_refuses_a_router_bias(tmp_path: Path) -> None:
    import safetensors.torch

    _hf_model("mixtral").save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    tensors = safetensors.torch.load_file(file)
    tensors["model.layers.0.block_sparse_moe.gate.bias"] = torch.zeros(4)
    safetensors.torch.save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="router with a bias.*gate.bias"):
        import_hf(tmp_path / "hf", tmp_path / "run")


def _block_quantized(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, per-block scales) as DeepSeek-V3's published weights hold them."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[: w.shape[0], : w.shape[1]] = w
    amax = padded.view(rows, block, cols, block).abs().amax((1, 3)).clamp_min(1e-6)
    scale = amax / 448.0
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: w.shape[0], : w.shape[1]]
    return (w / full).to(torch.float8_e4m3fn), scale


def test_import_reads_float8_blocks_the_bias_and_mtp(tmp_path: Path) -> None:
    """A DeepSeek-V3 checkpoint as published: float8 weights with 8 x 8 block scales here
    (128 x 128 there), the routers' balancing bias, and a multi-token-prediction layer after
    the last; ptdp's import computes what transformers computes on the dequantized weights."""
    import safetensors.torch

    hf = _hf_model("deepseek_v3")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.randn(8, generator=gen))
    hf.save_pretrained(tmp_path / "ref")
    tensors = safetensors.torch.load_file(tmp_path / "ref" / "model.safetensors")
    # The MTP layer after the last (layer 2): an MoE layer like layer 1, its norms, its
    # projection [2h -> h] and its copies of the embedding and output layer.
    for name, w in list(tensors.items()):
        if name.startswith("model.layers.1."):
            tensors[name.replace("layers.1.", "layers.2.")] = w.clone()
    mtp = "model.layers.2."
    tensors[mtp + "eh_proj.weight"] = torch.randn(32, 64, generator=gen)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{mtp}{name}.weight"] = 1 + 0.1 * torch.randn(32, generator=gen)
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    quantized, dequantized = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.endswith("proj.weight") and w.dim() == 2:
            values, scale = _block_quantized(w, 8)
            quantized[name], quantized[name + "_scale_inv"] = values, scale
            full = scale.repeat_interleave(8, 0).repeat_interleave(8, 1)
            dequantized[name] = values.float() * full[: w.shape[0], : w.shape[1]]
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    (tmp_path / "fp8").mkdir()
    safetensors.torch.save_file(quantized, tmp_path / "fp8" / "model.safetensors")
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [8, 8]}
    config |= {"quantization_config": fp8, "num_nextn_predict_layers": 1}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    safetensors.torch.save_file(dequantized, tmp_path / "ref" / "model.safetensors")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref").eval()
    result = import_hf(tmp_path / "fp8", tmp_path / "run")
    said = "\n".join(result.notes)  # what `ptdp convert` prints as notes
    assert "float8 weights were dequantized to float32 with their 8x8 block scales" in said
    assert "1 multi-token-prediction layer(s) from model.layers.2 became model.mtp_depth" in said
    assert "model.moe_bias_update_rate = 0.001" in said
    model = load_model(result.path).eval()
    assert model.cfg.mtp_depth == 1
    torch.testing.assert_close(model.mtp["1"].eh_proj.weight, dequantized[mtp + "eh_proj.weight"])
    torch.testing.assert_close(model.mtp["1"].norm.weight, tensors[mtp + "shared_head.norm.weight"])
    bias = model.layers["1"].mlp.router.expert_bias
    assert torch.equal(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    tokens = _tokens(64, 16)
    with torch.no_grad():
        ours = model(tokens)
        _compare(ours, reference(tokens).logits)
        assert (ours - hf(tokens).logits).abs().max() > 100 * TOL  # float8 is not lossless
