"""The enumerated choices of the config dataclasses' fields (`ptdp.config.sections`): each
member's value is the string a TOML file or `--section.key value` gives.
"""

from __future__ import annotations

import enum


class PositionEmbedding(str, enum.Enum):
    LEARNED = "learned"
    ROPE = "rope"


class RopeScaling(str, enum.Enum):
    NONE = "none"
    LLAMA3 = "llama3"
    YARN = "yarn"


class AttentionKind(str, enum.Enum):
    MHA = "mha"
    MLA = "mla"


class Normalization(str, enum.Enum):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class Activation(str, enum.Enum):
    GELU = "gelu"
    SWIGLU = "swiglu"


class ScoreFunction(str, enum.Enum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class Schedule(str, enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"
    ZB_H2 = "zb-h2"
    ZB_V = "zb-v"
    DUALPIPEV = "dualpipev"


class CpComm(str, enum.Enum):
    RING = "ring"
    ALLGATHER = "allgather"


class AttentionBackend(str, enum.Enum):
    """`scaled_dot_product_attention`'s kernel (`torch.nn.attention.SDPBackend`)."""

    AUTO = "auto"
    FLASH = "flash"
    CUDNN = "cudnn"
    EFFICIENT = "efficient"
    MATH = "math"


class Recompute(str, enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class OnNan(str, enum.Enum):
    SKIP = "skip"
    STOP = "stop"
    ROLLBACK = "rollback"
    RETRY = "retry"


class Recovery(str, enum.Enum):
    RESTART = "restart"
    IN_PROCESS = "in_process"


class Resume(str, enum.Enum):
    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


class Precision(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"


class Fp8Recipe(str, enum.Enum):
    """How torchao's float8 training scales a GEMM's operands (`ptdp.parallel.fp8`)."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
