"""Checks that a pipeline plan can run, by rules and by a unit-time dry run of all ranks.

`verify` returns a `ScheduleReport` or raises `ScheduleError` whose message names the problem
and shows a step x rank table (one column per rank, one row per position in the rank's list,
failing cells marked `<<`, after PyTorch's `_format_pipeline_order`). Rules, in check order:

1. every action runs on its stage's rank (the `StageMap`), with stage < pp * vpp and mb < m;
2. every (stage, mb) runs one F and either one BW or one B and one W;
3. every action comes after what it needs on its own rank (F(s) after F(s - 1), B/BW(s) after
   F(s) and B/BW(s + 1), W after its B, a SEND after the pass whose result it carries) and, in a
   plan with comms, F and B/BW after the RECV that brings their input;
4. paired actions (`Action.paired`) come in couples of one F and one B or BW, with no other
   compute action between them (only their transfers, in a plan with comms);
5. with comms, each SEND has its RECV on the peer and vice versa, and on each channel (sender,
   receiver, F or B) the receiver receives in the order the sender sends, as point-to-point
   messages match in order;
6. the dry run finishes (no deadlock);
7. in-flight activations stay within a given bound: a microbatch is in flight on a stage from
   its F until its BW, or until its W when the backward is split, as the runtime holds it (B
   leaves the graph, or the stashed weight-gradient inputs, for W).

Dry-run model (`ptdp.pipeline.dryrun`, the engine the simulator replays plans with, here at
`CommModel.RECV_BLOCKS`): F = B = W = 1 and BW = 2 time units; comms take no time; a SEND never
blocks (the runtime posts it asynchronously) while a RECV blocks its rank until the matching
SEND has run. A compute-only plan is dry-run with direct dependencies between stages.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NoReturn

from ptdp.pipeline.actions import BACKWARD_KINDS, RELEASE_KINDS, Action, Kind, Plan
from ptdp.pipeline.dryrun import CommModel
from ptdp.pipeline.dryrun_engine import dry_run
from ptdp.pipeline.paired import pairs
from ptdp.pipeline.placement import StageMap

Cell = tuple[int, int]
"""(rank, step): position of an action in a plan."""
_Needs = list[tuple[Action, str]]  # what an action waits for, each with the reason

MARK = "<<"
UNIT_COST: dict[Kind, int] = {Kind.F: 1, Kind.B: 1, Kind.W: 1, Kind.BW: 2}
"""Dry-run time of each compute kind; comm kinds take none."""
CHUNK_COST = UNIT_COST[Kind.F] + UNIT_COST[Kind.B] + UNIT_COST[Kind.W]
"""Ideal time of one microbatch through one model chunk (F + B + W, which BW equals)."""
_CONTEXT = 6  # table rows kept around each marked cell in error messages

_PEER_STEP = {Kind.SEND_F: 1, Kind.RECV_F: -1, Kind.SEND_B: -1, Kind.RECV_B: 1}
_MATCH = {Kind.SEND_F: Kind.RECV_F, Kind.RECV_F: Kind.SEND_F}
_MATCH |= {Kind.SEND_B: Kind.RECV_B, Kind.RECV_B: Kind.SEND_B}


class ScheduleError(ValueError):
    """A plan that cannot run as written; the message marks where in a step x rank table."""


@dataclass(frozen=True)
class ScheduleReport:
    """What the unit-time dry run of a valid plan measured."""

    peak_in_flight: tuple[int, ...]
    """Per rank: most forwards whose BW, or W when split, had not yet run."""
    makespan: int
    """Time units from the first action to the last, over all ranks."""
    busy: tuple[int, ...]
    """Per rank: time units spent computing."""
    ideal: int
    """m * vpp * (F + B + W): one rank's work with no bubble."""
    span: tuple[int, ...] = ()
    """Per rank: time units from the start of its first compute action to the end of its last.
    A rank is idle for span - busy inside it; ZB-H2 makes that zero on every rank."""

    @property
    def bubble_fraction(self) -> float:
        """The paper's bubble time / ideal time, (makespan - ideal) / ideal.

        1F1B gives (pp - 1) / m here; idle time over total time would be (pp - 1) / (m + pp - 1).
        """
        return (self.makespan - self.ideal) / self.ideal


