"""Schedules whose steady state pairs a forward with a backward: DualPipeV and paired 1F1B.

A pair (`Action.paired`, see `ptdp.pipeline.actions`) is the forward of one microbatch and
the backward of another, adjacent on one rank, so that one's all-to-all (expert
parallelism's dispatch and combine) can run while the other computes, the idea of DualPipe
(DeepSeek-V3, arXiv 2412.19437, section 3.2.1). Which all-to-all actually overlaps with what
on ptdp's runtime is said in `ptdp.model.moe` and docs/parallelism/pipeline-parallelism.md.
Pure functions of ints, each returning a compute-only `Plan` (registered in
`ptdp.pipeline.schedules.SCHEDULES`).

Letters: pp = pipeline ranks, m = microbatches per pipeline per step, r = pipeline rank (0
first). DualPipeV holds two chunks per rank in ZB-V's V (stages r and 2 pp - 1 - r,
`ptdp.pipeline.placement`): chunk 0 on the way down, chunk 1 on the way back up.
"""

from __future__ import annotations

from collections import deque

from ptdp.pipeline.actions import Action, Kind, Plan


def dualpipev(pp: int, m: int) -> Plan:
    """DualPipeV ("cut-in-half" DualPipe, DeepSeek's DualPipe repository): m >= 2 pp.

    Rank r, chunk 0 = stage r and chunk 1 = stage 2 pp - 1 - r, runs eight phases (F0 is
    a forward of chunk 0, B1 a backward of chunk 1, (F B) a pair):

    1. 2 (pp - r - 1) x F0                      warm-up down the V
    2. r + 1 x F0 F1                            the first microbatches turn
    3. pp - r - 1 x B1 W F1                     zero bubble: B and W apart, W at once
    4. m - 2 pp + r + 1 x (F0 B1) (F1 B0)       the steady state, all pairs (on the last
                                                rank the very first F0 and B1 unpaired)
    5. pp - r - 1 x B1 (F1 B0)                  chunk 0's forwards are done
    6. r + 1 x B1 B0                            half of them split into B and W
    7. pp - r - 1 x W B0                        the deferred W's fill the drain
    8. r + 1 x W

    The paired backwards are fused (BW), as in DualPipe, where splitting them would leave
    nothing to overlap the forward's all-to-all with; B and W are split where a rank would
    otherwise wait (phases 3, 6, 7), W's run oldest first. At most 2 pp + 1 chunk
    activations (F run, BW or W not) are held on a rank, about pp + 1/2 whole stages,
    as in DualPipeV.
    """
    return {r: _dualpipev_rank(r, pp, m) for r in range(pp)}


def _dualpipev_rank(rank: int, pp: int, m: int) -> list[Action]:
    stage = (rank, 2 * pp - 1 - rank)  # chunk -> its global stage
    forwards, backwards = [0, 0], [0, 0]  # per chunk: passes run
    deferred: deque[Action] = deque()  # W's of the B's run so far, oldest first
    out: list[Action] = []

    def f(chunk: int, paired: bool = False) -> None:
        out.append(Action(Kind.F, stage[chunk], forwards[chunk], paired))
        forwards[chunk] += 1

    def b(chunk: int, split: bool = False, paired: bool = False) -> None:
        mb, s = backwards[chunk], stage[chunk]
        out.append(Action(Kind.B if split else Kind.BW, s, mb, paired))
        if split:
            deferred.append(Action(Kind.W, s, mb))
        backwards[chunk] += 1

    def w() -> None:
        out.append(deferred.popleft())

    def pair(forward: int, backward: int) -> None:
        f(forward, paired=True)
        b(backward, paired=True)

    down, turn = pp - rank - 1, rank + 1
    for _ in range(2 * down):  # 1
        f(0)
    for _ in range(turn):  # 2
        f(0)
        f(1)
    for _ in range(down):  # 3
        b(1, split=True)
        w()
        f(1)
    for i in range(m - 2 * pp + turn):  # 4
        if i == 0 and rank == pp - 1:  # its B1 waits on this F0 through F1: not overlapped
            f(0)
            b(1)
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(down):  # 5
        b(1)
        pair(1, 0)
    split = False
    for i in range(turn):  # 6: the second half of these backwards split
        if i == turn // 2 and rank % 2 == 1:
            split = True
        b(1, split)
        if i == turn // 2 and rank % 2 == 0:
            split = True
        b(0, split)
    for _ in range(down):  # 7
        w()
        b(0, split=True)
    while deferred:  # 8
        w()
    return out


def one_f_one_b_paired(pp: int, m: int) -> Plan:
    """1F1B with each steady-state forward paired with a backward (`parallel.moe_overlap`).

    Rank r runs min(2 (pp - r) - 1, m) warm-up forwards, then pairs the forward of
    microbatch i + 2 (pp - r) - 1 with the backward of microbatch i (with pp = 1, or on the
    last rank: the forward of i + 1 with the backward of i), then the remaining backwards.
    Why twice 1F1B's warm-up: a pair receives both inputs before it and sends both results
    after it (`add_comms`), so rank r's pair i needs rank r + 1's pair i (the gradient) and
    that one rank r's forward whose output it takes; with warm-ups one apart (1F1B's) that is
    rank r's pair i - 1, and the two ranks alternate, halving the throughput (the verifier's
    dry run: the bubble grows with m), two apart it is pair i - 2 and both keep busy. The
    unit-cost bubble is then 1F1B's, (pp - 1) / m (verifier's dry run, pp <= 8, m <= 8 pp),
    the order of the backwards (hence of the gradient sums) is 1F1B's, and the price is
    memory: 2 (pp - r) microbatches in flight on rank r where 1F1B holds pp - r (2 at
    pp = 1, against 1).
    """
    plan: Plan = {}
    for r in range(pp):
        warmup = min(2 * (pp - r) - 1, m)
        actions = [Action(Kind.F, r, mb) for mb in range(warmup)]
        for i in range(m - warmup):
            actions += [Action(Kind.F, r, warmup + i, True), Action(Kind.BW, r, i, True)]
        actions += [Action(Kind.BW, r, mb) for mb in range(m - warmup, m)]
        plan[r] = actions
    return plan


def pairs(actions: list[Action]) -> list[tuple[int, int]]:
    """Positions (first, second) of the paired actions in one rank's list, in order: each
    paired compute action with the next paired one (comms may sit between them in a lowered
    plan). An unmatched last one is returned as (i, -1) for `verify` to refuse."""
    found, open_at = [], -1
    for i, a in enumerate(actions):
        if not a.paired:
            continue
        if open_at < 0:
            open_at = i
        else:
            found.append((open_at, i))
            open_at = -1
    if open_at >= 0:
        found.append((open_at, -1))
    return found
