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
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ptdp import checkpoint as ckpt
from ptdp.checkpoint.full import model_entries, read_entry, read_model_tensors
from ptdp.checkpoint.lazy import Held, Joined, Lazy, Narrowed, Stacked, Transposed
from ptdp.checkpoint.writer import find_cause
from ptdp.config.enums import PositionEmbedding
from ptdp.config.files import to_dict, to_toml
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.convert import hf_deepseek as deepseek
from ptdp.convert.hf_check import check_config_numbers, check_hf_shapes
from ptdp.convert.hf_config import family, hf_config, model_config_from_hf
from ptdp.convert.hf_files import (
    INDEX_FILE,
    HfWeights,
    check_export_dir,
    read_hf_config,
    read_hf_json,
    weight_shapes,
    with_held_mtp,
)
from ptdp.convert.safetensors_out import (
    DEFAULT_SHARD_BYTES,
    Entry,
    ShardWriter,
    plan_shards,
    stale_weight_files,
)
from ptdp.errors import CheckpointError, ConfigError
from ptdp.files import size_text, write_file
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
    "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v2": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
"""Per family: the MoE block's module and each expert's gate, up and down projections, as
published checkpoints (and `save_pretrained`) name them."""


def to_hf_state(cfg: ModelConfig, model: Tensors) -> Tensors:
    """ptdp's full model state -> `transformers` tensor names and layouts."""
    out: Tensors = {}
    for part in hf_parts(cfg):
        out |= part.convert(model)
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


@dataclass(frozen=True)
class HfPart:
    """One piece of the export, converted on its own so an export holds one piece at a
    time: the embeddings, one layer, or the final norm and output layer. `prefixes`: the
    ptdp names it reads start with one of them."""

    prefixes: tuple[str, ...]
    convert: Callable[[Tensors], Tensors]

    def takes(self, name: str) -> bool:
        return name.startswith(self.prefixes)


def hf_parts(cfg: ModelConfig) -> list[HfPart]:
    """The export's pieces in `transformers`' order (embeddings, layers, head)."""
    kind = family(cfg)
    gpt2 = kind == "gpt2"
    pre = "transformer." if gpt2 else "model."

    def head(model: Tensors) -> Tensors:
        out = {pre + ("wte.weight" if gpt2 else "embed_tokens.weight"): model["embedding.weight"]}
        if gpt2:
            out["transformer.wpe.weight"] = model["position.weight"]
        return out

    def layer(i: int) -> Callable[[Tensors], Tensors]:
        return lambda model: _layer_to_hf(cfg, kind, i, model)

    def tail(model: Tensors) -> Tensors:
        out = {
            pre + ("ln_f" if gpt2 else "norm") + sfx: model["final_norm" + sfx]
            for sfx in ((".weight", ".bias") if gpt2 else (".weight",))
        }
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = model["output.weight"]
        return out

    def mtp(k: int) -> Callable[[Tensors], Tensors]:
        return lambda model: _mtp_to_hf(cfg, kind, k, model)

    layers = [HfPart((f"layers.{i}.",), layer(i)) for i in range(cfg.num_layers)]
    # DeepSeek's multi-token-prediction layers follow the model's, each with copies of the
    # embedding and output layer.
    depths = [HfPart((f"mtp.{k}.", "embedding.", "output."), mtp(k)) for k in _depths(cfg)]
    return [
        HfPart(("embedding.", "position."), head),
        *layers,
        HfPart(("final_norm.", "output."), tail),
        *depths,
    ]


def _depths(cfg: ModelConfig) -> range:
    return range(1, cfg.mtp_depth + 1)


MTP_OWN = ("enorm", "hnorm", "eh_proj")
"""An MTP module's own weights (besides its layer), named alike by ptdp and DeepSeek."""


def _mtp_to_hf(cfg: ModelConfig, kind: str, k: int, model: Tensors) -> Tensors:
    """Depth k's module as DeepSeek's layer num_layers + k - 1 (`ptdp.model.mtp`)."""
    i = cfg.num_layers + k - 1
    out = _layer_to_hf(cfg, kind, cfg.num_layers - 1, model, f"mtp.{k}.layer.", i)
    dst = f"model.layers.{i}."
    for name in MTP_OWN:
        out[f"{dst}{name}.weight"] = model[f"mtp.{k}.{name}.weight"]
    out[dst + "shared_head.norm.weight"] = model[f"mtp.{k}.norm.weight"]
    # Copies, as DeepSeek's checkpoints hold them (a file may not hold one tensor twice).
    out[dst + "embed_tokens.weight"] = model["embedding.weight"].clone()
    out[dst + "shared_head.head.weight"] = model["output.weight"].clone()
    return out


