"""One dry run of a pipeline plan in simulated time: the verifier's and the simulator's engine.

`dry_run(plan, stages, cost)` runs every rank's action list (compute-only, or lowered by
`add_comms`) with a duration per action and returns when each action ran, the makespan, and
per rank the time computing, the span from its first compute to its last, and where it ended;
or, if the ranks cannot all finish, what each stuck rank waits for. `ptdp.pipeline.verify`
calls it at unit costs (F = B = W = 1, BW = 2, free transfers) and `ptdp.perf.simulate.replay` with
the performance model's seconds; a benchmark can call it with measured ones. Pure: no torch.

A compute action starts when its rank is free and its inputs are there: F(s) needs the
output of stage s - 1, B or BW(s) its own F and the input gradient from stage s + 1, W its
B. Between stages on the same rank (pp = 1, ZB-V's turn), or in a compute-only plan, the
dependency is direct and free; otherwise the message travels from the SEND on one rank to
the RECV on the other, and `CommModel` says how. A rank's messages leave (and arrive)
through its own cards one at a time, whichever neighbour and direction they go to.

This module holds what a dry run takes and returns and the plan compiled for it
(`Program`); the engine that runs a program is `ptdp.pipeline.dryrun_engine`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

from ptdp.pipeline.actions import Action, Kind, Plan
from ptdp.pipeline.lowering import apart
from ptdp.pipeline.placement import StageMap

Cost = Callable[[Action], float]
"""Seconds of a compute action (F, B, W, BW); with it alone every transfer is free."""


class CommModel(str, Enum):
    """How a transfer between ranks occupies the two ranks and its channel.

    A channel is (sending rank, receiving rank, direction); its messages leave one at a time,
    in order. All channels of one rank share its cards (activations to the next stage and
    gradients to the previous one leave through the same NIC or NVLink ports, and arrive
    through them): a message takes the first gap at or after it may start in which both
    the sender's outgoing and the receiver's incoming direction are free, so interleaving's
    extra messages queue behind one another.
    """

    ASYNC = "async"
    """ptdp's runtime: a SEND and a RECV are posted without blocking; the transfer starts
    once both sides have posted and the previous message on its channel has left, and the
    compute that needs it waits for its arrival."""
    RECV_BLOCKS = "recv-blocks"
    """The verifier's: as ASYNC, but a RECV holds its rank until its message is in, so a
    RECV posted before the SEND it needs can run deadlocks."""
    BLOCKING = "blocking"
    """Megatron-LM in 2021 (synchronised after each batch of point-to-point operations):
    the rank carries each transfer, a SEND holding it until the message has left (no
    rendezvous), a RECV until the message is in."""


@dataclass(frozen=True)
class PipelineCosts:
    """Seconds of each action of each global stage; transfers by sending stage."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    send_forward: tuple[float, ...]
    """Stage s -> s + 1, activation, on the wire once the send is matched."""
    send_backward: tuple[float, ...]
    """Stage s -> s - 1, gradient."""
    receive_forward: tuple[float, ...] = ()
    """By sending stage: the receiver's work on an arrived activation before it is usable
    (scatter/gather's all-gather over the tensor group); it holds neither the sender nor the
    channel. Empty: none."""
    receive_backward: tuple[float, ...] = ()

    @classmethod
    def unit(cls, stages: int) -> PipelineCosts:
        """verify's dry-run costs: F = B = W = 1 (BW = 2), free transfers."""
        ones, zeros = (1.0,) * stages, (0.0,) * stages
        return cls(ones, ones, ones, zeros, zeros)

    def duration(self, a: Action) -> float:
        """Seconds of compute action `a` (BW = B + W); 0 for a transfer action."""
        s = a.stage
        if a.kind is Kind.F:
            return self.forward[s]
        if a.kind is Kind.B:
            return self.backward_input[s]
        if a.kind is Kind.W:
            return self.backward_weight[s]
        if a.kind is Kind.BW:
            return self.backward_input[s] + self.backward_weight[s]
        return 0.0

    def transfer(self, send: Action) -> float:
        """Seconds on the wire of the message SEND_F or SEND_B action `send` carries."""
        table = self.send_forward if send.kind is Kind.SEND_F else self.send_backward
        return table[send.stage]

    def receive(self, send: Action) -> float:
        """Seconds the receiver spends on the message of `send` after it arrived."""
        table = self.receive_forward if send.kind is Kind.SEND_F else self.receive_backward
        return table[send.stage] if table else 0.0


