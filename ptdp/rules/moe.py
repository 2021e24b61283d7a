"""The mixture-of-experts rules of `ptdp.rules.layout.validate`: what the model.moe_* keys must
hold on their own and against the layout, each message naming the key and the fix.

Pure (no torch.distributed), so a bad MoE setting fails before any process group exists.
"""

from __future__ import annotations

from dataclasses import fields

from ptdp.config.enums import ScoreFunction
from ptdp.config.sections import ModelConfig, RunConfig

_DEFAULTS = ModelConfig()
MOE_KEYS = tuple(f.name for f in fields(ModelConfig) if f.name.startswith("moe_"))
"""The keys that only a mixture-of-experts model reads (num_experts > 0)."""


def moe_rules(cfg: RunConfig, errors: list[str]) -> None:
    """Append what is wrong with the MoE settings of `cfg` to `errors` (train.compile and
    train.precision = fp8 are built for MoE models: `ptdp.model.compile`,
    `ptdp.rules.fp8`)."""
    m = cfg.model
    if m.num_experts < 0:
        errors.append(f"model.num_experts = {m.num_experts} must be >= 0 (0 = a dense model)")
        return
    if m.num_experts == 0:
        _dense_rules(m, errors)
        return
    before = len(errors)
    _value_rules(m, errors)
    if len(errors) > before:
        return
    if m.moe_top_k > m.num_experts:
        errors.append(
            f"model.moe_top_k = {m.moe_top_k} exceeds model.num_experts = {m.num_experts}: a "
            f"token cannot pick more experts than there are; use a top_k <= {m.num_experts}"
        )
    _group_rules(m, errors)
    if m.moe_first_dense_layers >= m.num_layers > 0:
        errors.append(
            f"model.moe_first_dense_layers = {m.moe_first_dense_layers} leaves no MoE layer in "
            f"model.num_layers = {m.num_layers}; use fewer dense layers (< {m.num_layers}) or "
            "set --model.num_experts 0 for a dense model"
        )
    if m.moe_softmax_after_topk and m.moe_score_function is ScoreFunction.SIGMOID:
        errors.append(
            "model.moe_softmax_after_topk = true softmaxes the chosen logits (Mixtral), but "
            "model.moe_score_function = sigmoid; set --model.moe_score_function softmax or "
            "--model.moe_softmax_after_topk false"
        )
    if 0 < m.moe_capacity_factor < 1:
        errors.append(
            f"model.moe_capacity_factor = {m.moe_capacity_factor} would drop tokens even under "
            "a perfect balance; use 0 (dropless) or a factor >= 1 (e.g. 1.25)"
        )
    if m.moe_shared_ffn_hidden_size and not m.moe_shared_experts:
        errors.append(
            f"model.moe_shared_ffn_hidden_size = {m.moe_shared_ffn_hidden_size} sizes shared "
            "experts, but model.moe_shared_experts = 0; set --model.moe_shared_experts 1 or "
            "drop moe_shared_ffn_hidden_size"
        )
    _layout_rules(cfg, errors)