def _layer_to_hf(
    cfg: ModelConfig, kind: str, i: int, model: Tensors, src: str = "", at: int | None = None
) -> Tensors:
    """Layer i (`src`: its ptdp prefix, default layers.i.) as `transformers`' layer `at`
    (default i); multi-token prediction's are the last layer's kind, at their own index."""
    gpt2 = kind == "gpt2"
    src = src or f"layers.{i}."
    at = i if at is None else at
    dst = f"transformer.h.{at}." if gpt2 else f"model.layers.{at}."
    out: Tensors = {}
    if gpt2:
        _gpt2_layer_to_hf(cfg, model, src, dst, out)
    else:
        _rotary_layer_to_hf(cfg, kind, i, model, src, dst, out)
    norms = ("ln_1", "ln_2") if gpt2 else ("input_layernorm", "post_attention_layernorm")
    for ours, theirs in zip(("norm1", "norm2"), norms):
        for sfx in (".weight", ".bias") if gpt2 else (".weight",):
            out[dst + theirs + sfx] = model[src + ours + sfx]
    return out


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
    if cfg.is_mla:
        out |= deepseek.attention_to_hf(cfg, model, src, dst)
    for sfx in () if cfg.is_mla else _suffixes(cfg, "attn.qkv"):
        q, k, v = split_qkv(model[src + "attn.qkv" + sfx], cfg)
        for name, x in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)):
            out[dst + "self_attn." + name + sfx] = x
    if cfg.qk_norm:
        for name in ("q_norm", "k_norm"):
            out[dst + f"self_attn.{name}.weight"] = model[src + f"attn.{name}.weight"]
    for sfx in () if cfg.is_mla else _suffixes(cfg, "attn.proj"):
        out[dst + "self_attn.o_proj" + sfx] = model[src + "attn.proj" + sfx]
    if cfg.is_moe_layer(i):
        if kind in deepseek.MLA_TYPES:
            out |= deepseek.moe_extras_to_hf(cfg, kind, model, src, dst)
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
    """Takes source tensors by name (lazily: nothing is read here), remembering which
    were used, to report any left over."""

    def __init__(self, tensors: Mapping[str, Lazy], strip: str) -> None:
        self.tensors = {k.removeprefix(strip): v for k, v in tensors.items()}
        self.used: set[str] = set()

    def __call__(self, name: str) -> Lazy:
        if name not in self.tensors:
            raise CheckpointError(f"the Hugging Face weights lack {name!r}")
        self.used.add(name)
        return self.tensors[name]

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


def hf_sources(
    cfg: ModelConfig, tensors: Mapping[str, Lazy], config: dict | None = None
) -> dict[str, Lazy]:
    """ptdp's full model state as lazy tensors over the `transformers` ones (inverse of
    `to_hf_state`): every name mapped, nothing read, so each rank then reads only its own
    regions (ptdp/checkpoint/lazy.py). `config`: the model's config.json, which says
    whether the weights are float8 (DeepSeek-V3's, `ptdp.convert.hf_deepseek`)."""
    if config is not None:
        tensors = deepseek.loadable(tensors, config, cfg.mtp_depth)
    gpt2 = cfg.position_embedding is PositionEmbedding.LEARNED
    take = _Taker(tensors, "transformer." if gpt2 else "")
    model: dict[str, Lazy] = {}
    if gpt2:
        model["embedding.weight"] = take("wte.weight")
        model["position.weight"] = Narrowed(take("wpe.weight"), 0, 0, cfg.seq_length)
    else:
        model["embedding.weight"] = take("model.embed_tokens.weight")
    for i in range(cfg.num_layers):
        src = f"h.{i}." if gpt2 else f"model.layers.{i}."
        dst = f"layers.{i}."
        if gpt2:
            for sfx in _suffixes(cfg, "attn.qkv"):
                qkv = _conv1d_lazy(take(src + "attn.c_attn" + sfx), sfx)
                q, k, v = (Narrowed(qkv, 0, j * cfg.hidden_size, cfg.hidden_size) for j in range(3))
                model[dst + "attn.qkv" + sfx] = fuse_qkv_lazy(q, k, v, cfg)
            for sfx in _suffixes(cfg, "attn.proj"):
                for ours, theirs in GPT2_LINEARS:
                    model[dst + ours + sfx] = _conv1d_lazy(take(src + theirs + sfx), sfx)
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
    for k in _depths(cfg):  # DeepSeek's layer num_layers + k - 1 (`_mtp_to_hf`)
        src, dst = f"model.layers.{cfg.num_layers + k - 1}.", f"mtp.{k}."
        _rotary_layer_from_hf(cfg, cfg.num_layers - 1, take, src, dst + "layer.", model)
        for ours, theirs in zip(
            ("norm1", "norm2"), ("input_layernorm", "post_attention_layernorm")
        ):
            model[f"{dst}layer.{ours}.weight"] = take(f"{src}{theirs}.weight")
        for name in MTP_OWN:
            model[f"{dst}{name}.weight"] = take(f"{src}{name}.weight")
        model[f"{dst}norm.weight"] = take(f"{src}shared_head.norm.weight")
        for shared in ("embed_tokens.weight", "shared_head.head.weight"):  # the model's own
            if src + shared in take.tensors:
                take(src + shared)
    take.check_all_used(cfg.tie_embeddings)
    return model


