"""Hugging Face `transformers` export and import of ptdp checkpoints (`ptdp convert`).

Seven families map one to one: GPT-2 (`GPT2LMHeadModel`: learned positions, LayerNorm,
tanh GeLU, biases, multi-head attention), Llama (`LlamaForCausalLM`: rotary, RMSNorm,
SwiGLU, grouped-query attention, optional biases, Llama 3.1's rotary scaling), Mistral
(`MistralForCausalLM`: Llama with a sliding attention window), Qwen2 / Qwen2.5
(`Qwen2ForCausalLM`: Llama with a bias on the query, key and value projections only),
Qwen3 (`Qwen3ForCausalLM`: Llama with per-head q/k RMSNorm, model.qk_norm, and a head size
of its own, model.head_size), and two mixtures of experts: Mixtral (`MixtralForCausalLM`:
Mistral whose every MLP is a router `block_sparse_moe.gate` and experts w1 = gate, w3 = up,
w2 = down; softmax over the top-k logits) and Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3 with
`mlp.gate` and experts gate_proj/up_proj/down_proj; softmax, top-k, norm_topk_prob).
The rotary families share their tensor names. A ptdp option outside all of them is
refused with the option's name, never silently dropped.

What the mapping has to know (shapes: h hidden, n query heads, g key/value groups,
r = n / g, d head size, f MLP width, v vocabulary):
- ptdp's fused QKV weight [g * (r + 2) * d, h] holds its rows group by group, [q heads of
  group 0, k0, v0, q heads of group 1, ...] (model/attention.py); query head i reads group
  i // r, which is also how `transformers` repeats k/v heads, so only rows move.
- GPT-2's `Conv1D` stores weights as [in, out], the transpose of `nn.Linear`.
- ptdp's SwiGLU fc1 rows are [gate; up] (an expert's too: fc1 [e, 2f, h], fc2 [e, h, f],
  which is `transformers` 5's fused gate_up_proj / down_proj); ptdp's GeLU is the tanh
  approximation, which `transformers` calls "gelu_pytorch_tanh" (the same
  `F.gelu(approximate="tanh")`).
- Checkpoints hold full, unpadded fp32 tensors under global names, whatever the layout
  they were trained in (checkpoint/full.py), so tensor-parallel vocabulary padding and
  pipeline stages never appear here.

Configs map in convert/hf_config.py. Only `safetensors` is needed to convert; `transformers`
is needed to load the result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ptdp import checkpoint as ckpt
from ptdp.config.enums import PositionEmbedding
from ptdp.config.files import to_dict, to_toml
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.convert.hf_check import check_config_numbers, check_hf_shapes
from ptdp.convert.hf_config import family, hf_config, model_config_from_hf
from ptdp.convert.hf_files import (
    INDEX_FILE,
    WEIGHTS_FILE,
    check_export_dir,
    read_hf_config,
    read_hf_json,
    weight_files,
    weight_shapes,
)
from ptdp.errors import CheckpointError, ConfigError
from ptdp.files import replacing, write_file
from ptdp.outputs import check_output_dir, make_output_dir, refuse_empty

TOKENIZER_FILE = "tokenizer.json"
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
"""Buffers some `transformers` checkpoints carry that hold no weights."""

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ConvertResult:
    """Where a conversion wrote, and what a user should know about it."""

    path: Path
    family: str
    notes: tuple[str, ...] = ()


# ---------------------------------------------------------------------- weights


def split_qkv(w: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """ptdp's grouped QKV rows -> q [n*d, ...], k [g*d, ...], v [g*d, ...] (weight or bias)."""
    g, d = cfg.query_groups, cfg.head_dim
    r = cfg.num_heads // g
    blocks = w.unflatten(0, (g, r + 2, d))
    return blocks[:, :r].flatten(0, 2), blocks[:, r].flatten(0, 1), blocks[:, r + 1].flatten(0, 1)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Inverse of `split_qkv`."""
    g, d = cfg.query_groups, cfg.head_dim
    r = cfg.num_heads // g
    parts = [q.unflatten(0, (g, r, d)), k.unflatten(0, (g, 1, d)), v.unflatten(0, (g, 1, d))]
    return torch.cat(parts, dim=1).flatten(0, 2)


def _suffixes(cfg: ModelConfig, linear: str) -> tuple[str, ...]:
    """The tensors of one linear layer: its weight, and its bias where the model has one
    (every linear layer with model.bias, only QKV with model.qkv_bias)."""
    with_bias = cfg.bias or (cfg.qkv_bias and linear == "attn.qkv")
    return (".weight", ".bias") if with_bias else (".weight",)


def _conv1d(x: torch.Tensor, suffix: str) -> torch.Tensor:
    """GPT-2's Conv1D holds weights as [in, out], nn.Linear as [out, in]; biases agree."""
    return x.t() if suffix == ".weight" else x