def _group_rules(m: ModelConfig, errors: list[str]) -> None:
    """Group-limited routing: groups that divide the experts, a group top-k among them that
    leaves at least top_k experts to choose from."""
    groups, pick = m.moe_router_groups, m.moe_router_group_top_k
    if pick and not groups:
        errors.append(
            f"model.moe_router_group_top_k = {pick} limits a token to its best expert "
            "groups, but model.moe_router_groups = 0; set --model.moe_router_groups (e.g. "
            "8, a divisor of model.num_experts) or drop moe_router_group_top_k"
        )
        return
    if not groups:
        return
    divisors = [d for d in range(1, m.num_experts + 1) if m.num_experts % d == 0]
    if groups < 0 or m.num_experts % groups:
        errors.append(
            f"model.moe_router_groups = {groups} does not divide model.num_experts = "
            f"{m.num_experts} into equal groups; use one of {divisors}"
        )
        return
    if not 1 <= pick <= groups:
        errors.append(
            f"model.moe_router_group_top_k = {pick} must be between 1 and "
            f"model.moe_router_groups = {groups} (the groups a token may use; DeepSeek-V3: "
            "4 of 8)"
        )
        return
    if pick * (m.num_experts // groups) < m.moe_top_k:
        need = -(-m.moe_top_k // (m.num_experts // groups))
        errors.append(
            f"model.moe_router_group_top_k = {pick} groups of {m.num_experts // groups} "
            f"experts leave fewer than model.moe_top_k = {m.moe_top_k} to choose from; use "
            f"--model.moe_router_group_top_k {need} or more"
        )


def _dense_rules(m: ModelConfig, errors: list[str]) -> None:
    """A dense model: every moe_* key at its default, so none is silently ignored."""
    changed = [k for k in MOE_KEYS if getattr(m, k) != getattr(_DEFAULTS, k)]
    if changed:
        keys = ", ".join(f"model.{k} = {_show(getattr(m, k))}" for k in changed)
        errors.append(
            f"{keys} set but model.num_experts = 0 (a dense model, which reads no moe_* key); "
            "set --model.num_experts (e.g. 8) for a mixture-of-experts model, or drop "
            f"{'it' if len(changed) == 1 else 'them'}"
        )


def _value_rules(m: ModelConfig, errors: list[str]) -> None:
    if m.moe_top_k < 1:
        errors.append(f"model.moe_top_k = {m.moe_top_k} must be >= 1 (experts per token)")
    if m.moe_layer_freq < 1:
        errors.append(
            f"model.moe_layer_freq = {m.moe_layer_freq} must be >= 1 (1 = every layer is MoE)"
        )
    at_least_zero = (  # the float keys: ptdp/rules/domains.py
        "moe_ffn_hidden_size", "moe_shared_experts", "moe_shared_ffn_hidden_size",
        "moe_first_dense_layers",
    )  # fmt: skip
    for name in at_least_zero:
        value = getattr(m, name)
        if value < 0:
            errors.append(f"model.{name} = {value} must be >= 0")


def _layout_rules(cfg: RunConfig, errors: list[str]) -> None:
    m, p = cfg.model, cfg.parallel
    if m.moe_capacity_factor and p.cp > 1:
        errors.append(
            f"model.moe_capacity_factor = {m.moe_capacity_factor} with parallel.cp = {p.cp}: "
            "which token-choices an expert drops depends on the routing of the whole "
            "sequence, which context parallelism splits over ranks; use dropless routing "
            "(--model.moe_capacity_factor 0) or --parallel.cp 1"
        )
    if m.moe_capacity_factor and p.cp == 1 and p.etp != p.tp:
        errors.append(
            f"model.moe_capacity_factor = {m.moe_capacity_factor} with parallel.etp = {p.etp} "
            f"and parallel.tp = {p.tp}: which token-choices an expert drops depends on the "
            "routing of the whole sequence, which reaches one expert group only when etp = "
            f"tp; use dropless routing (--model.moe_capacity_factor 0) or --parallel.etp {p.tp}"
        )
    local = m.seq_length // p.cp  # a rank's part of the sequence
    if p.tp > 1 and not p.sequence_parallel and local % p.tp and not m.seq_length % p.cp:
        errors.append(
            f"model.seq_length = {m.seq_length}"
            + (f" / parallel.cp = {local}" if p.cp > 1 else "")
            + f" is not divisible by parallel.tp = {p.tp}: each tensor rank routes its own "
            f"slice of the sequence to the experts; use a sequence length that is a multiple "
            f"of {p.tp * p.cp * (2 if p.cp > 1 else 1)}"
        )
    widths = (
        ("routed expert", "moe_ffn_hidden_size", m.moe_ffn_size, "etp", p.etp),
        ("shared expert", "moe_shared_ffn_hidden_size", m.moe_shared_ffn_size, "tp", p.tp),
    )
    for what, key, width, axis, size in widths:
        if size > 0 and width % size:
            fits = max(d for d in range(1, size + 1) if width % d == 0 and size % d == 0)
            errors.append(
                f"the {what} width {width} (model.{key}) is not divisible by parallel.{axis} = "
                f"{size}; choose a width that is a multiple of {size}"
                + (f", or --parallel.etp {fits}" if axis == "etp" else "")
            )


def _show(value: object) -> str:
    return getattr(value, "value", value) if not isinstance(value, bool) else str(value).lower()


def expert_rules(cfg: RunConfig, dp: int, errors: list[str]) -> None:
    """parallel.ep and parallel.etp against the model and the layout (`dp`: the derived
    data-parallel size, 0 when it could not be derived). The experts fold over one stage's
    tp * cp * dp ranks (`ptdp.parallel.mesh`): ep * etp must divide them."""
    m, p = cfg.model, cfg.parallel
    for key, size, what in (
        ("ep", p.ep, "expert parallelism"),
        ("etp", p.etp, "expert tensor parallelism"),
    ):
        if size < 1:
            errors.append(f"parallel.{key} = {size} must be >= 1 (1 = no {what})")
    if p.ep < 1 or p.etp < 1 or (p.ep == 1 and p.etp == 1):
        return
    if m.num_experts == 0:
        given = [(k, v) for k, v in (("ep", p.ep), ("etp", p.etp)) if v > 1]
        keys = " and ".join(f"parallel.{k} = {v}" for k, v in given)
        fix = " ".join(f"--parallel.{k} 1" for k, _ in given)
        errors.append(
            f"{keys} split{'s' if len(given) == 1 else ''} experts, but model.num_experts = 0 "
            f"(a dense model); set {fix}, or --model.num_experts (e.g. 8) for a mixture of "
            "experts"
        )
        return
    folded = dp * p.cp * p.tp  # one stage's ranks, 0: unknown
    # The largest ep below the asked one that meets both rules: never a fix that fails.
    fits = max(
        e
        for e in range(1, p.ep + 1)
        if m.num_experts % e == 0 and (folded == 0 or folded % (e * p.etp) == 0)
    )
    if m.num_experts % p.ep:
        errors.append(
            f"model.num_experts = {m.num_experts} is not divisible by parallel.ep = {p.ep}: "
            f"every expert-parallel rank holds the same number of experts; use --parallel.ep "
            f"{fits} (a divisor of {m.num_experts}{' that fits the ranks' if folded else ''})"
        )
    if folded and folded % (p.ep * p.etp):
        etp_fits = max(e for e in range(1, p.etp + 1) if folded % e == 0 and p.etp % e == 0)
        errors.append(
            f"parallel.ep * parallel.etp = {p.ep} * {p.etp} = {p.ep * p.etp} does not divide "
            f"tp * cp * dp = {p.tp} * {p.cp} * {dp} = {folded}: the experts are laid out over "
            f"one pipeline stage's ranks; use --parallel.ep {fits}"
            + (f" or --parallel.etp {etp_fits}" if etp_fits != p.etp else "")
            + f", or launch a multiple of {p.ep * p.etp} ranks per stage"
        )
