"""The checkpoint's layout-free key scheme, shared by the sharded and the full views.

Keys name what a tensor is, never who held it: `model/<global name>` (parameters and
persistent buffers),
`optimizer/state/<name>/<moment>`, `optimizer/step`, `optimizer/param_groups`,
`rng/rank<r>/<device>` and the scalars of the run (`step`, `loss_scaler`, `layout`, ...).
A SwiGLU fc1 weight ([gate; up] blocks, each split over tp on its own) saved by tp > 1
ranks is stored viewed as (parts, rows / parts, ...) under the key suffix
`@parts<k>dim<d>`, so each rank's rows are one contiguous chunk of dim d + 1.
"""

from __future__ import annotations

import torch
from torch import nn

from ptdp.parallel.init import ShardSpec

MODEL, MOMENTS, RNG = "model/", "optimizer/state/", "rng/"
STATE_KEYS = ("exp_avg", "exp_avg_sq")  # the AdamW moments a checkpoint holds


def named_parameters(chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Parameters of this rank's chunks under their global names."""
    return [(name, p) for chunk in chunks for name, p in chunk.named_parameters()]


def named_buffers(chunks: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """Persistent buffers of this rank's chunks under their global names: model state that no
    optimizer updates (`GPT.state_buffers`: the MoE routers' balancing biases), replicated
    and saved whole as `model/<name>` beside the parameters."""
    return [
        (name, b) for chunk in chunks for name, b in getattr(chunk, "state_buffers", dict)().items()
    ]


def parts_key(key: str, spec: ShardSpec) -> str:
    return f"{key}@parts{spec.parts}dim{spec.dim}"


def parts_dim(key: str) -> int | None:
    """The dim a `@parts<k>dim<d>` key was viewed at, or None."""
    _, _, suffix = key.partition("@parts")
    return int(suffix.split("dim")[1]) if suffix else None


def unview_parts(key: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Undo a `@parts<k>dim<d>` view: (k, rows / k, ...) at dim d back to the rows."""
    base, _, suffix = key.partition("@parts")
    if not suffix:
        return key, value
    dim = int(suffix.split("dim")[1])
    return base, value.flatten(dim, dim + 1)