GPT2_LINEARS = (("attn.proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj"))
"""ptdp's names of GPT-2's linear layers after QKV, and `transformers`' (Conv1D)."""
EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
"""Per family: the MoE block's module and each expert's gate, up and down projections, as
published checkpoints (and `save_pretrained`) name them."""


def to_hf_state(cfg: ModelConfig, model: Tensors) -> Tensors:
    """ptdp's full model state -> `transformers` tensor names and layouts."""
    kind = family(cfg)
    gpt2 = kind == "gpt2"
    out: Tensors = {}
    pre = "transformer." if gpt2 else "model."
    out[pre + ("wte.weight" if gpt2 else "embed_tokens.weight")] = model["embedding.weight"]
    if gpt2:
        out["transformer.wpe.weight"] = model["position.weight"]
    for i in range(cfg.num_layers):
        src = f"layers.{i}."
        dst = f"transformer.h.{i}." if gpt2 else f"model.layers.{i}."
        if gpt2:
            _gpt2_layer_to_hf(cfg, model, src, dst, out)
        else:
            _rotary_layer_to_hf(cfg, kind, i, model, src, dst, out)
        norms = ("ln_1", "ln_2") if gpt2 else ("input_layernorm", "post_attention_layernorm")
        for ours, theirs in zip(("norm1", "norm2"), norms):
            for sfx in (".weight", ".bias") if gpt2 else (".weight",):
                out[dst + theirs + sfx] = model[src + ours + sfx]
    for sfx in (".weight", ".bias") if gpt2 else (".weight",):
        out[pre + ("ln_f" if gpt2 else "norm") + sfx] = model["final_norm" + sfx]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = model["output.weight"]
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


def _gpt2_layer_to_hf(cfg: ModelConfig, model: Tensors, src: str, dst: str, out: Tensors) -> None:
    for sfx in _suffixes(cfg, "attn.qkv"):  # Conv1D holds [in, out]
        qkv = torch.cat(split_qkv(model[src + "attn.qkv" + sfx], cfg))
        out[dst + "attn.c_attn" + sfx] = _conv1d(qkv, sfx)
    for sfx in _suffixes(cfg, "attn.proj"):
        for ours, theirs in GPT2_LINEARS:
            out[dst + theirs + sfx] = _conv1d(model[src + ours + sfx], sfx)


def _rotary_layer_to_hf(
    cfg: ModelConfig, kind: str, i: int, model: Tensors, src: str, dst: str, out: Tensors
) -> None:
    for sfx in _suffixes(cfg, "attn.qkv"):
        q, k, v = split_qkv(model[src + "attn.qkv" + sfx], cfg)
        for name, x in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)):
            out[dst + "self_attn." + name + sfx] = x
    if cfg.qk_norm:
        for name in ("q_norm", "k_norm"):
            out[dst + f"self_attn.{name}.weight"] = model[src + f"attn.{name}.weight"]
    for sfx in _suffixes(cfg, "attn.proj"):
        out[dst + "self_attn.o_proj" + sfx] = model[src + "attn.proj" + sfx]
    if cfg.is_moe_layer(i):
        block, (w_gate, w_up, w_down) = EXPERT_NAMES[kind]
        out[dst + f"{block}.gate.weight"] = model[src + "mlp.router.weight"]
        fc1, fc2 = model[src + "mlp.experts.fc1.weight"], model[src + "mlp.experts.fc2.weight"]
        for j in range(cfg.num_experts):
            gate, up = fc1[j].chunk(2)
            expert = dst + f"{block}.experts.{j}."
            for name, x in zip((w_gate, w_up, w_down), (gate, up, fc2[j])):
                out[expert + name + ".weight"] = x
        return
    for sfx in _suffixes(cfg, "mlp.fc1"):
        gate, up = model[src + "mlp.fc1" + sfx].chunk(2)
        down = model[src + "mlp.fc2" + sfx]
        for name, x in zip(("gate_proj", "up_proj", "down_proj"), (gate, up, down)):
            out[dst + "mlp." + name + sfx] = x