def verify(
    plan: Plan, stages: StageMap, m: int, *, max_in_flight: Sequence[int] | None = None
) -> ScheduleReport:
    """Check `plan` (with or without comms) against the rules above and dry-run it.

    Args:
        plan: rank -> actions, for ranks 0..pp-1.
        stages: which rank holds each of the pp * vpp stages.
        m: microbatches.
        max_in_flight: per-rank bound on stashed activations; None only reports the peaks.
    """
    pp = stages.pp
    if sorted(plan) != list(range(pp)):
        _fail(plan, f"plan has ranks {sorted(plan)}, but pp = {pp} needs ranks 0..{pp - 1}")
    where = _check_placement(plan, stages, m)
    _check_complete(plan, where, stages.stages, m)
    lowered = any(a.kind.is_comm for actions in plan.values() for a in actions)
    needs = {rank: [_needs(a, stages, lowered) for a in actions] for rank, actions in plan.items()}
    _check_order(plan, where, needs)
    _check_pairs(plan)
    if lowered:
        _check_channels(plan, stages)
    makespan, busy, span = _dry_run(plan, stages, where, needs)
    peaks = _check_in_flight(plan, max_in_flight)
    return ScheduleReport(peaks, makespan, busy, m * stages.vpp * CHUNK_COST, span)


def format_table(plan: Plan, marks: Collection[Cell] = (), context: int | None = None) -> str:
    """Render `plan` with one column per rank and one row per step, marking `marks` cells.

    With `context`, only rows within that many steps of a marked cell are kept.
    """
    ranks = sorted(plan)
    rows = max((len(plan[r]) for r in ranks), default=0)
    keep = range(rows)
    if context is not None and marks:
        near = {s for _, step in marks for s in range(step - context, step + context + 1)}
        keep = [s for s in range(rows) if s in near]

    def cell(rank: int, step: int) -> str:
        if step >= len(plan[rank]):
            return ""
        return f"{plan[rank][step]} {MARK}" if (rank, step) in marks else str(plan[rank][step])

    table = [["step", *(f"rank {r}" for r in ranks)]]
    previous = -1
    for step in keep:
        if step != previous + 1:
            table.append(["...", *("" for _ in ranks)])
        table.append([str(step), *(cell(r, step) for r in ranks)])
        previous = step
    if previous != rows - 1:
        table.append(["...", *("" for _ in ranks)])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join(
        " | ".join(text.ljust(w) for text, w in zip(row, widths)).rstrip() for row in table
    )


def _fail(plan: Plan, message: str, cells: Collection[Cell] = ()) -> NoReturn:
    """Raise ScheduleError: `message`, then the plan's table around the `cells` marked."""
    table = format_table(plan, cells, _CONTEXT)
    raise ScheduleError(f"{message}\n{table}")


def _at(cell: Cell) -> str:
    return f"rank {cell[0]} step {cell[1]}"


def _check_placement(plan: Plan, stages: StageMap, m: int) -> dict[Action, Cell]:
    """Index every action by its cell, rejecting misplaced and duplicated ones."""
    where: dict[Action, Cell] = {}
    for rank in sorted(plan):
        for step, a in enumerate(plan[rank]):
            here = (rank, step)
            if a.stage >= stages.stages or a.mb >= m:
                limits = f"stage must be < {stages.stages} and microbatch < {m}"
                _fail(plan, f"{a} at {_at(here)}: {limits}", [here])
            if stages.rank(a.stage) != rank:
                home = stages.rank(a.stage)
                _fail(
                    plan, f"{a} runs on rank {rank}, but stage {a.stage} is on rank {home}", [here]
                )
            if a.kind.is_comm:
                _check_peer(plan, a, here, stages)
            if a in where:
                _fail(plan, f"{a} runs twice: {_at(where[a])} and {_at(here)}", [where[a], here])
            where[a] = here
    return where


def _check_complete(plan: Plan, where: dict[Action, Cell], stages: int, m: int) -> None:
    """Every (stage, mb): one F and either one BW or one B and one W."""
    for stage in range(stages):
        for mb in range(m):
            f, b, w, bw = (
                where.get(Action(k, stage, mb)) for k in (Kind.F, Kind.B, Kind.W, Kind.BW)
            )
            present = [c for c in (f, b, w, bw) if c is not None]
            name = f"stage {stage} microbatch {mb}"
            if f is None:
                _fail(plan, f"{name} has no forward {Action(Kind.F, stage, mb)}", present)
            elif bw is not None and (b is not None or w is not None):
                _fail(plan, f"{name} runs BW and also B or W: use BW, or B and W", present)
            elif bw is None and b is None:
                missing = (
                    "input-gradient pass B" if w is not None else "backward: add BW, or B and W"
                )
                _fail(plan, f"{name} has no {missing}", present)
            elif bw is None and w is None:
                _fail(plan, f"{name} has B but no weight-gradient pass W", present)


