"""`dry_run` and its engine, by the rules `ptdp.pipeline.dryrun`'s docstring states: the
state of one run of a compiled `Program` under one set of costs, each rank moved as far as
its inputs allow until none can; for a deadlock, what each stuck rank waits for, named as
the plan names it. Pure: no torch.
"""

from __future__ import annotations

import bisect

from ptdp.pipeline.actions import Action, Kind, Plan
from ptdp.pipeline.dryrun import (
    CommModel,
    Cost,
    DryRun,
    PipelineCosts,
    Program,
    Timed,
    Wait,
    _Message,
    _message,
    program,
)
from ptdp.pipeline.placement import StageMap

_SEND_OF = {Kind.RECV_F: Kind.SEND_F, Kind.RECV_B: Kind.SEND_B}


def dry_run(
    plan: Plan | Program,
    stages: StageMap,
    cost: PipelineCosts | Cost,
    *,
    comms: CommModel = CommModel.ASYNC,
    events: bool = True,
) -> DryRun:
    """Run every rank of `plan` (ranks 0..pp-1) in simulated time (the rules are in
    `ptdp.pipeline.dryrun`'s docstring).

    Args:
        plan: rank -> actions, with or without transfer actions; or its `Program` (`program`),
            which a caller replaying one plan under many costs compiles once.
        stages: which rank holds each stage.
        cost: a `PipelineCosts`, or a function giving each compute action's duration (then
            every transfer is free), e.g. `lambda a: UNIT_COST[a.kind]`.
        comms: how transfers occupy the ranks.
        events: False: `DryRun.events` is empty (the totals and `finals` are the same).
    """
    code = plan if isinstance(plan, Program) else program(plan, stages)
    if code.stages != stages:
        raise ValueError(f"program compiled for {code.stages}, run with {stages}")
    return _Engine(code, cost, comms, events).run()


def _payload(send: Action) -> Action:
    """The compute action whose result SEND action `send` carries (BW read as B)."""
    return Action(Kind.F if send.kind is Kind.SEND_F else Kind.B, send.stage, send.mb)


def _sender(key: _Message) -> Action:
    kind, stage, mb = key
    return Action(_SEND_OF[kind], stage - 1 if kind is Kind.RECV_F else stage + 1, mb)


def _input_keys(
    kind: Kind, s: int, mb: int, carried: set[_Message], last: int
) -> list[tuple[Kind, int, int]]:
    """What compute action (kind, s, mb) needs: earlier results (kind F, B or W) or messages
    in transit (RECV_F, RECV_B), as slot keys. A fused BW's result is its B's."""
    if kind is Kind.F:
        if s == 0:
            return []
        key = (Kind.RECV_F, s, mb)
        return [key if key in carried else (Kind.F, s - 1, mb)]
    if kind is Kind.W:
        return [(Kind.B, s, mb)]
    needs = [(Kind.F, s, mb)]  # B or BW
    if s < last:
        key = (Kind.RECV_B, s, mb)
        needs.append(key if key in carried else (Kind.B, s + 1, mb))
    return needs