class _Taker:
    """Reads tensors by name, remembering which were used, to report any left over."""

    def __init__(self, tensors: Tensors, strip: str) -> None:
        self.tensors = {k.removeprefix(strip): v for k, v in tensors.items()}
        self.used: set[str] = set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"the Hugging Face weights lack {name!r}")
        self.used.add(name)
        return self.tensors[name].float()

    def check_all_used(self, tied: bool) -> None:
        left = [
            k
            for k in self.tensors.keys() - self.used
            if not k.endswith(IGNORED_SUFFIXES) and not (tied and k == "lm_head.weight")
        ]
        if left:
            router_bias = [k for k in left if k.endswith("gate.bias")]
            hint = " (a router with a bias, which ptdp's router lacks)" if router_bias else ""
            raise ConfigError(
                f"the Hugging Face weights hold tensors ptdp has no place for{hint}: "
                f"{sorted(left)}; the model is not one ptdp converts"
            )


def from_hf_state(cfg: ModelConfig, tensors: Tensors) -> Tensors:
    """`transformers` weights -> ptdp's full model state (inverse of `to_hf_state`)."""
    gpt2 = cfg.position_embedding is PositionEmbedding.LEARNED
    take = _Taker(tensors, "transformer." if gpt2 else "")
    model: Tensors = {}
    if gpt2:
        model["embedding.weight"] = take("wte.weight")
        model["position.weight"] = take("wpe.weight")[: cfg.seq_length]
    else:
        model["embedding.weight"] = take("model.embed_tokens.weight")
    for i in range(cfg.num_layers):
        src = f"h.{i}." if gpt2 else f"model.layers.{i}."
        dst = f"layers.{i}."
        if gpt2:
            for sfx in _suffixes(cfg, "attn.qkv"):
                q, k, v = _conv1d(take(src + "attn.c_attn" + sfx), sfx).chunk(3)
                model[dst + "attn.qkv" + sfx] = fuse_qkv(q, k, v, cfg)
            for sfx in _suffixes(cfg, "attn.proj"):
                for ours, theirs in GPT2_LINEARS:
                    model[dst + ours + sfx] = _conv1d(take(src + theirs + sfx), sfx)
        else:
            _rotary_layer_from_hf(cfg, i, take, src, dst, model)
        norms = ("ln_1", "ln_2") if gpt2 else ("input_layernorm", "post_attention_layernorm")
        for ours, theirs in zip(("norm1", "norm2"), norms):
            for sfx in (".weight", ".bias") if gpt2 else (".weight",):
                model[dst + ours + sfx] = take(src + theirs + sfx)
    for sfx in (".weight", ".bias") if gpt2 else (".weight",):
        model["final_norm" + sfx] = take(("ln_f" if gpt2 else "model.norm") + sfx)
    if not cfg.tie_embeddings:
        model["output.weight"] = take("lm_head.weight")
    take.check_all_used(cfg.tie_embeddings)
    return {k: v.contiguous().clone() for k, v in model.items()}


def _rotary_layer_from_hf(
    cfg: ModelConfig, i: int, take: _Taker, src: str, dst: str, model: Tensors
) -> None:
    for sfx in _suffixes(cfg, "attn.qkv"):
        q, k, v = (take(src + "self_attn." + m + sfx) for m in ("q_proj", "k_proj", "v_proj"))
        model[dst + "attn.qkv" + sfx] = fuse_qkv(q, k, v, cfg)
    if cfg.qk_norm:
        for name in ("q_norm", "k_norm"):
            model[dst + f"attn.{name}.weight"] = take(src + f"self_attn.{name}.weight")
    for sfx in _suffixes(cfg, "attn.proj"):
        model[dst + "attn.proj" + sfx] = take(src + "self_attn.o_proj" + sfx)
    if cfg.is_moe_layer(i):
        model |= _experts_from_hf(cfg, take, src, dst)
        return
    for sfx in _suffixes(cfg, "mlp.fc1"):
        gate, up, down = (take(f"{src}mlp.{m}{sfx}") for m in ("gate_proj", "up_proj", "down_proj"))
        model[dst + "mlp.fc1" + sfx] = torch.cat([gate, up])
        model[dst + "mlp.fc2" + sfx] = down


