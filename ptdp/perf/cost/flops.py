"""FLOPs of a GPT iteration, after Narayanan et al. 2021 (arXiv 2104.04473), Appendix.

An [m, k] x [k, n] GEMM costs 2mkn FLOPs; only the transformer GEMMs, the attention
score/value products and the logit layer are counted (the paper's lower bound). The
attention products are counted over the full s x s square, as the paper does; with a
sliding window w < s (model.sliding_window) over the s x w band each query can read.

For the paper's own GPT (4h MLP, multi-head attention) with full recomputation,
`flops_per_iteration` equals equation (3),
    F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)),
and with no recomputation it is the "model FLOPs" form 72 B s l h^2 (1 + s/(6h) + V/(12 l h))
of Korthikanti et al. 2022. The generic per-GEMM sum below also covers SwiGLU, other MLP
widths and grouped-query attention.

The attention's GEMMs and score/value products take the queries' width a d (heads times
head size), which model.head_size may set apart from h (Qwen3: 32 heads of 128 in a
2048-wide model); for the paper's GPTs a d = h. Multi-head latent attention
(model.attention = mla) has its five linears (`ptdp.config.shapes`), queries and keys
a (p + r) wide against values a dv wide; training computes the attention over whole heads,
not over the latents.

A mixture-of-experts layer (`ModelConfig.is_moe_layer`) counts, for its MLP, what a token
goes through: the router's logits (2 h e), its k routed experts of width moe_ffn and the
shared experts' MLP; the experts it was not sent to cost it nothing. With a capacity
factor the dropped token-choices are still counted (the count assumes none is dropped).

Utilisation: model FLOPs utilisation (MFU) divides the FLOPs without recomputation by the
time and the dense peak of the devices; hardware FLOPs utilisation (HFU) counts what the
devices execute, recomputation included. Peaks are dense tensor-core rates: the 2:4
sparsity figures of the datasheets are twice these and are never used.
"""

from __future__ import annotations

import re

from ptdp.config.enums import Activation, Recompute
from ptdp.config.sections import ModelConfig
from ptdp.config.shapes import attention_linears
from ptdp.perf.cost.parameters import attention_width, value_width


def mlp_forward_flops_per_token(cfg: ModelConfig, moe: bool = False) -> float:
    """FLOPs of one layer's MLP forward per token: the dense MLP, or (`moe`) the router,
    the k routed experts and the shared experts a token goes through."""
    per_width = (6 if cfg.activation is Activation.SWIGLU else 4) * cfg.hidden_size
    if not moe:
        return per_width * cfg.ffn_size
    router = 2 * cfg.hidden_size * cfg.num_experts
    return router + per_width * (cfg.moe_top_k * cfg.moe_ffn_size + cfg.moe_shared_ffn_size)


def layer_forward_flops_per_token(
    cfg: ModelConfig, layer: int | None = None
) -> tuple[float, float]:
    """(GEMM FLOPs, attention-core FLOPs) of one layer's forward, per token: of layer
    `layer` (global index), a mixture of experts where the config says; None = dense."""
    s, q, v = cfg.seq_length, attention_width(cfg), value_width(cfg)
    attention = 2 * sum(x.weights for x in attention_linears(cfg))
    mlp = mlp_forward_flops_per_token(cfg, layer is not None and cfg.is_moe_layer(layer))
    span = min(s, cfg.sliding_window) if cfg.sliding_window else s  # keys a query may read
    core = 2 * span * (q + v)  # scores QK^T (2 span a d) and the weighted sum over V
    return attention + mlp, core


def flops_per_token(cfg: ModelConfig, recompute: Recompute = Recompute.NONE) -> float:
    """Training FLOPs (forward + backward = 3x forward, plus any recomputation) per token."""
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    layers = 0.0
    for count, layer in ((cfg.num_layers - moe_layers, None), (moe_layers, _first_moe(cfg))):
        if count:
            layers += count * _trained(*layer_forward_flops_per_token(cfg, layer), recompute)
    logits = 3 * 2 * cfg.hidden_size * cfg.vocab_size  # never recomputed
    return layers + logits + mtp_flops_per_token(cfg, recompute)