def from_hf_state(cfg: ModelConfig, tensors: Tensors) -> Tensors:
    """`transformers` weights in memory -> ptdp's full model state, every tensor whole
    (the single-process view; loading reads each rank's slices of `hf_sources` instead)."""
    lazy = hf_sources(cfg, {k: Held(v) for k, v in tensors.items()})
    return {k: v.full() for k, v in lazy.items()}


def fuse_qkv_lazy(q: Lazy, k: Lazy, v: Lazy, cfg: ModelConfig) -> Lazy:
    """`fuse_qkv` without reading: the rows of each key/value group in turn."""
    g, d = cfg.query_groups, cfg.head_dim
    r = cfg.num_heads // g
    rows: list[Lazy] = []
    for j in range(g):
        rows.append(Narrowed(q, 0, j * r * d, r * d))
        rows += [Narrowed(k, 0, j * d, d), Narrowed(v, 0, j * d, d)]
    return Joined(tuple(rows))


def _conv1d_lazy(x: Lazy, suffix: str) -> Lazy:
    return Transposed(x) if suffix == ".weight" else x


def _rotary_layer_from_hf(
    cfg: ModelConfig, i: int, take: _Taker, src: str, dst: str, model: dict[str, Lazy]
) -> None:
    if cfg.is_mla:
        model |= deepseek.attention_from_hf(cfg, take, src, dst)
    for sfx in () if cfg.is_mla else _suffixes(cfg, "attn.qkv"):
        q, k, v = (take(src + "self_attn." + m + sfx) for m in ("q_proj", "k_proj", "v_proj"))
        model[dst + "attn.qkv" + sfx] = fuse_qkv_lazy(q, k, v, cfg)
    if cfg.qk_norm:
        for name in ("q_norm", "k_norm"):
            model[dst + f"attn.{name}.weight"] = take(src + f"self_attn.{name}.weight")
    for sfx in () if cfg.is_mla else _suffixes(cfg, "attn.proj"):
        model[dst + "attn.proj" + sfx] = take(src + "self_attn.o_proj" + sfx)
    if cfg.is_moe_layer(i):
        model |= _experts_from_hf(cfg, take, src, dst)
        if cfg.is_mla:
            model |= deepseek.moe_extras_from_hf(cfg, take, src, dst)
        return
    for sfx in _suffixes(cfg, "mlp.fc1"):
        gate, up, down = (take(f"{src}mlp.{m}{sfx}") for m in ("gate_proj", "up_proj", "down_proj"))
        model[dst + "mlp.fc1" + sfx] = Joined((gate, up))
        model[dst + "mlp.fc2" + sfx] = down


def _experts_from_hf(cfg: ModelConfig, take: _Taker, src: str, dst: str) -> dict[str, Lazy]:
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
        pairs = ((take(e + w_gate + ".weight"), take(e + w_up + ".weight")) for e in experts)
        fc1 = Stacked(tuple(Joined(pair) for pair in pairs))
        fc2 = Stacked(tuple(take(e + w_down + ".weight") for e in experts))
    return {
        dst + "mlp.router.weight": take(src + f"{block}.gate.weight"),
        dst + "mlp.experts.fc1.weight": fc1,
        dst + "mlp.experts.fc2.weight": fc2,
    }