def _experts_from_hf(cfg: ModelConfig, take: _Taker, src: str, dst: str) -> Tensors:
    """One MoE block: the router, and the experts either one module each (published
    checkpoints) or fused [e, 2f, h] `gate_up_proj` and [e, h, f] `down_proj` tensors
    (`transformers` 5's own modules, the layout of ptdp's fc1 and fc2)."""
    kind = "mixtral" if cfg.moe_softmax_after_topk and not cfg.qk_norm else "qwen3_moe"
    block, (w_gate, w_up, w_down) = EXPERT_NAMES[kind]
    if src + "mlp.experts.gate_up_proj" in take.tensors:
        block = "mlp"
        fc1, fc2 = take(src + "mlp.experts.gate_up_proj"), take(src + "mlp.experts.down_proj")
    else:
        experts = [f"{src}{block}.experts.{j}." for j in range(cfg.num_experts)]
        fc1 = torch.stack(
            [torch.cat([take(e + w_gate + ".weight"), take(e + w_up + ".weight")]) for e in experts]
        )
        fc2 = torch.stack([take(e + w_down + ".weight") for e in experts])
    return {
        dst + "mlp.router.weight": take(src + f"{block}.gate.weight"),
        dst + "mlp.experts.fc1.weight": fc1,
        dst + "mlp.experts.fc2.weight": fc2,
    }


# ---------------------------------------------------------------------- files


def _safetensors():  # noqa: ANN202 - a module
    try:
        import safetensors.torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "converting to or from Hugging Face needs safetensors: pip install 'ptdp[hf]'"
        ) from exc
    return safetensors.torch


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The `transformers` tensors of `cfg` and their shapes: `to_hf_state` of the model
    built on the meta device (no memory), so the check follows the conversion's mapping."""
    from ptdp.checkpoint.full import full_model_state
    from ptdp.model.gpt import GPT
    from ptdp.parallel.comm import Group

    with torch.device("meta"):
        tensors = to_hf_state(cfg, full_model_state([GPT(cfg)], Group.single()))
    return {k: tuple(v.shape) for k, v in tensors.items()}


def check_hf_model(directory: Path, config: dict) -> None:
    """A model directory's config.json against its weights' shapes, before any conversion
    (`convert --from hf` and `checkpoint.init_from`; ptdp/convert/hf_check.py)."""
    check_config_numbers(directory, config)
    want = expected_hf_shapes(model_config_from_hf(config))  # every position, as stored
    check_hf_shapes(directory, config, weight_shapes(directory), want)


def read_hf_weights(directory: Path) -> Tensors:
    """A `transformers` model directory's weights: safetensors (one file or an index),
    each checked whole first (convert/hf_files.py), or pytorch_model.bin."""
    files = weight_files(directory)
    if files:
        tensors: Tensors = {}
        for file in files:
            try:
                tensors |= _safetensors().load_file(file)
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(
                    f"cannot read Hugging Face weights file {file} ({exc}); the file is "
                    "damaged: download or export the model again"
                ) from None
        return tensors
    if (directory / "pytorch_model.bin").is_file():
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise CheckpointError(
        f"{directory} holds no {WEIGHTS_FILE}, {INDEX_FILE} or pytorch_model.bin: "
        "is it a Hugging Face model directory (save_pretrained output)?"
    )


def _export_tokenizer(step_dir: Path, entry: str, out: Path, cfg: ModelConfig) -> list[str]:
    """Copy the checkpoint's tokenizer.json (with a tokenizer_config.json) into `out`."""
    if entry == "bytes":
        return [
            "no tokenizer written: the checkpoint uses ptdp's byte tokenizer (ids 0-255 are "
            "bytes, 256 ends a document), which has no tokenizer.json"
        ]
    if not entry:
        return ["no tokenizer written: the checkpoint records none"]
    from tokenizers import Tokenizer

    from ptdp.data.tokenizers import load_tokenizer

    write_file(out / TOKENIZER_FILE, (step_dir / entry).read_bytes())
    eod = Tokenizer.from_file(str(step_dir / entry)).id_to_token(
        load_tokenizer(step_dir / entry).eod_id
    )
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eod,
        "eos_token": eod,
        "model_max_length": cfg.seq_length,
    }
    write_file(out / "tokenizer_config.json", json.dumps(tok_config, indent=2) + "\n")
    return []