@dataclass(frozen=True)
class Timed:
    """One action as it ran: a compute action on its rank, or a transfer (named by its SEND
    action, on the sending rank) from when it left to when it arrived."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def is_transfer(self) -> bool:
        return self.action.kind.is_comm


@dataclass(frozen=True)
class Wait:
    """A rank that cannot go on: its next action and what that waits for (which may be on
    another rank, or missing from the plan)."""

    rank: int
    step: int
    """Position of `action` in the rank's list."""
    action: Action
    waits_for: Action

    def __str__(self) -> str:
        return f"rank {self.rank} step {self.step}: {self.action} waits for {self.waits_for}"


@dataclass(frozen=True)
class DryRun:
    """What one dry run measured; with `stuck`, only the part that ran."""

    events: tuple[Timed, ...]
    """Compute actions and transfers, in the order the dry run timed them."""
    makespan: float
    """From time 0 to the end of the last rank."""
    busy: tuple[float, ...]
    """Per rank: time computing."""
    span: tuple[float, ...]
    """Per rank: from the start of its first compute action to the end of its last."""
    end: tuple[float, ...]
    """Per rank: when it finished its list (after its last compute, or later where a
    blocking transfer holds it)."""
    stuck: tuple[Wait, ...] = ()
    """Per rank that could not finish (deadlock): its next action and what it waits for."""
    finals: tuple[Timed, ...] = ()
    """Per stage, in stage order: its last gradient-producing action (BW or W; of those
    ending last, the first timed), when the stage's data-parallel reduction can end."""


_Message = tuple[Kind, int, int]  # (RECV_F or RECV_B, receiving stage, mb)


def _message(a: Action) -> _Message:
    """The message a transfer action sends or receives, named by its RECV."""
    if a.kind is Kind.SEND_F:
        return (Kind.RECV_F, a.stage + 1, a.mb)
    if a.kind is Kind.SEND_B:
        return (Kind.RECV_B, a.stage - 1, a.mb)
    return (a.kind, a.stage, a.mb)


_COMPUTE, _SEND, _RECV = 0, 1, 2  # op codes


_Link = tuple[int, int, int, int, Action]
"""A message's (sender rank, receiver rank, channel, cost index, its SEND action or, compiled
from a compute plan, the F, B or BW whose result it carries)."""


