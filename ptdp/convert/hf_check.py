"""A Hugging Face model directory's config.json checked against its weights before anything
is converted (`ptdp convert --from hf`, `checkpoint.init_from`).

First the numbers of the config alone: the heads divide the width (unless head_dim sets
the head size), the key/value heads divide the heads. Then every tensor the config
implies, with its shape, against the weight files' headers (no tensor is read;
ptdp/convert/hf_files.py): the expected names and shapes are those `to_hf_state` gives
for the model built on the meta device (ptdp/convert/hf.py), so they follow the same
mapping as the conversion. A mismatch is refused naming the tensor, both shapes and the
config key that disagrees. Pure: the shapes come in as dicts.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ptdp.config.sections import ModelConfig
from ptdp.convert.hf_config import model_config_from_hf
from ptdp.errors import ConfigError

SIZE_KEYS = (
    "n_embd", "n_head", "n_inner", "n_positions", "n_layer", "hidden_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "moe_intermediate_size", "num_local_experts", "num_experts", "vocab_size",
    "num_hidden_layers", "max_position_embeddings",
)  # fmt: skip
"""The config.json keys that set tensor shapes, GPT-2's and the rotary families'."""
FIX = "correct config.json or download the model again; nothing was converted"


def _refuse(directory: Path, problem: str) -> ConfigError:
    return ConfigError(f"{directory / 'config.json'} does not match its weights: {problem}; {FIX}")


def check_config_numbers(directory: Path, c: dict[str, Any]) -> None:
    """The heads divide the width (unless head_dim is given) and the key/value heads
    divide the heads, named by their config.json keys."""
    gpt2 = c.get("model_type") == "gpt2"
    width, heads = ("n_embd", "n_head") if gpt2 else ("hidden_size", "num_attention_heads")
    h, n = c.get(width), c.get(heads)
    if not (isinstance(h, int) and isinstance(n, int)) or n <= 0:
        return  # read_hf_config names a missing or malformed key
    if (gpt2 or not c.get("head_dim")) and h % n:
        raise _refuse(
            directory,
            f"{heads} = {n} does not divide {width} = {h} (each head takes {width} / {heads} "
            "of the width)",
        )
    g = c.get("num_key_value_heads")
    if not gpt2 and isinstance(g, int) and g and (g < 0 or n % g):
        raise _refuse(
            directory,
            f"num_key_value_heads = {g} does not divide num_attention_heads = {n} (each "
            "key/value head serves the same number of query heads)",
        )


def check_hf_shapes(
    directory: Path,
    config: dict[str, Any],
    have: dict[str, tuple[int, ...]],
    want: dict[str, tuple[int, ...]],
) -> None:
    """Refuse a config.json whose tensors `want` (the names and shapes its model implies,
    ptdp/convert/hf.py's `expected_hf_shapes`) disagree with the weight files' `have`
    (after `check_config_numbers`)."""
    if not have:
        return  # no weights: the reader names what is missing
    cfg = model_config_from_hf(config)  # the whole position table, as the files hold it
    fused = {m.group(1) for k in have if (m := re.match(r"(.*\.)experts\.gate_up_proj$", k))}
    missing = []
    for name, shape in want.items():
        moe = re.match(r"(.*\.)(block_sparse_moe|mlp)\.(experts\.\d+\.|gate\.weight$)", name)
        if moe and moe.group(1) + "mlp." in fused:  # the fused layout: its router in mlp.
            if moe.group(3) != "gate.weight":
                continue  # the experts: checked by _check_fused
            name = moe.group(1) + "mlp.gate.weight"
        if name not in have:
            missing.append(name)
            continue
        if have[name] != shape:
            raise _refuse(directory, _mismatch(name, have[name], shape, config))
    for prefix in sorted(fused):
        _check_fused(directory, prefix, have, cfg, config)
    if missing:
        raise _refuse(directory, _missing(missing, have, config))


def _check_fused(
    directory: Path,
    prefix: str,
    have: dict[str, tuple[int, ...]],
    cfg: ModelConfig,
    config: dict[str, Any],
) -> None:
    """`transformers` 5's fused experts: gate_up_proj [e, 2f, h], down_proj [e, h, f]."""
    e, f, h = cfg.num_experts, cfg.moe_ffn_size, cfg.hidden_size
    for name, shape in (("gate_up_proj", (e, 2 * f, h)), ("down_proj", (e, h, f))):
        key = f"{prefix}experts.{name}"
        if have.get(key) != shape:
            raise _refuse(directory, _mismatch(key, have.get(key), shape, config))


def _keys_of(size: int, config: dict[str, Any]) -> list[str]:
    return [f"{k} = {config[k]}" for k in SIZE_KEYS if config.get(k) == size]


def _mismatch(
    name: str, have: tuple[int, ...] | None, want: tuple[int, ...], config: dict[str, Any]
) -> str:
    """Tensor `name` is `have` where the config implies `want`: which key disagrees."""
    if have is None:
        return f"the weights lack tensor {name}, which config.json implies ({list(want)})"
    differ = [w for h, w in zip(have, want) if h != w] if len(have) == len(want) else []
    keys = list(dict.fromkeys(k for w in differ for k in _keys_of(w, config)))
    if keys:
        why = f"{' and '.join(keys)} {'disagree' if len(keys) > 1 else 'disagrees'} with it"
    else:
        sizes = [f"{k} = {config[k]}" for k in SIZE_KEYS if isinstance(config.get(k), int)]
        why = f"from {', '.join(sizes)}"
    return f"tensor {name} is {list(have)} but config.json implies {list(want)}: {why}"


def _missing(missing: list[str], have: dict[str, tuple[int, ...]], config: dict[str, Any]) -> str:
    """Tensors the config implies and the weights lack: too many layers, or others."""
    numbered = (re.search(r"(?:h|layers)\.(\d+)\.", k) for k in have)
    layers = {int(m.group(1)) for m in numbered if m}
    key = "n_layer" if "n_layer" in config else "num_hidden_layers"
    if layers and config.get(key, 0) > max(layers) + 1:
        return (
            f"{key} = {config[key]} but the weights hold {max(layers) + 1} layers (the "
            f"weights lack {missing[0]}, ...)"
        )
    shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
    return f"the weights lack {len(missing)} tensor(s) config.json implies: {shown}"