def export_hf(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False) -> ConvertResult:
    """Write a ptdp checkpoint (run, checkpoints or step directory) as a `transformers`
    model directory: config.json, model.safetensors (fp32), tokenizer.json when it has one.
    A directory that holds files is refused unless `overwrite`."""
    refuse_empty(out, "OUT")
    check_export_dir(Path(out), overwrite)
    step_dir = ckpt.find_checkpoint(checkpoint)
    cfg = ckpt.load_config(step_dir).model
    kind = family(cfg)  # refuse before reading the weights
    state = ckpt.load_checkpoint(step_dir)
    tensors = to_hf_state(cfg, state["model"])
    out = make_output_dir(out, "OUT")
    entry = state.get("tokenizer", "")
    notes = _export_tokenizer(step_dir, entry, out, cfg)
    if cfg.moe_capacity_factor:
        notes.append(
            f"model.moe_capacity_factor = {cfg.moe_capacity_factor} is not exported: "
            "transformers computes every token-choice, as ptdp does with the factor 0"
        )
    eod_id = None
    if entry:
        from ptdp.data.tokenizers import load_tokenizer

        eod_id = load_tokenizer("bytes" if entry == "bytes" else step_dir / entry).eod_id
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    with replacing(out / WEIGHTS_FILE, nbytes) as tmp:
        _safetensors().save_file(tensors, tmp, metadata={"format": "pt"})
    config = hf_config(cfg, eod_id)
    write_file(out / "config.json", json.dumps(config, indent=2) + "\n")
    return ConvertResult(out, kind, tuple(notes))


def import_hf(directory: str | Path, run_dir: str | Path, *, seq_length: int = 0) -> ConvertResult:
    """Make `run_dir` a ptdp run whose only checkpoint (step 0) is a `transformers` model.

    The checkpoint has the model's weights, no optimizer state and step 0, with the
    resolved config in run_dir/config.toml, so training starts from it in any layout with
    `ptdp train --config RUN_DIR/config.toml --resume --data.path PREFIX ...`.
    """
    refuse_empty(run_dir, "OUT")
    directory, run_dir = Path(directory), Path(run_dir)
    config = read_hf_json(directory)
    cfg = read_hf_config(directory, seq_length)
    if ckpt.has_checkpoint(run_dir):
        raise CheckpointError(f"{run_dir} already holds checkpoints; choose another directory")
    held = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    if held:
        raise ConfigError(
            f"OUT = '{run_dir}' already holds files ({', '.join(held[:5])}), which the new "
            "run's config.toml and checkpoints would replace or mix with; choose a new or "
            "empty directory"
        )
    check_output_dir(run_dir, "OUT")  # made only once the model has converted
    check_hf_model(directory, config)  # before any conversion
    model = from_hf_state(cfg, read_hf_weights(directory))
    make_output_dir(run_dir, "OUT")
    base = RunConfig()
    run_cfg = replace(base, model=cfg, train=replace(base.train, run_dir=str(run_dir)))
    tokenizer = directory / TOKENIZER_FILE
    tokenizer = tokenizer if tokenizer.is_file() else None
    state = {
        "model": model,
        "optimizer": {"state": {}, "param_groups": []},  # AdamW starts fresh
        "loss_scaler": None,
        "step": 0,
        "consumed_samples": 0,
        "rng": {"cpu": torch.Generator().manual_seed(run_cfg.train.seed).get_state()},
        "config": to_dict(run_cfg),
        "tokenizer": TOKENIZER_FILE if tokenizer else "",
    }
    step_dir = ckpt.save_checkpoint(run_dir, 0, state, run_cfg, tokenizer)
    write_file(run_dir / "config.toml", to_toml(run_cfg))
    notes = [] if tokenizer else [f"{directory} has no {TOKENIZER_FILE}; none recorded"]
    return ConvertResult(step_dir, family(cfg), tuple(notes))
