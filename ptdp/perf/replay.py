"""Replays pipeline action lists in simulated time.

`replay` runs every pipeline rank's list from `ptdp.pipeline.schedules` (after
`add_comms`): the same lists the runtime executes and `verify` checks (DESIGN invariant
1), with real durations instead of verify's unit times. A compute action starts when its
rank is free and its input has arrived. By default (ptdp's runtime) a SEND costs its rank
nothing and its transfer starts once the receiver has posted the matching RECV and the
previous message on that channel has left; the consumer waits for the arrival. With
`blocking=True` the rank carries its transfers itself. Contention between channels that
share a network card is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.perf.timeline import Event
from ptdp.pipeline.actions import Action, Kind, Plan
from ptdp.pipeline.placement import StageMap


@dataclass(frozen=True)
class PipelineCosts:
    """Seconds of each action of each global stage; transfers by sending stage."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    send_forward: tuple[float, ...]
    """Stage s -> s + 1, activation, arrival after the send is matched."""
    send_backward: tuple[float, ...]
    """Stage s -> s - 1, gradient."""

    @classmethod
    def unit(cls, stages: int) -> PipelineCosts:
        """verify's dry-run costs: F = B = W = 1 (BW = 2), free transfers."""
        ones, zeros = (1.0,) * stages, (0.0,) * stages
        return cls(ones, ones, ones, zeros, zeros)

    def duration(self, a: Action) -> float:
        s = a.stage
        return {
            Kind.F: self.forward[s],
            Kind.B: self.backward_input[s],
            Kind.W: self.backward_weight[s],
            Kind.BW: self.backward_input[s] + self.backward_weight[s],
        }.get(a.kind, 0.0)


@dataclass(frozen=True)
class PipelineRun:
    """What one replay of a plan measured."""

    events: tuple[Event, ...]
    """Compute actions (lane "compute") and transfers (lane "p2p", on the sender)."""
    makespan: float
    busy: tuple[float, ...]
    """Per rank: seconds computing."""
    rank_end: tuple[float, ...]
    """Per rank: end of its last compute action."""

    @property
    def ideal(self) -> float:
        """The busiest rank's compute: the step time without a bubble."""
        return max(self.busy)

    @property
    def bubble_fraction(self) -> float:
        """The paper's bubble time / ideal time (not idle / total)."""
        return (self.makespan - self.ideal) / self.ideal


_Key = tuple[str, int, int]  # (direction "F"/"B", receiving stage, mb)


def _message(a: Action) -> _Key:
    if a.kind is Kind.SEND_F:
        return ("F", a.stage + 1, a.mb)
    if a.kind is Kind.SEND_B:
        return ("B", a.stage - 1, a.mb)
    return ("F" if a.kind is Kind.RECV_F else "B", a.stage, a.mb)


def replay(
    plan: Plan, stages: StageMap, costs: PipelineCosts, *, blocking: bool = False
) -> PipelineRun:
    """Run every rank's actions in simulated time (see the module docstring).

    `blocking`: the rank itself carries each transfer: a SEND occupies it until the
    message has left, a RECV holds it until the message is in (Megatron-LM in 2021, which
    synchronised after each batch of point-to-point operations), instead of ptdp's
    asynchronous sends and receives waited on when their tensor is needed.
    """
    pp, last = stages.pp, stages.last
    recv_actions = {_message(a) for acts in plan.values() for a in acts if a.kind.is_comm}
    done: dict[tuple[Kind, int, int], float] = {}  # (F or B, stage, mb) -> finish
    sends: dict[_Key, float] = {}  # posted, not blocking: key -> time
    recvs: dict[_Key, float] = {}
    arrival: dict[_Key, float] = {}
    channel_free: dict[tuple[int, int, str], float] = {}
    clock, busy = [0.0] * pp, [0.0] * pp
    step = [0] * pp
    events: list[Event] = []

    def transfer(key: _Key, *not_before: float) -> float:
        """Time the message `key` once it may start; return its arrival."""
        direction, stage, mb = key
        sender = stage - 1 if direction == "F" else stage + 1
        src, dst = stages.rank(sender), stages.rank(stage)
        seconds = (costs.send_forward if direction == "F" else costs.send_backward)[sender]
        start = max(channel_free.get((src, dst, direction), 0.0), *not_before)
        arrival[key] = channel_free[(src, dst, direction)] = start + seconds
        kind = "SEND_F" if direction == "F" else "SEND_B"
        events.append(Event(src, sender, mb, kind, start, start + seconds, "p2p"))
        return arrival[key]

    def post(rank: int, a: Action) -> bool:
        """Run comm action `a` on `rank`; False if it must wait (blocking RECV)."""
        key = _message(a)
        is_send = a.kind in (Kind.SEND_F, Kind.SEND_B)
        if blocking and is_send:
            clock[rank] = transfer(key, clock[rank])
        elif blocking:
            if key not in arrival:
                return False
            clock[rank] = max(clock[rank], arrival[key])
        else:  # rendezvous: the transfer starts once both sides have posted
            (sends if is_send else recvs)[key] = clock[rank]
            if key in sends and key in recvs:
                transfer(key, sends[key], recvs[key])
        return True

    def ready(a: Action) -> float | None:
        """When `a`'s input is available, or None if not yet known."""
        s, mb = a.stage, a.mb
        if a.kind is Kind.F and s > 0:
            key = ("F", s, mb)
            return arrival.get(key) if key in recv_actions else done.get((Kind.F, s - 1, mb))
        if a.kind in (Kind.B, Kind.BW) and s < last:
            key = ("B", s, mb)
            return arrival.get(key) if key in recv_actions else done.get((Kind.B, s + 1, mb))
        return 0.0

    def advance(rank: int, actions: list[Action]) -> bool:
        """Run `rank` as far as it can go; True if it moved."""
        moved = False
        while step[rank] < len(actions):
            a = actions[step[rank]]
            if a.kind.is_comm:
                if not post(rank, a):
                    return moved
            else:
                t = ready(a)
                if t is None:
                    return moved
                start = max(clock[rank], t)
                seconds = costs.duration(a)
                clock[rank] = start + seconds
                busy[rank] += seconds
                kind = Kind.B if a.kind is Kind.BW else a.kind
                done[(kind, a.stage, a.mb)] = clock[rank]
                events.append(Event(rank, a.stage, a.mb, a.kind.value, start, clock[rank]))
            step[rank] += 1
            moved = True
        return moved

    while any([advance(rank, actions) for rank, actions in plan.items()]):
        pass
    stuck = [r for r in plan if step[r] < len(plan[r])]
    if stuck:
        raise ValueError(f"replay deadlocked on ranks {stuck}; run ptdp.pipeline.verify on it")
    return PipelineRun(tuple(events), max(clock), tuple(busy), tuple(clock))