def mtp_flops_per_token(cfg: ModelConfig, recompute: Recompute = Recompute.NONE) -> float:
    """Multi-token prediction's training FLOPs per token (model.mtp_depth): per depth the
    projection [2h -> h], one layer of the last layer's kind and the output layer again."""
    if not cfg.mtp_depth:
        return 0.0
    last = cfg.num_layers - 1
    forward = layer_forward_flops_per_token(cfg, last if cfg.is_moe_layer(last) else None)
    h = cfg.hidden_size
    layer = _trained(*forward, recompute) + 3 * 2 * (2 * h) * h
    return cfg.mtp_depth * (layer + 3 * 2 * h * cfg.vocab_size)


def _trained(gemm: float, core: float, recompute: Recompute) -> float:
    """A layer's forward and backward (3x forward) and what recomputation runs again."""
    extra = {Recompute.NONE: 0.0, Recompute.SELECTIVE: core, Recompute.FULL: gemm + core}
    return 3 * (gemm + core) + extra[recompute]


def _first_moe(cfg: ModelConfig) -> int | None:
    """The global index of the first mixture-of-experts layer (None: a dense model)."""
    return next((i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)), None)


def flops_per_iteration(
    cfg: ModelConfig, global_batch_size: int, recompute: Recompute = Recompute.NONE
) -> float:
    """FLOPs of one optimizer step over the whole global batch of sequences."""
    return flops_per_token(cfg, recompute) * global_batch_size * cfg.seq_length