class Program:
    """A plan compiled for the engine: each rank's actions as tuples of small integers, every
    completion (a compute result or a message's arrival) a slot in one list, every message and
    channel an index. Built once per plan (`program`), run under any costs; the engine's
    results are those of interpreting the actions directly (tests/unit/test_dryrun_fast.py).

    With `lowering`, `plan` is compute-only and is compiled as its lowering by `add_comms`
    (the transfers where `lowering.apart` puts them), which `lowering()` builds only to name
    the actions of a deadlock.
    """

    def __init__(
        self,
        plan: Plan,
        stages: StageMap,
        lowering: Callable[[], Plan] | None = None,
        *,
        keep_slots: bool = False,
    ) -> None:
        if sorted(plan) != list(range(stages.pp)):
            raise ValueError(
                f"plan has ranks {sorted(plan)}; pp = {stages.pp} needs 0..{stages.pp - 1}"
            )
        self.stages = stages
        self._given, self._lower = plan, lowering
        self._lowering = lowering or (lambda: plan)
        if lowering is None:
            self._lowered(plan, stages, keep_slots)
        elif any(a.paired for actions in plan.values() for a in actions):
            # A pair's lowering moves its transfers around both passes (`add_comms`), which
            # `_compute` does not model: compile the lowering itself.
            self._lowered(self.plan, stages, keep_slots)
        else:
            self._compute(plan, stages, keep_slots)

    @cached_property
    def slots(self) -> dict[tuple[Kind, int, int], int]:
        """A result (F, B or W, stage, mb) or a message (as its RECV names it) -> its slot; a
        message's slot also indexes its SEND and RECV times. Not kept by the compiler (it
        is a third of a program's memory): compiled again for a deadlock report."""
        again = Program(self._given, self.stages, self._lower, keep_slots=True)
        return again.slots

    @cached_property
    def plan(self) -> Plan:
        """The lowered plan (or the compute-only one given without transfers), by rank."""
        return self._lowering()

    @cached_property
    def carried(self) -> set[_Message]:
        """Messages some transfer action of the plan names."""
        return {_message(a) for actions in self.plan.values() for a in actions if a.kind.is_comm}

    def _done(
        self,
        slots: dict[tuple[Kind, int, int], int],
        links: dict[int, _Link],
        channels: dict[tuple[int, int, Kind], int],
        computes: list[Action],
        keep_slots: bool,
    ) -> None:
        self.size, self.computes, self.channels = len(slots), computes, len(channels)
        if keep_slots:
            self.slots = slots
        self.links: list[_Link | None] = [links.get(i) for i in range(len(slots))]
        """Per slot: the message's link; None for results, and for messages no SEND carries."""

    def _lowered(self, plan: Plan, stages: StageMap, keep_slots: bool) -> None:
        """Compile a plan as given (with or without transfer actions)."""
        F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW  # noqa: N806
        SEND_F, SEND_B, RECV_F, RECV_B = Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B  # noqa: N806
        carried = self.carried = set()  # messages some transfer action names
        for actions in plan.values():
            for a in actions:
                k = a.kind
                if k is SEND_F:
                    carried.add((RECV_F, a.stage + 1, a.mb))
                elif k is SEND_B:
                    carried.add((RECV_B, a.stage - 1, a.mb))
                elif k is RECV_F or k is RECV_B:
                    carried.add((k, a.stage, a.mb))
        slots: dict[tuple[Kind, int, int], int] = {}
        """A result (F, B or W, stage, mb) or a message (as its RECV names it) -> its slot;
        a message's slot also indexes its SEND and RECV times."""
        slot = slots.setdefault
        links: dict[int, _Link] = {}
        channels: dict[tuple[int, int, Kind], int] = {}
        computes: list[Action] = []
        n, last = stages.stages, stages.last
        rank_of = [stages.rank(x) for x in range(n)]
        self.ops: list[list[tuple]] = []
        for r in range(stages.pp):
            ops = []
            for a in plan[r]:
                k, s, mb = a.kind, a.stage, a.mb
                if k is SEND_F or k is SEND_B:
                    key = (RECV_F, s + 1, mb) if k is SEND_F else (RECV_B, s - 1, mb)
                    i = slot(key, len(slots))
                    if i not in links:
                        dst = rank_of[key[1]] if 0 <= key[1] < n else stages.rank(key[1])
                        channel = channels.setdefault((rank_of[s], dst, key[0]), len(channels))
                        index = (0 if k is SEND_F else n) + s
                        links[i] = (rank_of[s], dst, channel, index, a)
                    payload = slot((F if k is SEND_F else B, s, mb), len(slots))
                    ops.append((_SEND, payload, i))
                    continue
                if k is RECV_F or k is RECV_B:
                    ops.append((_RECV, slot((k, s, mb), len(slots))))
                    continue
                if k is F:
                    key = (RECV_F, s, mb)
                    if s == 0:
                        needs: tuple[int, ...] = ()
                    else:
                        needs = (slot(key if key in carried else (F, s - 1, mb), len(slots)),)
                    index, done, grad = s, (F, s, mb), False
                elif k is W:
                    needs = (slot((B, s, mb), len(slots)),)
                    index, done, grad = 2 * n + s, (W, s, mb), True
                else:  # B or BW
                    needs = (slot((F, s, mb), len(slots)),)
                    if s < last:
                        key = (RECV_B, s, mb)
                        needs += (slot(key if key in carried else (B, s + 1, mb), len(slots)),)
                    index, done, grad = (n if k is B else 3 * n) + s, (B, s, mb), k is BW
                ops.append((_COMPUTE, needs, slot(done, len(slots)), index, len(computes), grad))
                computes.append(a)
            self.ops.append(ops)
        self._done(slots, links, channels, computes, keep_slots)

    def _compute(self, compute: Plan, stages: StageMap, keep_slots: bool) -> None:
        """Compile a compute-only plan as `add_comms` lowers it."""
        F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW  # noqa: N806
        RECV_F, RECV_B = Kind.RECV_F, Kind.RECV_B  # noqa: N806
        below, above = apart(stages)
        slots: dict[tuple[Kind, int, int], int] = {}
        slot = slots.setdefault
        links: dict[int, _Link] = {}
        channels: dict[tuple[int, int, Kind], int] = {}
        computes: list[Action] = []
        n, last = stages.stages, stages.last
        rank_of = [stages.rank(x) for x in range(n)]
        self.ops: list[list[tuple]] = []
        for r in range(stages.pp):
            ops: list[tuple] = []
            append = ops.append
            for a in compute[r]:
                k, s, mb = a.kind, a.stage, a.mb
                if k is F:
                    if below[s]:
                        i = slot((RECV_F, s, mb), len(slots))
                        append((_RECV, i))
                        needs: tuple[int, ...] = (i,)
                    else:
                        needs = () if s == 0 else (slot((F, s - 1, mb), len(slots)),)
                    done = slot((F, s, mb), len(slots))
                    append((_COMPUTE, needs, done, s, len(computes), False))
                    computes.append(a)
                    if above[s]:
                        i = slot((RECV_F, s + 1, mb), len(slots))
                        if i not in links:
                            src, dst = rank_of[s], rank_of[s + 1]
                            channel = channels.setdefault((src, dst, RECV_F), len(channels))
                            links[i] = (src, dst, channel, s, a)
                        append((_SEND, done, i))
                elif k is W:
                    needs = (slot((B, s, mb), len(slots)),)
                    append(
                        (
                            _COMPUTE,
                            needs,
                            slot((W, s, mb), len(slots)),
                            2 * n + s,
                            len(computes),
                            True,
                        )
                    )
                    computes.append(a)
                else:  # B or BW
                    needs = (slot((F, s, mb), len(slots)),)
                    if above[s]:
                        i = slot((RECV_B, s, mb), len(slots))
                        append((_RECV, i))
                        needs += (i,)
                    elif s < last:
                        needs += (slot((B, s + 1, mb), len(slots)),)
                    done = slot((B, s, mb), len(slots))
                    index = (n if k is B else 3 * n) + s
                    append((_COMPUTE, needs, done, index, len(computes), k is BW))
                    computes.append(a)
                    if below[s]:
                        i = slot((RECV_B, s - 1, mb), len(slots))
                        if i not in links:
                            src, dst = rank_of[s], rank_of[s - 1]
                            channel = channels.setdefault((src, dst, RECV_B), len(channels))
                            links[i] = (src, dst, channel, n + s, a)
                        append((_SEND, done, i))
            self.ops.append(ops)
        self._done(slots, links, channels, computes, keep_slots)

    @cached_property
    def present(self) -> set[Action]:
        return {a for actions in self.plan.values() for a in actions}


def program(plan: Plan, stages: StageMap, lowering: Callable[[], Plan] | None = None) -> Program:
    """`plan` compiled for `dry_run` (raises ValueError if its ranks are not 0..pp-1); with
    `lowering`, `plan` is compute-only and runs as its `add_comms` lowering (`Program`)."""
    return Program(plan, stages, lowering)
