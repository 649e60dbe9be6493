"""A fill-first zero-bubble order for V / zig-zag placements: zb-wave's floor against torch's ZBV.

ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", section 6) places stages r and 2P-1-r on rank r, splits
every backward into I and W and holds at most 2P stage activations per rank (P micro-batches, 1F1B's memory).
This module builds an order for that placement (any stage -> rank map works) by an event simulation in unit
slots, every action (F, I, W of one stage) one slot, messages free. In every slot each rank runs the first of:

1. a deferred W, when the rank holds ``cap`` stage activations (a forward could not run; W frees one);
2. the next forward of its deepest stage whose input is there, while it holds fewer than ``cap`` activations:
   filling the memory first keeps every rank busy through the warm-up, and the deepest stage first moves the
   micro-batches already inside towards the loss, whose backward frees them;
3. a ready I, oldest micro-batch first (the deeper stage on a tie): it feeds the rank upstream;
4. a deferred W, oldest first.

Each stage runs its forwards and its I in micro-batch order. The order in which actions ran is the schedule
(deadlock-free whatever the real costs). Once m >= 2P the rule needs ``cap`` >= 2P: with less, the rank at the
turn of the V fills up with forwards of its first stage and no backward ever reaches it (the result is None).
With ``cap`` = 2P on the V placement it meets the V's lower bound 3m + (P-1)/2 (unit costs per rank and
micro-batch) at every P in 2..8 and m from P to 8P, so nothing with that placement, torch's ZBVZeroBubble
included, is shorter there (docs/schedules.md; tests/test_schedule_torch.py checks P in {2, 4, 8}): zb-wave
W = 1 keeps it as its floor.
"""

from __future__ import annotations

import math
from collections import deque

from stratum.schedule.ir import Action

_NEVER = math.inf


class _State:
    """Per-stage progress and per-rank memory of the simulation."""

    def __init__(self, stage_to_rank: tuple[int, ...], m: int) -> None:
        S = len(stage_to_rank)
        self.S, self.m = S, m
        self.P = max(stage_to_rank) + 1
        self.stages = [sorted((s for s in range(S) if stage_to_rank[s] == r), reverse=True) for r in range(self.P)]
        self.f_end = [[_NEVER] * m for _ in range(S)]
        self.i_end = [[_NEVER] * m for _ in range(S)]
        self.next_f = [0] * S
        self.next_i = [0] * S
        self.live = [0] * self.P
        self.waiting_w: list[deque[tuple[int, int]]] = [deque() for _ in range(self.P)]

    def f_ready(self, s: int, t: int) -> bool:
        k = self.next_f[s]
        return k < self.m and (s == 0 or self.f_end[s - 1][k] <= t)

    def i_ready(self, s: int, t: int) -> bool:
        k = self.next_i[s]
        return k < self.m and self.f_end[s][k] <= t and (s == self.S - 1 or self.i_end[s + 1][k] <= t)


def _pick(st: _State, r: int, t: int, cap: int) -> Action | None:
    """The action rank ``r`` starts in slot ``t`` (the rule of the module docstring), or None."""
    if st.live[r] >= cap and st.waiting_w[r]:
        return Action("W", *st.waiting_w[r][0])
    if st.live[r] < cap:
        for s in st.stages[r]:
            if st.f_ready(s, t):
                return Action("F", s, st.next_f[s])
    ready_i = [s for s in st.stages[r] if st.i_ready(s, t)]
    if ready_i:
        s = min(ready_i, key=lambda x: (st.next_i[x], -x))
        return Action("I", s, st.next_i[s])
    if st.waiting_w[r]:
        return Action("W", *st.waiting_w[r][0])
    return None


def _run(st: _State, r: int, a: Action, t: int) -> None:
    """Record that rank ``r`` runs ``a`` in slot ``t`` (it ends at t + 1)."""
    if a.kind == "F":
        st.f_end[a.stage][a.mb] = t + 1
        st.next_f[a.stage] += 1
        st.live[r] += 1
    elif a.kind == "I":
        st.i_end[a.stage][a.mb] = t + 1
        st.next_i[a.stage] += 1
        st.waiting_w[r].append((a.stage, a.mb))
    else:
        st.waiting_w[r].popleft()
        st.live[r] -= 1


def fill_first_order(stage_to_rank: tuple[int, ...], m: int, cap: int) -> list[list[Action]] | None:
    """Per-rank split-backward orders by the fill-first rule (module docstring) with at most ``cap`` stage
    activations per rank; None when the cap starves the pipeline (no rank can run anything)."""
    st = _State(stage_to_rank, m)
    order: list[list[Action]] = [[] for _ in range(st.P)]
    remaining, t = 3 * st.S * m, 0
    while remaining:
        picks = [(r, _pick(st, r, t, cap)) for r in range(st.P)]
        ran = [(r, a) for r, a in picks if a is not None]
        if not ran:
            return None
        for r, a in ran:
            _run(st, r, a, t)
            order[r].append(a)
        remaining -= len(ran)
        t += 1
    return order
