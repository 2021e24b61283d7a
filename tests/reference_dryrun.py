"""The dry-run engine as it was before `ptdp.pipeline.dryrun` compiled plans into programs:
kept only as the reference the fast engine is checked against (tests/unit/test_dryrun_fast.py).
Not imported by ptdp."""

from __future__ import annotations

import bisect

from ptdp.pipeline.actions import Action, Kind, Plan
from ptdp.pipeline.dryrun import (
    CommModel,
    Cost,
    DryRun,
    PipelineCosts,
    Timed,
    Wait,
    _Message,
    _message,
)
from ptdp.pipeline.dryrun_engine import _free, _payload, _sender
from ptdp.pipeline.placement import StageMap


def reference_dry_run(
    plan: Plan, stages: StageMap, cost: PipelineCosts | Cost, comms: CommModel = CommModel.ASYNC
) -> DryRun:
    """The old engine's dry run of `plan`."""
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


def _first_gap(busy: list[tuple[float, float]], ready: float, seconds: float) -> float:
    start = ready
    first = max(0, bisect.bisect_left(busy, (ready,)) - 1)
    for begin, end in busy[first:]:
        if end <= start:
            continue
        if begin >= start + seconds:
            break
        start = end
    return start


def reference_add_comms(plan: Plan, stages: StageMap) -> Plan:
    """`ptdp.pipeline.lowering.add_comms` as it was before it read the ranks from a table,
    with a pair (two adjacent paired actions) lowered as one: both receives, both passes,
    both sends."""
    last = stages.last

    def around(a: Action) -> tuple[list[Action], list[Action]]:
        if a.kind is Kind.F:
            before = _comm(Kind.RECV_F, a, a.stage - 1, stages, a.stage > 0)
            return before, _comm(Kind.SEND_F, a, a.stage + 1, stages, a.stage < last)
        if a.kind in (Kind.B, Kind.BW):
            before = _comm(Kind.RECV_B, a, a.stage + 1, stages, a.stage < last)
            return before, _comm(Kind.SEND_B, a, a.stage - 1, stages, a.stage > 0)
        return [], []

    lowered: Plan = {}
    for rank, actions in plan.items():
        out: list[Action] = []
        i = 0
        while i < len(actions):
            n = 2 if actions[i].paired and i + 1 < len(actions) and actions[i + 1].paired else 1
            group = actions[i : i + n]
            sides = [around(a) for a in group]
            out += [x for before, _ in sides for x in before] + group
            out += [x for _, after in sides for x in after]
            i += n
        lowered[rank] = out
    return lowered


def _comm(kind: Kind, a: Action, peer: int, stages: StageMap, exists: bool) -> list[Action]:
    if not exists or stages.same_rank(peer, a.stage):
        return []
    return [Action(kind, a.stage, a.mb)]