def _check_peer(plan: Plan, a: Action, here: Cell, stages: StageMap) -> None:
    """A transfer must go to an existing stage on another rank."""
    peer = a.stage + _PEER_STEP[a.kind]
    if not 0 <= peer < stages.stages:
        _fail(plan, f"{a} at {_at(here)} has no peer: there is no stage {peer}", [here])
    if stages.rank(peer) == here[0]:
        _fail(plan, f"{a} at {_at(here)} transfers within rank {here[0]}: drop it", [here])


def _needs(a: Action, stages: StageMap, lowered: bool) -> _Needs:
    """What `a` waits for, each with the reason; a fused BW is found under its B name."""
    s, mb, last = a.stage, a.mb, stages.last

    def remote(peer: int) -> bool:
        return lowered and not stages.same_rank(peer, s)

    if a.kind is Kind.F:
        if s == 0:
            return []
        if remote(s - 1):
            return [(Action(Kind.RECV_F, s, mb), "the RECV_F of its input")]
        return [(Action(Kind.F, s - 1, mb), "the forward of the previous stage")]
    if a.kind in BACKWARD_KINDS:
        needs = [(Action(Kind.F, s, mb), "its forward")]
        if s < last and remote(s + 1):
            needs.append((Action(Kind.RECV_B, s, mb), "the RECV_B of its output gradient"))
        elif s < last:
            needs.append((Action(Kind.B, s + 1, mb), "the backward of the next stage"))
        return needs
    if a.kind is Kind.W:
        return [(Action(Kind.B, s, mb), "its B")]
    if a.kind is Kind.SEND_F:
        return [(Action(Kind.F, s, mb), "the forward whose output it sends")]
    if a.kind is Kind.SEND_B:
        return [(Action(Kind.B, s, mb), "the backward whose input gradient it sends")]
    sender = Kind.SEND_F if a.kind is Kind.RECV_F else Kind.SEND_B
    return [(Action(sender, s + _PEER_STEP[a.kind], mb), f"the matching {sender.value}")]


def _find(where: dict[Action, Cell], a: Action) -> tuple[Action, Cell] | None:
    """Locate `a`, reading a B as the fused BW where the plan has that instead."""
    if a.kind is Kind.B and a not in where:
        a = Action(Kind.BW, a.stage, a.mb)
    return (a, where[a]) if a in where else None


def _check_order(plan: Plan, where: dict[Action, Cell], needs: dict[int, list[_Needs]]) -> None:
    """Every action exists after what it needs where that runs on the same rank."""
    for rank in sorted(plan):
        for step, a in enumerate(plan[rank]):
            for need, why in needs[rank][step]:
                found = _find(where, need)
                if found is None:
                    text = f"{a} at {_at((rank, step))} needs {need} ({why}), which is missing"
                    _fail(plan, text, [(rank, step)])
                other, cell = found
                if cell[0] == rank and cell[1] > step:
                    text = (
                        f"{a} at {_at((rank, step))} runs before {other} (step {cell[1]}), "
                        f"which it needs first ({why})"
                    )
                    _fail(plan, text, [(rank, step), cell])


def _check_pairs(plan: Plan) -> None:
    """Each pair is one F and one B or BW, adjacent but for transfers."""
    for rank in sorted(plan):
        actions = plan[rank]
        for first, second in pairs(actions):
            a = actions[first]
            if second < 0:
                _fail(plan, f"{a} at {_at((rank, first))} is paired with nothing", [(rank, first)])
            b = actions[second]
            cells = [(rank, first), (rank, second)]
            if a.kind.is_comm or b.kind.is_comm:
                _fail(plan, f"{a} and {b} on rank {rank}: only compute actions pair", cells)
            if {a.kind is Kind.F, b.kind is Kind.F} != {True, False} or Kind.W in (a.kind, b.kind):
                text = f"{a} and {b} on rank {rank}: a pair is one F and one B or BW"
                _fail(plan, text, cells)
            between = [x for x in actions[first + 1 : second] if x.kind.is_compute]
            if between:
                text = f"{a} and {b} on rank {rank} are a pair but {between[0]} runs between them"
                _fail(plan, text, cells)