# ---------------------------------------------------------------------- files


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
    have = weight_shapes(directory)
    # Every position, as stored; the multi-token-prediction layers the weights hold.
    want = expected_hf_shapes(with_held_mtp(model_config_from_hf(config), have))
    check_hf_shapes(directory, config, have, want)


def read_hf_weights(directory: Path) -> Tensors:
    """A `transformers` model directory's weights, whole, in float32: safetensors (one
    file or an index), each checked whole first (convert/hf_files.py), or
    pytorch_model.bin. The single-process view; a load reads `HfWeights` by region."""
    with HfWeights(directory) as weights:
        return {name: lazy.full() for name, lazy in weights.tensors.items()}


def _read_error(exc: BaseException) -> BaseException:
    """The CheckpointError naming a damaged source file behind a failed write (DCP wraps
    the errors of its writer threads), else `exc` itself."""
    return find_cause(exc, CheckpointError) or exc


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


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    overwrite: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> ConvertResult:
    """Write a ptdp checkpoint (run, checkpoints or step directory) as a `transformers`
    model directory: config.json, the fp32 weights in files of at most `shard_bytes`
    (model.safetensors, or model-0000k-of-0000n.safetensors with their index), and
    tokenizer.json when it has one. Streams: the model's tensors are read a layer at a
    time (never the optimizer's moments), converted and written, so the export holds
    about one layer whatever the model's size. A directory that holds files is refused
    unless `overwrite`; then an earlier export's weight files there are replaced."""
    refuse_empty(out, "OUT")
    check_export_dir(Path(out), overwrite)
    step_dir = ckpt.find_checkpoint(checkpoint)
    cfg = ckpt.load_config(step_dir).model
    kind = family(cfg)  # refuse before reading the weights
    entries = model_entries(step_dir)  # its files checked
    parts = [(part, [n for n in entries if part.takes(n)]) for part in hf_parts(cfg)]
    meta = {n: torch.empty(shape, device="meta") for n, (_, shape, _) in entries.items()}
    plan = [
        Entry(name, tuple(t.shape))
        for part, names in parts
        for name, t in part.convert({n: meta[n] for n in names}).items()
    ]
    out = make_output_dir(out, "OUT")
    with ShardWriter(out, plan_shards(plan, shard_bytes)) as writer:
        for part, names in parts:  # one layer in memory at a time
            for name, tensor in part.convert(read_model_tensors(step_dir, entries, names)).items():
                writer.write(name, tensor)
    index = writer.index()
    written = list(writer.names)
    if index is not None:
        write_file(out / INDEX_FILE, json.dumps(index, indent=2) + "\n")
        written.append(INDEX_FILE)
    for stale in stale_weight_files(out, written):  # an earlier export's, with --overwrite
        stale.unlink()
    entry = read_entry(step_dir, "tokenizer") or ""
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
    config = hf_config(cfg, eod_id)
    write_file(out / "config.json", json.dumps(config, indent=2) + "\n")
    if len(written) > 1:
        notes.append(f"weights in {len(writer.names)} files of at most {size_text(shard_bytes)}")
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
    base = RunConfig()
    run_cfg = replace(base, model=cfg, train=replace(base.train, run_dir=str(run_dir)))
    tokenizer = directory / TOKENIZER_FILE
    tokenizer = tokenizer if tokenizer.is_file() else None
    with HfWeights(directory) as weights:  # each tensor read as it is written
        model = hf_sources(cfg, weights.tensors, config)  # every name mapped before OUT is made
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
        make_output_dir(run_dir, "OUT")
        try:
            step_dir = ckpt.save_checkpoint(run_dir, 0, state, run_cfg, tokenizer)
        except BaseException as exc:
            shutil.rmtree(run_dir, ignore_errors=True)  # new or empty: nothing of the user's
            raise _read_error(exc) from None
    write_file(run_dir / "config.toml", to_toml(run_cfg))
    notes = [] if tokenizer else [f"{directory} has no {TOKENIZER_FILE}; none recorded"]
    notes += deepseek.import_notes(config, cfg.mtp_depth)
    kind = config["model_type"] if config["model_type"] in deepseek.MLA_TYPES else family(cfg)
    return ConvertResult(step_dir, kind, tuple(notes))