class _Engine:
    """The state of one dry run of a `Program`; `run` moves each rank as far as it can until
    none can."""

    def __init__(
        self, code: Program, cost: PipelineCosts | Cost, comms: CommModel, record: bool
    ) -> None:
        self.code, self.comms, self.record = code, comms, record
        stages = code.stages
        n = stages.stages
        if isinstance(cost, PipelineCosts):
            by_kind = [
                [cost.duration(Action(kind, s, 0)) for s in range(n)]
                for kind in (Kind.F, Kind.B, Kind.W, Kind.BW)
            ]
            self.durations = [x for row in by_kind for x in row]
            self.by_action = False
            sends = [Action(k, s, 0) for k in (Kind.SEND_F, Kind.SEND_B) for s in range(n)]
            self.wire = [cost.transfer(a) for a in sends]
            self.after = [cost.receive(a) for a in sends]
        else:
            self.durations = [cost(a) for a in code.computes]
            self.by_action = True
            self.wire = self.after = [0] * (2 * n)  # _free's
        self.ready: list[float | None] = [None] * code.size
        self.sent: list[float | None] = [None] * code.size  # by message: SEND posted at
        self.posted: list[float | None] = [None] * code.size  # RECV posted at
        self.channel_free: list[float] = [0] * code.channels
        ranks = range(stages.pp)
        self.egress: list[list[tuple[float, float]]] = [[] for _ in ranks]  # busy, by start
        self.ingress: list[list[tuple[float, float]]] = [[] for _ in ranks]
        self.step = [0 for _ in ranks]  # next action of each rank
        self.clock: list[float] = [0 for _ in ranks]  # when each rank is free
        self.busy: list[float] = [0 for _ in ranks]
        self.first: list[float | None] = [None for _ in ranks]
        self.last_end: list[float | None] = [None for _ in ranks]
        self.events: list[Timed] = []
        self.finals: dict[int, tuple[int, int, float, float]] = {}  # stage -> its last BW/W

    def run(self) -> DryRun:
        code = self.code
        ranks = range(code.stages.pp)
        while self._pass():
            pass
        stuck = tuple(
            Wait(r, self.step[r], code.plan[r][self.step[r]], self._blocker(r))
            for r in ranks
            if self.step[r] < len(code.ops[r])
        )
        span = tuple(
            0 if self.first[r] is None else self.last_end[r] - self.first[r] for r in ranks
        )
        finals = tuple(
            Timed(r, code.computes[i], start, end)
            for _, (r, i, start, end) in sorted(self.finals.items())
        )
        return DryRun(
            tuple(self.events),
            max(self.clock, default=0),
            tuple(self.busy),
            span,
            tuple(self.clock),
            stuck,
            finals,
        )

    def _pass(self) -> bool:
        """Run every rank in turn as far as it can go; True if any moved."""
        code = self.code
        ready, sent, posted, transfer = self.ready, self.sent, self.posted, self._transfer
        durations, computes = self.durations, code.computes
        at = 4 if self.by_action else 3  # where a compute op holds its duration's index
        record, events, finals = self.record, self.events, self.finals
        blocking = self.comms is CommModel.BLOCKING
        recv_blocks = self.comms is CommModel.RECV_BLOCKS
        steps, clocks, busies = self.step, self.clock, self.busy
        moved = False
        for rank, ops in enumerate(code.ops):
            step = steps[rank]
            n = len(ops)
            if step == n:
                continue
            clock, busy = clocks[rank], busies[rank]
            first, last_end = self.first[rank], self.last_end[rank]
            while step < n:
                op = ops[step]
                if op[0] == 0:  # _COMPUTE
                    start = clock
                    for slot in op[1]:
                        t = ready[slot]
                        if t is None:
                            break
                        if t > start:
                            start = t
                    else:
                        seconds = durations[op[at]]
                        end = clock = start + seconds
                        busy += seconds
                        if first is None:
                            first = start
                        last_end = end
                        ready[op[2]] = end
                        if record:
                            events.append(Timed(rank, computes[op[4]], start, end))
                        if op[5]:
                            stage = computes[op[4]].stage
                            final = finals.get(stage)
                            if final is None or end > final[3]:
                                finals[stage] = (rank, op[4], start, end)
                        step += 1
                        continue
                    break
                if op[0] == 1:  # _SEND
                    made = ready[op[1]]
                    if made is None:
                        break
                    if made > clock:
                        clock = made
                    i = op[2]
                    if blocking:
                        clock = transfer(i, clock)
                    else:
                        sent[i] = clock
                        if posted[i] is not None and ready[i] is None:
                            transfer(i, clock, posted[i])
                    step += 1
                    continue
                i = op[1]  # a RECV: its message's slot
                if blocking:
                    arrived = ready[i]
                    if arrived is None:
                        break
                    if arrived > clock:
                        clock = arrived
                    step += 1
                    continue
                if posted[i] is None:
                    posted[i] = clock
                if sent[i] is not None and ready[i] is None:
                    transfer(i, sent[i], posted[i])
                if recv_blocks:
                    arrived = ready[i]
                    if arrived is None:
                        break
                    if arrived > clock:
                        clock = arrived
                step += 1
            if step != steps[rank]:
                moved = True
                steps[rank], clocks[rank], busies[rank] = step, clock, busy
                self.first[rank], self.last_end[rank] = first, last_end
        return moved

    # ------------------------------------------------------------------ transfers

    def _transfer(self, i: int, *not_before: float) -> float:
        """Time message `i` once it may start; return when it has left the sender (it is
        usable at its arrival, after the receiver's own work on it)."""
        src, dst, channel, index, send = self.code.links[i]  # type: ignore[misc]
        seconds = self.wire[index]
        out, into = self.egress[src], self.ingress[dst]
        start = self.channel_free[channel]
        for t in not_before:
            if t > start:
                start = t
        if (not out or out[-1][1] <= start) and (not into or into[-1][1] <= start):
            # Both cards free from `start` on (their intervals all end by then): the loop
            # below would keep `start`, and the insorts append.
            end = self.channel_free[channel] = start + seconds
            if seconds > 0:
                out.append((start, end))
                into.append((start, end))
        else:
            while True:  # the first start at which both the sender's and receiver's cards are free
                fits = _first_gap(into, _first_gap(out, start, seconds), seconds)
                if fits == start:
                    break
                start = fits
            end = self.channel_free[channel] = start + seconds
            if seconds > 0:
                bisect.insort(out, (start, end))
                bisect.insort(into, (start, end))
        arrival = self.ready[i] = end + self.after[index]
        if self.record:
            if not send.kind.is_comm:  # the pass whose result it carries
                kind = Kind.SEND_F if send.kind is Kind.F else Kind.SEND_B
                send = Action(kind, send.stage, send.mb)
            self.events.append(Timed(src, send, start, arrival))
        return end

    # ------------------------------------------------------------------ deadlock

    def _blocker(self, rank: int) -> Action:
        """What the next action of stuck `rank` waits for, as the plan names it."""
        code = self.code
        a = code.plan[rank][self.step[rank]]
        if a.kind in (Kind.SEND_F, Kind.SEND_B):
            return self._named(_payload(a))
        if a.kind.is_comm:  # a blocking RECV: on its SEND
            return _sender(_message(a))
        keys = _input_keys(a.kind, a.stage, a.mb, code.carried, code.stages.last)
        need = next(k for k in keys if self.ready[code.slots[k]] is None)
        if need[0] in (Kind.F, Kind.B, Kind.W):
            return self._named(Action(*need))
        if self.posted[code.slots[need]] is None:  # its RECV has not been posted
            return Action(*need)
        return _sender(need)

    def _named(self, a: Action) -> Action:
        """`a` as the plan has it: a B that the plan runs fused is its BW."""
        fused = Action(Kind.BW, a.stage, a.mb)
        return fused if a.kind is Kind.B and a not in self.code.present else a


def _free(a: Action) -> float:
    return 0


def _first_gap(busy: list[tuple[float, float]], ready: float, seconds: float) -> float:
    """The earliest start >= `ready` at which `seconds` fit between the `busy` intervals
    (sorted, disjoint, so their ends are sorted too: past the last end, `ready` itself)."""
    if not busy or busy[-1][1] <= ready:
        return ready
    start = ready
    first = max(0, bisect.bisect_left(busy, (ready,)) - 1)
    for begin, end in busy[first:]:
        if end <= start:
            continue
        if begin >= start + seconds:
            break
        start = end
    return start