def _check_channels(plan: Plan, stages: StageMap) -> None:
    """Each SEND has its RECV, and each channel receives in the order it sends."""
    comm_cells = {a: (r, i) for r in plan for i, a in enumerate(plan[r]) if a.kind.is_comm}
    sent: dict[tuple[int, int, Kind], list[tuple[Action, Cell]]] = {}
    received: dict[tuple[int, int, Kind], list[tuple[Action, Cell]]] = {}
    for rank in sorted(plan):
        for step, a in enumerate(plan[rank]):
            if a.kind not in _PEER_STEP:
                continue
            peer = stages.rank(a.stage + _PEER_STEP[a.kind])
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                partner = Action(_MATCH[a.kind], a.stage + _PEER_STEP[a.kind], a.mb)
                if partner not in comm_cells:
                    text = f"{a} at {_at((rank, step))} has no matching {partner} on rank {peer}"
                    _fail(plan, text, [(rank, step)])
                sent.setdefault((rank, peer, _MATCH[a.kind]), []).append((partner, (rank, step)))
            else:
                received.setdefault((peer, rank, a.kind), []).append((a, (rank, step)))
    for channel, sends in sent.items():
        for i, ((expected, send_cell), (got, recv_cell)) in enumerate(
            zip(sends, received.get(channel, []))
        ):
            if expected != got:
                src, dst, kind = channel
                send = plan[send_cell[0]][send_cell[1]]
                text = (
                    f"rank {dst} receives from rank {src} out of send order: {kind.value[-1]} send "
                    f"#{i} is {send} but receive #{i} is {got}; receive in the order sent"
                )
                _fail(plan, text, [send_cell, recv_cell])


def _done_key(a: Action) -> Action:
    """Name a fused BW as B, which is how dependents ask for it."""
    return Action(Kind.B, a.stage, a.mb) if a.kind is Kind.BW else a


def _unit_cost(a: Action) -> int:
    return UNIT_COST[a.kind]


def _dry_run(
    plan: Plan, stages: StageMap, where: dict[Action, Cell], needs: dict[int, list[_Needs]]
) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Run every rank in unit time; return the makespan and each rank's busy time and span."""
    run = dry_run(plan, stages, _unit_cost, comms=CommModel.RECV_BLOCKS)
    if run.stuck:
        lines = ["deadlock: each unfinished rank waits for an action that cannot run first"]
        for wait in run.stuck:
            rank, i = wait.rank, wait.step
            key = _done_key(wait.waits_for)
            why = next((why for n, why in needs[rank][i] if _done_key(n) == key), "")
            cell = where.get(wait.waits_for)
            lines.append(
                f"  {_at((rank, i))}: {wait.action} waits for {wait.waits_for}"
                + (f" ({why})" if why else "")
                + (f" at {_at(cell)}" if cell is not None else ", which the plan lacks")
            )
        _fail(plan, "\n".join(lines), [(w.rank, w.step) for w in run.stuck])
    return int(run.makespan), tuple(map(int, run.busy)), tuple(map(int, run.span))


def peak_in_flight(plan: Plan) -> tuple[int, ...]:
    """Per rank, the most forwards whose BW (or W) has not run: what `verify` reports, read
    off each rank's list in order (no dry run; the count does not depend on timing)."""
    return _check_in_flight(plan, None)


def _check_in_flight(plan: Plan, bound: Sequence[int] | None) -> tuple[int, ...]:
    """Peak forwards per rank whose BW, or W when split, has not run, checked against `bound`."""
    if bound is not None and len(bound) != len(plan):
        raise ValueError(f"max_in_flight has {len(bound)} entries for {len(plan)} ranks")
    peaks = []
    for rank in sorted(plan):
        held = peak = 0
        for step, a in enumerate(plan[rank]):
            held += 1 if a.kind is Kind.F else -1 if a.kind in RELEASE_KINDS else 0
            peak = max(peak, held)
            if bound is not None and held > bound[rank]:
                text = (
                    f"rank {rank} holds {held} activations at step {step}, over its in-flight "
                    f"bound {bound[rank]}"
                )
                _fail(plan, text, [(rank, step)])
        peaks.append(peak)
    return tuple(peaks)
