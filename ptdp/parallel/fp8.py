"""float8 GEMMs of the linear layers (precision = fp8), from torchao's float8 training.

Shapes: n = tokens (s * b flattened), k = input features, m = output features of
Y = X W^T + b.

A linear layer's three GEMMs (Y = X W^T, dX = dY W, dW = dY^T X) each cast their two
operands to float8 with torchao's dynamic scaling (`hp_tensor_to_float8_dynamic`: one
scale per tensor, or per row under the rowwise recipe) and multiply the scaled tensors
(`torch._scaled_mm` on a GPU; elsewhere torchao's emulation, the float8 values multiplied
in float32). This is what torchao's `Float8Linear` does; it is taken apart here into the
three GEMMs so that the weight-gradient one can run later, at a zero-bubble W action, from
the kept high-precision X and dY (`ptdp.parallel.wgrad`), and so that the tensor-parallel
layers keep their own collectives: each rank scales its own shard. Weights, activations,
gradients and everything outside these GEMMs stay in the run's 16-bit dtype.

Only this module imports torchao (an optional dependency: pip install torchao), and
`ptdp.parallel.fp8_grouped`'s GPU kernel, inside its function; it is imported only when a
run asks for fp8. The experts' float8 GEMMs (`fp8_grouped`) are per expert this module's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchao.float8.config import Float8LinearConfig
from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import (
    Float8TrainingTensor,
    GemmInputRole,
    LinearMMConfig,
    ScaledMMConfig,
    hp_tensor_and_scale_to_float8,
)
from torchao.float8.float8_utils import amax_to_scale

from ptdp.config.enums import Fp8Recipe
from ptdp.errors import ConfigError

_ROLE = {"x": GemmInputRole.INPUT, "w": GemmInputRole.WEIGHT, "dy": GemmInputRole.GRAD_OUTPUT}


def check_device(device: torch.device) -> None:
    """Refuse a GPU without float8 tensor cores (`torch._scaled_mm` needs compute capability
    8.9: Ada, Hopper, Blackwell); a CPU emulates them."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9):
        return
    name, (major, minor) = (
        torch.cuda.get_device_name(device),
        torch.cuda.get_device_capability(device),
    )
    raise ConfigError(
        f"train.precision = fp8 needs float8 tensor cores (compute capability 8.9 or later: "
        f"L40S, H100, H200, B200); {name} has {major}.{minor}; use --train.precision bf16"
    )


def _mm_config(config: Float8LinearConfig, *, emulate: bool) -> LinearMMConfig:
    """The three GEMMs' `_scaled_mm` settings, as torchao's `Float8Linear` builds them."""
    gemms = (config.gemm_config_output, config.gemm_config_grad_input)
    gemms += (config.gemm_config_grad_weight,)
    return LinearMMConfig(
        *(ScaledMMConfig(emulate, g.use_fast_accum, False, config.pad_inner_dim) for g in gemms)
    )


@dataclass(frozen=True)
class Fp8Gemms:
    """One run's float8 recipe: the cast of each operand of each GEMM, and the GEMMs."""

    recipe: Fp8Recipe
    config: Float8LinearConfig
    native: LinearMMConfig
    """For a GPU with float8 tensor cores (`torch._scaled_mm`)."""
    emulated: LinearMMConfig
    """Elsewhere (a CPU): the same casts, the products of the float8 values in float32."""

    @classmethod
    def build(cls, recipe: Fp8Recipe) -> Fp8Gemms:
        config = Float8LinearConfig.from_recipe_name(recipe.value)
        return cls(
            recipe, config, _mm_config(config, emulate=False), _mm_config(config, emulate=True)
        )

    def _cast(self, t: torch.Tensor, cast, role: str, dim: int) -> torch.Tensor:
        """`t` in float8 as `cast` (a torchao CastConfig) says; rowwise scales along `dim`."""
        c = self.config
        return hp_tensor_to_float8_dynamic(
            t,
            cast.target_dtype,
            self.native if t.device.type == "cuda" else self.emulated,
            gemm_input_role=_ROLE[role],
            scaling_granularity=cast.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(dim, cast.scaling_granularity),
            round_scales_to_power_of_2=c.round_scales_to_power_of_2,
        )

    def forward(self, x: torch.Tensor, weight: torch.Tensor, w8=None) -> torch.Tensor:
        """x [n, k] @ weight [m, k]^T -> [n, m]; `w8`: the weight already in float8
        (ZeRO-3's fp8 all-gather, `gathered_weight`), used instead of casting `weight`."""
        c = self.config
        xq = self._cast(x, c.cast_config_input, "x", -1)
        wq = self._cast(weight.t(), c.cast_config_weight, "w", 0) if w8 is None else w8.t()
        return torch.mm(xq, wq)

    def grad_input(self, dy: torch.Tensor, weight: torch.Tensor, w8=None) -> torch.Tensor:
        """dy [n, m] @ weight [m, k] -> dX [n, k]; `w8` as in `forward` (tensorwise: the
        same cast serves both GEMMs)."""
        c = self.config
        dyq = self._cast(dy, c.cast_config_grad_output, "dy", -1)
        if w8 is not None:
            return torch.mm(dyq, w8)
        wq = self._cast(weight.t(), c.cast_config_weight_for_grad_input, "w", -1)
        return torch.mm(dyq, wq.t())

    # ----------------------------------------------- ZeRO-3's fp8 all-gather (tensorwise)

    @property
    def weight_dtype(self) -> torch.dtype:
        """The float8 dtype a weight is cast to."""
        return self.config.cast_config_weight.target_dtype

    def weight_scales(self, amax: torch.Tensor) -> torch.Tensor:
        """Tensorwise scales of weights from their amaxes ([w] float32): torchao's, so
        bitwise those of casting each whole weight."""
        return amax_to_scale(amax, self.weight_dtype, self.config.round_scales_to_power_of_2)

    def cast_weight(self, part: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Elements of a weight in float8 with its tensorwise `scale` (torchao's cast: the
        same bytes as those elements of the whole weight's cast)."""
        return hp_tensor_and_scale_to_float8(part, scale, self.weight_dtype)._data

    def gathered_weight(
        self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
    ) -> Float8TrainingTensor:
        """A weight [m, k] from its float8 bytes `data` and scale, as the GEMMs take it."""
        mm = self.native if data.device.type == "cuda" else self.emulated
        return Float8TrainingTensor(data, scale, dtype, mm, GemmInputRole.WEIGHT)

    def grad_weight(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """dy [n, m]^T @ x [n, k] -> dW [m, k]: now, or at a zero-bubble W action."""
        c = self.config
        dyq = self._cast(dy, c.cast_config_grad_output_for_grad_weight, "dy", 0)
        xq = self._cast(x, c.cast_config_input_for_grad_weight, "x", 0)
        return torch.mm(dyq.t(), xq)

    def compiled(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Under torch.compile: torchao's own autograd function (which Dynamo traces), the
        weight gradient computed in B as for any compiled layer."""
        mm = self.native if x.device.type == "cuda" else self.emulated
        return matmul_with_hp_or_float8_args.apply(x, weight.t(), mm, self.config)
