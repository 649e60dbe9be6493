"""Greedy list scheduling of a pipeline step: an event simulation with unit costs in which a rank that falls idle
picks among the actions whose inputs are ready. The order in which the actions ran is the schedule, so it is
deadlock-free by construction, whatever the real costs (zb-1f1b, and inside the generators' candidate searches).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence

from stratum.schedule.ir import Action, Schedule

UNIT_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
POLICIES = ("b-first", "f-first", "alternate")
"""Which ready action a free rank prefers: a backward, a forward, or the kind it did not run last."""


class _ListScheduler:
    """The simulation's state: what each rank may run next, what has run, and until when each rank is busy.

    An action's inputs are all issued before it can run, and an issued action's end time is known at once, so
    each candidate's ready time is fixed when its last input is issued. Candidates wait in a heap by ready time
    and move, once the clock reaches it, to a heap by preference: a free rank's pick is a heap pop, not a scan
    of every pending action (linear in the step's actions times log, where scanning is quadratic)."""

    def __init__(self, stage_to_rank: tuple[int, ...], m: int, *, split: bool, limits: Sequence[int],
                 f_key: Callable[[Action], tuple], cost: dict[str, float], policy: str):
        S, P = len(stage_to_rank), max(stage_to_rank) + 1
        self.S, self.P, self.limits, self.cost, self.policy = S, P, limits, cost, policy
        self.stage_to_rank = stage_to_rank
        self.bk = "I" if split else "B"
        self.first_stage = [min(s for s in range(S) if stage_to_rank[s] == r) for r in range(P)]
        # A forward's preference is its place in the rank's f_key order (ties keep the stage-major order).
        self.f_rank: dict[Action, int] = {}
        for r in range(P):
            fs = sorted((Action("F", s, k) for s in range(S) if stage_to_rank[s] == r for k in range(m)), key=f_key)
            self.f_rank.update((a, i) for i, a in enumerate(fs))
        self.waiting: list[list[tuple[float, int, Action]]] = [[] for _ in range(P)]  # (ready time, seq, action)
        self.ready_f_first: list[list[tuple[int, Action]]] = [[] for _ in range(P)]  # first-stage forwards
        self.ready_f_rest: list[list[tuple[int, Action]]] = [[] for _ in range(P)]
        self.ready_b: list[list[tuple[tuple[int, int], Action]]] = [[] for _ in range(P)]
        self.pending_w: list[deque[Action]] = [deque() for _ in range(P)]  # weight grads whose I has been issued
        self.done_at: dict[Action, float] = {}
        self.n_local = [sum(1 for s in range(S) if stage_to_rank[s] == r) for r in range(P)]
        self.live = [0] * P  # admitted micro-batches per rank
        self.released: dict[tuple[int, int], int] = {}  # (rank, mb) -> stages whose activation is freed
        self.busy_until = [0.0] * P
        self.order: list[list[Action]] = [[] for _ in range(P)]
        self.total = S * m * (3 if split else 2)
        self.n_issued, self.t, self.seq = 0, 0.0, 0
        for k in range(m):
            self.wait(Action("F", 0, k), 0.0)

    def wait(self, a: Action, ready_at: float) -> None:
        """``a`` has every input issued; it can run from ``ready_at`` on its stage's rank."""
        self.seq += 1
        heapq.heappush(self.waiting[self.stage_to_rank[a.stage]], (ready_at, self.seq, a))

    def backward_inputs_issued(self, s: int, k: int) -> None:
        """Queue the backward of (s, k) once both its forward and the next stage's backward are issued."""
        need = [Action("F", s, k)] + ([Action(self.bk, s + 1, k)] if s + 1 < self.S else [])
        if all(d in self.done_at for d in need):
            self.wait(Action(self.bk, s, k), max(self.done_at[d] for d in need))

    def admit(self, r: int) -> None:
        """Move rank r's candidates whose ready time has come into the preference heaps."""
        w = self.waiting[r]
        while w and w[0][0] <= self.t:
            a = heapq.heappop(w)[2]
            if a.kind == "F":
                heap = self.ready_f_first[r] if a.stage == self.first_stage[r] else self.ready_f_rest[r]
                heapq.heappush(heap, (self.f_rank[a], a))
            else:
                # Smallest micro-batch, then the later stage: the one the ranks upstream are waiting on.
                heapq.heappush(self.ready_b[r], ((a.mb, -a.stage), a))

    def issue(self, r: int, a: Action) -> None:
        self.order[r].append(a)
        self.done_at[a] = self.busy_until[r] = self.t + self.cost[a.kind]
        self.n_issued += 1
        if a.kind == "F":
            self.live[r] += a.stage == self.first_stage[r]
            if a.stage + 1 < self.S:
                self.wait(Action("F", a.stage + 1, a.mb), self.done_at[a])
            self.backward_inputs_issued(a.stage, a.mb)
        elif a.kind == "I":
            self.pending_w[r].append(Action("W", a.stage, a.mb))
        if a.kind in "BI" and a.stage > 0:
            self.backward_inputs_issued(a.stage - 1, a.mb)
        if a.kind in "BW":
            n = self.released[(r, a.mb)] = self.released.get((r, a.mb), 0) + 1
            self.live[r] -= n == self.n_local[r]

    def next_f(self, r: int, force: bool) -> Action | None:
        """The first ready forward of rank r that its activation limit admits (any ready one when forced)."""
        heaps = [self.ready_f_rest[r]]
        if self.live[r] < self.limits[r] or force:
            heaps.append(self.ready_f_first[r])
        best = min((h for h in heaps if h), key=lambda h: h[0][0], default=None)
        return heapq.heappop(best)[1] if best is not None else None

    def pick(self, r: int, force: bool) -> Action | None:
        self.admit(r)
        order, policy = self.order[r], self.policy
        if policy == "f-first" or (policy == "alternate" and order and order[-1].kind != "F"):
            f = self.next_f(r, force)
            if f is not None:
                return f
        if self.ready_b[r]:
            return heapq.heappop(self.ready_b[r])[1]
        f = self.next_f(r, force)
        if f is not None:
            return f
        if self.pending_w[r]:
            return self.pending_w[r].popleft()
        return None

    def force_one(self) -> None:
        """Every rank idle and blocked only by its activation limit: let the first rank with a ready forward
        exceed it, so the generator always terminates (the schedule just uses more memory)."""
        for r in range(self.P):
            a = self.pick(r, force=True)
            if a is not None:
                self.issue(r, a)
                return
        raise RuntimeError("list scheduler stuck")  # pragma: no cover - some F or some backward is always ready

    def run(self) -> list[list[Action]]:
        while self.n_issued < self.total:
            started = False
            for r in range(self.P):
                if self.busy_until[r] <= self.t:
                    a = self.pick(r, force=False)
                    if a is not None:
                        self.issue(r, a)
                        started = True
            future = [b for b in self.busy_until if b > self.t]
            if future:
                self.t = min(future)
            elif not started:
                self.force_one()
                self.t = min(b for b in self.busy_until if b > self.t)
        return self.order


def list_schedule(name: str, stage_to_rank: tuple[int, ...], m: int, *, split: bool, limits: Sequence[int],
                  f_key: Callable[[Action], tuple], cost: dict[str, float] | None = None,
                  policy: str = "b-first") -> Schedule:
    """Greedy list scheduling (see the module docstring).

    ``limits[r]`` bounds the micro-batches rank r holds activations for: a micro-batch is admitted by its F
    on the rank's first stage and released when its last B (or W) on the rank has been issued. Counting whole
    micro-batches rather than stage activations keeps a rank from spending its budget on first-stage
    forwards of new micro-batches while the later stages of admitted ones wait (which stalls the pipeline).
    """
    sim = _ListScheduler(stage_to_rank, m, split=split, limits=limits, f_key=f_key, cost=cost or UNIT_COST,
                         policy=policy)
    return Schedule(name=name, stage_to_rank=stage_to_rank, num_microbatches=m, actions=sim.run())
