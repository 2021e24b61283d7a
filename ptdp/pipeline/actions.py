"""Pipeline actions: what one pipeline rank does at one step of a schedule.

A schedule is plain data (DESIGN invariant 1): a `Plan` maps each pipeline rank to its ordered
list of `Action`s. The runtime executes it, `verify` checks it and the simulator times it.

Kinds follow the zero-bubble paper (Qi et al., arXiv 2401.10241): `B` is the input-gradient
pass, `W` the weight-gradient pass and `BW` both fused, as in 1F1B. PyTorch's pipelining spells
these `I`, `W` and `B`. An action's `stage` is always the stage that lives on the rank running
it: `SEND_F` on stage s carries s's output to stage s + 1, and `RECV_F` on stage s receives its
input from stage s - 1 (likewise `SEND_B`/`RECV_B` in the other direction).

A forward and a backward of different microbatches may be *paired* (DualPipe, DeepSeek-V3,
arXiv 2412.19437): two adjacent compute actions with `paired` set, one F and one B or BW,
overlapped so that one's all-to-all can run during the other's compute. The pair is still
two actions (every reader that counts passes counts it as two); `add_comms` receives both
inputs before it and sends both results after it, and the runtime runs the two in turn
(`ptdp.pipeline.runtime`). Printed with a trailing `~` ("0F3~", "5BW1~").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum


class Kind(str, Enum):
    """What an action does; the runtime dispatches on this through a `{Kind: handler}` table."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self not in COMPUTE_KINDS


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.W, Kind.BW})
BACKWARD_KINDS = frozenset({Kind.B, Kind.BW})
"""Kinds that consume the output gradient and produce the input gradient."""
RELEASE_KINDS = frozenset({Kind.W, Kind.BW})
"""Kinds after which a microbatch's stashed activations on a stage are freed: the fused BW, or
W when the backward is split (B leaves the graph, or the weight-gradient inputs, for W)."""

_TEXT = re.compile(r"^(\d+)([A-Z_]+)(\d+)(~?)$")
PAIR_MARK = "~"
"""Suffix of a paired action's text."""


@dataclass(frozen=True)
class Action:
    """One step on one rank: `kind` of global virtual `stage` (0..pp*vpp-1) for microbatch `mb`.

    Printed compactly as stage, kind, microbatch ("2F5", "2SEND_F5"), the form used in tables,
    error messages and CSV dumps; `Action.parse` inverts it. `paired` (printed "2F5~") marks
    one half of an overlapped forward-and-backward pair (module docstring); it is not part of
    the action's identity, so a lookup of `Action(Kind.F, 2, 5)` finds the paired one too.
    """

    kind: Kind
    stage: int
    mb: int
    paired: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.stage < 0 or self.mb < 0:
            raise ValueError(f"action {self.kind.value} needs stage >= 0 and mb >= 0, got {self}")

    def __str__(self) -> str:
        mark = PAIR_MARK if self.paired else ""
        return f"{self.stage}{self.kind.value}{self.mb}{mark}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the compact form written by `str`, e.g. "2F5", "0RECV_B3" or "1F4~"."""
        match = _TEXT.match(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. '2F5' or '0SEND_B3'")
        stage, kind, mb, mark = match.groups()
        if kind not in Kind.__members__:
            names = ", ".join(k.value for k in Kind)
            raise ValueError(f"unknown action kind {kind!r} in {text!r}; use one of {names}")
        return cls(Kind(kind), int(stage), int(mb), paired=bool(mark))


Plan = dict[int, list[Action]]
"""Pipeline rank -> its actions in execution order."""