def paper_equation_3(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Equation (3) of the paper verbatim (it includes full activation recomputation)."""
    h = hidden
    return 96 * batch * seq * layers * h**2 * (1 + seq / (6 * h) + vocab / (16 * layers * h))


def paper_equation_4(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    """Equation (4): training time ~ 8 T P / (n X) seconds, recomputation included.

    It assumes 6h >> s, 16lh >> V + s and 12lh >> V (so equation (3) ~ 8 B s P).
    """
    return 8 * tokens * params / (gpus * flops_per_gpu)


def paper_parameter_count(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Equation (2) of the paper: P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))."""
    h = hidden
    return 12 * layers * h**2 * (1 + 13 / (12 * h) + (vocab + seq) / (12 * layers * h))


def model_flops_per_iteration(cfg: ModelConfig, global_batch_size: int) -> float:
    """Model FLOPs of one step: no recomputation counted, whatever the run does (for MFU)."""
    return flops_per_iteration(cfg, global_batch_size, Recompute.NONE)


def hardware_flops_per_iteration(
    cfg: ModelConfig, global_batch_size: int, recompute: Recompute
) -> float:
    """FLOPs the devices execute in one step, recomputation included (for HFU).

    With full recomputation this is the paper's equation (3), which is what its TFLOP/s
    figures count.
    """
    return flops_per_iteration(cfg, global_batch_size, recompute)


# Dense (not 2:4-sparse) tensor-core peaks per device in TFLOP/s, by precision. fp32 is the plain
# FP32 rate (PyTorch does not use TF32 for matmuls unless asked; on AMD, the FP32 matrix rate); fp8
# the float8 (E4M3/E5M2) rate, which only fp8 runs' linear-layer GEMMs use (their MFU stays against
# bf16). 0 or absent = no such tensor rate. Sources: NVIDIA V100, A10, A100, L40S, H100 (SXM5, PCIe,
# NVL), H200 (SXM, NVL) and HGX B200 datasheets (the B200 table's 8-GPU, with-sparsity figures
# divided by 8 and by 2; the others' sparse figures divided by 2); AMD Instinct MI250X and MI300X
# datasheets; an MI250X is two dies that torch sees as two devices, so its row is half the package
# figures (383 bf16, 95.7 fp32). This is the one table: `ptdp/perf/cost/hardware/*.toml` take their
# peaks from it by `kind`, and the training log's MFU (ptdp/train/peak.py) looks the device up here.
DENSE_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "v100": {"fp16": 125.0, "bf16": 0.0, "tf32": 0.0, "fp32": 15.7},
    "a10": {"fp16": 125.0, "bf16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "a100": {"fp16": 312.0, "bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "l40s": {"fp16": 362.05, "bf16": 362.05, "tf32": 183.0, "fp32": 91.6, "fp8": 733.0},
    "h100-pcie": {"fp16": 756.0, "bf16": 756.0, "tf32": 378.0, "fp32": 51.2, "fp8": 1513.0},
    "h100-nvl": {"fp16": 835.5, "bf16": 835.5, "tf32": 417.5, "fp32": 60.0, "fp8": 1670.5},
    "h100-sxm": {"fp16": 989.0, "bf16": 989.0, "tf32": 494.5, "fp32": 66.9, "fp8": 1979.0},
    "h200": {"fp16": 989.0, "bf16": 989.0, "tf32": 494.5, "fp32": 66.9, "fp8": 1979.0},
    "h200-nvl": {"fp16": 835.5, "bf16": 835.5, "tf32": 417.5, "fp32": 60.0, "fp8": 1670.5},
    "b200": {"fp16": 2250.0, "bf16": 2250.0, "tf32": 1125.0, "fp32": 75.0, "fp8": 4500.0},
    "mi250x": {"fp16": 191.5, "bf16": 191.5, "tf32": 0.0, "fp32": 47.85},
    "mi300x": {"fp16": 1307.4, "bf16": 1307.4, "tf32": 653.7, "fp32": 163.4, "fp8": 2614.9},
}

# Patterns of torch.cuda.get_device_name() -> table key, most specific first. Whole words
# only: "A10" is neither "A100" nor "A10G" (a different part), "L40S" is not "L40".
_DEVICE_NAMES: tuple[tuple[str, str], ...] = (
    (r"H100\b.*\bPCIe", "h100-pcie"),
    (r"H100\b.*\bNVL", "h100-nvl"),
    (r"H200\b.*\bNVL", "h200-nvl"),
    (r"GH200", "h200"),
    (r"H200", "h200"),
    (r"H100", "h100-sxm"),
    (r"H800", "h100-sxm"),  # H100 SXM compute, NVLink cut to 400 GB/s (hardware/h800.toml)
    (r"A100", "a100"),
    (r"A10", "a10"),
    (r"L40S", "l40s"),
    (r"V100", "v100"),
    (r"B200", "b200"),
    (r"MI250X?", "mi250x"),
    (r"MI300X", "mi300x"),
)


def device_kind(device_name: str) -> str | None:
    """Table key for a device name as torch reports it ("NVIDIA A100-SXM4-80GB" -> "a100");
    None for a device not in the table."""
    return next(
        (kind for pattern, kind in _DEVICE_NAMES if re.search(rf"\b{pattern}\b", device_name)),
        None,
    )


def dense_peak_flops(kind: str, precision: str) -> float:
    """Dense peak FLOP/s of device `kind` at `precision` (fp32, tf32, bf16, fp16, fp8)."""
    if kind not in DENSE_PEAK_TFLOPS:
        known = ", ".join(DENSE_PEAK_TFLOPS)
        raise KeyError(f"no peak FLOP/s for device {kind!r}; known: {known}")
    peak = DENSE_PEAK_TFLOPS[kind].get(precision, 0.0)
    if peak <= 0:
        raise KeyError(f"device {kind!r} has no dense {precision} tensor rate in the table")
    return peak * 1e12


def utilisation(flops: float, seconds: float, devices: int, peak_flops: float) -> float:
    """Achieved fraction of peak: flops / (seconds * devices * peak_flops).

    With model FLOPs (`model_flops_per_iteration`) this is MFU; with the FLOPs actually
    executed (`hardware_flops_per_iteration`) it is hardware-FLOPs utilisation (HFU).
    """
    return flops / (seconds * devices * peak_flops)
