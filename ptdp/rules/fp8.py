"""The fp8 rules of `ptdp.rules.layout.validate`: what a run with train.precision = fp8 needs, each
message naming the key and the fix.

fp8 runs the linear layers' GEMMs through `torch._scaled_mm` (torchao's float8 training,
`ptdp.parallel.fp8`), whose operands must have every dimension a multiple of 16 on a GPU:
each rank's input and output features of every linear layer, and the tokens of a
microbatch on a rank. A mixture-of-experts model's experts run theirs in float8 too
(`ptdp.parallel.fp8_grouped`): each rank's features of every expert matrix (the routed
experts' split over parallel.etp, the shared ones' over parallel.tp) must be multiples of
16 as well; their rows (an expert's share of the tokens) are padded to 16.
The same rules hold on a CPU (where the GEMMs are emulated), so that a run tried on a
laptop does not fail on the cluster. Pure (no torch import).
"""

from __future__ import annotations

import importlib.util

from ptdp.config.enums import Activation, Fp8Recipe, Precision
from ptdp.config.sections import RunConfig
from ptdp.config.shapes import attention_linears

FP8_MULTIPLE = 16
"""What each dimension of a float8 GEMM's operands must be a multiple of."""


def has_torchao() -> bool:
    """Whether torchao (the `fp8` extra) is installed; it is not imported here."""
    return importlib.util.find_spec("torchao") is not None


def fp8_rules(cfg: RunConfig, errors: list[str], runtime: bool) -> None:
    """Append what keeps `cfg` from training in fp8 to `errors` (nothing unless precision
    = fp8). `runtime`: also whether torchao is installed, which a modelled run needs not."""
    _all_gather_rules(cfg, errors)
    if cfg.train.precision is not Precision.FP8:
        return
    m, p = cfg.model, cfg.parallel
    if runtime and not has_torchao():
        errors.append(
            "train.precision = fp8 needs torchao's float8 training, which is not installed; "
            "pip install -e '.[fp8]' (or pip install torchao), or use --train.precision bf16"
        )
    if cfg.train.micro_batch_size > 0 and m.seq_length > 0 and p.cp > 0:
        tokens = cfg.train.micro_batch_size * m.seq_length // p.cp
        if tokens % FP8_MULTIPLE:
            errors.append(
                f"train.precision = fp8 needs the tokens of a microbatch on a rank "
                f"(train.micro_batch_size * model.seq_length / parallel.cp = {tokens}) to be "
                f"a multiple of {FP8_MULTIPLE}; raise micro_batch_size or seq_length"
            )
    if p.tp > 0 and m.num_heads > 0:
        _feature_rules(cfg, errors)
    if p.tp > 0 and p.etp > 0 and m.num_experts > 0:
        _expert_rules(cfg, errors)


def _feature_rules(cfg: RunConfig, errors: list[str]) -> None:
    """Each rank's input and output features of each linear layer."""
    m, tp = cfg.model, cfg.parallel.tp
    parts = 2 if m.activation is Activation.SWIGLU else 1
    widths = {"model.hidden_size": m.hidden_size}
    if m.is_mla:  # each of its linears' features on a rank (`ptdp.config.shapes`)
        for x in attention_linears(m):
            widths[f"MLA's {x.name} input features per tensor-parallel rank"] = x.local_inputs(tp)
            widths[f"MLA's {x.name} output features per tensor-parallel rank"] = x.local_outputs(tp)
    else:
        qkv = m.query_groups * (m.num_heads // m.query_groups + 2) * m.head_dim
        widths["the attention's query/key/value features per tensor-parallel rank"] = qkv // tp
        widths["the attention's head features per tensor-parallel rank"] = (
            m.num_heads * m.head_dim // tp
        )
    widths |= {
        "the MLP's inner features per tensor-parallel rank": m.ffn_size // tp,
        "the MLP's first-layer features per tensor-parallel rank": m.ffn_size * parts // tp,
        "model.make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
    }
    for what, width in widths.items():
        if width % FP8_MULTIPLE:
            errors.append(
                f"train.precision = fp8 needs {what} (= {width}) to be a multiple of "
                f"{FP8_MULTIPLE} (torch._scaled_mm's operands); change the model's widths "
                "or parallel.tp, or use --train.precision bf16"
            )


def _expert_rules(cfg: RunConfig, errors: list[str]) -> None:
    """Each rank's inner features of the routed and the shared experts (fc1's rows and fc2's
    columns; SwiGLU's fc1 has twice as many, so they follow), each refused with a width
    that works: the next multiple of 16 times the ranks that split it."""
    m, p = cfg.model, cfg.parallel
    # The routed experts are split over the expert tensor group, the shared ones (a dense
    # MLP) over the tensor group.
    split = {"routed": ("moe_ffn_hidden_size", m.moe_ffn_size, p.etp, "parallel.etp")}
    if m.moe_shared_experts:
        split["shared"] = ("moe_shared_ffn_hidden_size", m.moe_shared_ffn_size, p.tp, "parallel.tp")
    for what, (key, width, ranks, axis) in split.items():
        if width % ranks or (width // ranks) % FP8_MULTIPLE:
            step = FP8_MULTIPLE * ranks
            fits = -(-width // step) * step
            errors.append(
                f"train.precision = fp8 needs the {what} experts' inner features per rank "
                f"(model.{key}, {width}, / {axis} = {ranks}) to be a multiple of "
                f"{FP8_MULTIPLE} (torch._scaled_mm's operands); use --model.{key} {fits}, "
                "or --train.precision bf16"
            )


def _all_gather_rules(cfg: RunConfig, errors: list[str]) -> None:
    """parallel.zero3_fp8_all_gather gathers ZeRO-3's float8 weights: it needs fp8 and its
    tensorwise recipe (ZeRO-3 itself: `ptdp.rules.zero`)."""
    p, t = cfg.parallel, cfg.train
    if not p.zero3_fp8_all_gather:
        return
    key = "parallel.zero3_fp8_all_gather = true"
    if t.precision is not Precision.FP8:
        errors.append(
            f"{key} gathers float8 weights, but train.precision = {t.precision.value}; set "
            "--train.precision fp8, or drop the option"
        )
    if t.precision is Precision.FP8 and t.fp8_recipe is not Fp8Recipe.TENSORWISE:
        errors.append(
            f"{key} needs train.fp8_recipe = tensorwise (one scale a weight, one cast for "
            f"its forward and backward GEMMs), but it is {t.fp8_recipe.value}, whose "
            "per-row scales differ between the two; set --train.fp8_recipe tensorwise, or "
            "drop the option"
        )
