"""One dry run of a pipeline plan in simulated time: the verifier's and the simulator's engine.

`dry_run(plan, stages, cost)` runs every rank's action list (compute-only, or lowered by
`add_comms`) with a duration per action and returns when each action ran, the makespan, and
per rank the time computing, the span from its first compute to its last, and where it ended;
or, if the ranks cannot all finish, what each stuck rank waits for. `ptdp.pipeline.verify`
calls it at unit costs (F = B = W = 1, BW = 2, free transfers) and `ptdp.perf.replay` with
the performance model's seconds; a benchmark can call it with measured ones. Pure: no torch.

A compute action starts when its rank is free and its inputs are there: F(s) needs the
output of stage s - 1, B or BW(s) its own F and the input gradient from stage s + 1, W its
B. Between stages on the same rank (pp = 1, ZB-V's turn), or in a compute-only plan, the
dependency is direct and free; otherwise the message travels from the SEND on one rank to
the RECV on the other, and `CommModel` says how. A rank's messages leave (and arrive)
through its own cards one at a time, whichever neighbour and direction they go to.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from ptdp.pipeline.actions import Action, Kind, Plan
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


_Message = tuple[Kind, int, int]  # (RECV_F or RECV_B, receiving stage, mb)
_SEND_OF = {Kind.RECV_F: Kind.SEND_F, Kind.RECV_B: Kind.SEND_B}


def _message(a: Action) -> _Message:
    """The message a transfer action sends or receives, named by its RECV."""
    if a.kind is Kind.SEND_F:
        return (Kind.RECV_F, a.stage + 1, a.mb)
    if a.kind is Kind.SEND_B:
        return (Kind.RECV_B, a.stage - 1, a.mb)
    return (a.kind, a.stage, a.mb)


def _payload(send: Action) -> Action:
    """The compute action whose result SEND action `send` carries (BW read as B)."""
    return Action(Kind.F if send.kind is Kind.SEND_F else Kind.B, send.stage, send.mb)


def _sender(key: _Message) -> Action:
    kind, stage, mb = key
    return Action(_SEND_OF[kind], stage - 1 if kind is Kind.RECV_F else stage + 1, mb)


def dry_run(
    plan: Plan,
    stages: StageMap,
    cost: PipelineCosts | Cost,
    *,
    comms: CommModel = CommModel.ASYNC,
) -> DryRun:
    """Run every rank of `plan` (ranks 0..pp-1) in simulated time (see the module docstring).

    Args:
        plan: rank -> actions, with or without transfer actions.
        stages: which rank holds each stage.
        cost: a `PipelineCosts`, or a function giving each compute action's duration (then
            every transfer is free), e.g. `lambda a: UNIT_COST[a.kind]`.
        comms: how transfers occupy the ranks.
    """
    if sorted(plan) != list(range(stages.pp)):
        raise ValueError(
            f"plan has ranks {sorted(plan)}; pp = {stages.pp} needs 0..{stages.pp - 1}"
        )
    return _Engine(plan, stages, cost, comms).run()


class _Engine:
    """The state of one dry run; `run` moves each rank as far as it can until none can."""

    def __init__(
        self, plan: Plan, stages: StageMap, cost: PipelineCosts | Cost, comms: CommModel
    ) -> None:
        self.plan, self.stages, self.comms = plan, stages, comms
        if isinstance(cost, PipelineCosts):
            self.compute_cost, self.transfer_cost = cost.duration, cost.transfer
            self.receive_cost = cost.receive
        else:
            self.compute_cost, self.transfer_cost, self.receive_cost = cost, _free, _free
        self.present = {a for actions in plan.values() for a in actions}
        self.carried = {_message(a) for a in self.present if a.kind.is_comm}
        self.done: dict[tuple[Kind, int, int], float] = {}  # (F, B or W, stage, mb) -> end
        self.sent: dict[_Message, float] = {}  # SEND posted at
        self.posted: dict[_Message, float] = {}  # RECV posted at
        self.arrival: dict[_Message, float] = {}
        self.channel_free: dict[tuple[int, int, Kind], float] = {}
        self.egress: dict[int, list[tuple[float, float]]] = {}  # rank -> busy, by start
        self.ingress: dict[int, list[tuple[float, float]]] = {}
        ranks = range(stages.pp)
        self.step = [0 for _ in ranks]  # next action of each rank
        self.clock: list[float] = [0 for _ in ranks]  # when each rank is free
        self.busy: list[float] = [0 for _ in ranks]
        self.first: list[float | None] = [None for _ in ranks]
        self.last_end: list[float | None] = [None for _ in ranks]
        self.events: list[Timed] = []

    def run(self) -> DryRun:
        ranks = range(self.stages.pp)
        while any([self._advance(rank) for rank in ranks]):  # every rank, each pass
            pass
        stuck = tuple(
            Wait(r, self.step[r], self.plan[r][self.step[r]], self._blocker(r))
            for r in ranks
            if self.step[r] < len(self.plan[r])
        )
        span = tuple(
            0 if self.first[r] is None else self.last_end[r] - self.first[r] for r in ranks
        )
        return DryRun(
            tuple(self.events),
            max(self.clock, default=0),
            tuple(self.busy),
            span,
            tuple(self.clock),
            stuck,
        )

    def _advance(self, rank: int) -> bool:
        """Run `rank` as far as it can go; True if it moved."""
        actions, moved = self.plan[rank], False
        while self.step[rank] < len(actions):
            a = actions[self.step[rank]]
            ran = self._transfer_action(rank, a) if a.kind.is_comm else self._compute(rank, a)
            if not ran:
                break
            self.step[rank] += 1
            moved = True
        return moved

    # ------------------------------------------------------------------ compute

    def _inputs(self, a: Action) -> list[Action | _Message]:
        """What compute action `a` needs: earlier compute actions, or messages in transit."""
        s, mb = a.stage, a.mb
        if a.kind is Kind.F:
            if s == 0:
                return []
            key = (Kind.RECV_F, s, mb)
            return [key if key in self.carried else Action(Kind.F, s - 1, mb)]
        if a.kind is Kind.W:
            return [Action(Kind.B, s, mb)]
        needs: list[Action | _Message] = [Action(Kind.F, s, mb)]  # B or BW
        if s < self.stages.last:
            key = (Kind.RECV_B, s, mb)
            needs.append(key if key in self.carried else Action(Kind.B, s + 1, mb))
        return needs

    def _ready(self, need: Action | _Message) -> float | None:
        """When `need` is met, or None if not yet."""
        if isinstance(need, Action):
            return self.done.get((need.kind, need.stage, need.mb))
        return self.arrival.get(need)

    def _compute(self, rank: int, a: Action) -> bool:
        times = [self._ready(need) for need in self._inputs(a)]
        if any(t is None for t in times):
            return False
        start = max([self.clock[rank], *times])
        seconds = self.compute_cost(a)
        end = self.clock[rank] = start + seconds
        self.busy[rank] += seconds
        if self.first[rank] is None:
            self.first[rank] = start
        self.last_end[rank] = end
        self.done[(Kind.B if a.kind is Kind.BW else a.kind, a.stage, a.mb)] = end
        self.events.append(Timed(rank, a, start, end))
        return True

    # ------------------------------------------------------------------ transfers

    def _transfer_action(self, rank: int, a: Action) -> bool:
        """Post, or carry, transfer action `a`; False if `rank` must wait."""
        key, is_send = _message(a), a.kind in (Kind.SEND_F, Kind.SEND_B)
        if is_send:  # after the pass whose result it carries
            made = self._ready(_payload(a))
            if made is None:
                return False
            self.clock[rank] = max(self.clock[rank], made)
        if self.comms is CommModel.BLOCKING:
            if is_send:
                self.clock[rank] = self._transfer(key, self.clock[rank])
                return True
            if key not in self.arrival:
                return False
            self.clock[rank] = max(self.clock[rank], self.arrival[key])
            return True
        if is_send:
            self.sent[key] = self.clock[rank]
        else:
            self.posted.setdefault(key, self.clock[rank])  # a blocked RECV's clock stands
        if key in self.sent and key in self.posted and key not in self.arrival:
            self._transfer(key, self.sent[key], self.posted[key])
        if self.comms is CommModel.RECV_BLOCKS and not is_send:
            if key not in self.arrival:
                return False
            self.clock[rank] = max(self.clock[rank], self.arrival[key])
        return True

    def _transfer(self, key: _Message, *not_before: float) -> float:
        """Time message `key` once it may start; return when it has left the sender (it is
        usable at `arrival`, after the receiver's own work on it)."""
        send = _sender(key)
        src, dst = self.stages.rank(send.stage), self.stages.rank(key[1])
        channel = (src, dst, key[0])
        seconds = self.transfer_cost(send)
        out, into = self.egress.setdefault(src, []), self.ingress.setdefault(dst, [])
        start = max(self.channel_free.get(channel, 0), *not_before)
        while True:  # the first start at which both the sender's and receiver's cards are free
            fits = _first_gap(into, _first_gap(out, start, seconds), seconds)
            if fits == start:
                break
            start = fits
        end = self.channel_free[channel] = start + seconds
        if seconds > 0:
            bisect.insort(out, (start, end))
            bisect.insort(into, (start, end))
        self.arrival[key] = end + self.receive_cost(send)
        self.events.append(Timed(src, send, start, self.arrival[key]))
        return end

    # ------------------------------------------------------------------ deadlock

    def _blocker(self, rank: int) -> Action:
        """What the next action of stuck `rank` waits for, as the plan names it."""
        a = self.plan[rank][self.step[rank]]
        if a.kind in (Kind.SEND_F, Kind.SEND_B):
            return self._named(_payload(a))
        if a.kind.is_comm:  # a blocking RECV: on its SEND
            return _sender(_message(a))
        need = next(n for n in self._inputs(a) if self._ready(n) is None)
        if isinstance(need, Action):
            return self._named(need)
        if need not in self.posted:  # its RECV has not been posted
            return Action(*need)
        return _sender(need)

    def _named(self, a: Action) -> Action:
        """`a` as the plan has it: a B that the plan runs fused is its BW."""
        fused = Action(Kind.BW, a.stage, a.mb)
        return fused if a.kind is Kind.B and a not in self.present else a


def _free(a: Action) -> float:
    return 0


def _first_gap(busy: list[tuple[float, float]], ready: float, seconds: float) -> float:
    """The earliest start >= `ready` at which `seconds` fit between the `busy` intervals
    (sorted, disjoint, so their ends are sorted too)."""
    start = ready
    first = max(0, bisect.bisect_left(busy, (ready,)) - 1)
    for begin, end in busy[first:]:
        if end <= start:
            continue
        if begin >= start + seconds:
            break
        start = end
    return start
