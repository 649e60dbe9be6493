"""Greedy list scheduling of a pipeline step: an event simulation with unit costs in which a rank that falls idle
picks among the actions whose inputs are ready. The order in which the actions ran is the schedule, so it is
deadlock-free by construction, whatever the real costs (zb-1f1b, and inside the generators' candidate searches).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from stratum.schedule.ir import Action, Schedule

UNIT_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
POLICIES = ("b-first", "f-first", "alternate")
"""Which ready action a free rank prefers: a backward, a forward, or the kind it did not run last."""


class _ListScheduler:
    """The simulation's state: what each rank may run next, what has run, and until when each rank is busy."""

    def __init__(self, stage_to_rank: tuple[int, ...], m: int, *, split: bool, limits: Sequence[int],
                 f_key: Callable[[Action], tuple], cost: dict[str, float], policy: str):
        S, P = len(stage_to_rank), max(stage_to_rank) + 1
        self.S, self.P, self.limits, self.cost, self.policy = S, P, limits, cost, policy
        self.bk = "I" if split else "B"
        self.pending_f = [sorted((Action("F", s, k) for s in range(S) if stage_to_rank[s] == r for k in range(m)),
                                 key=f_key) for r in range(P)]
        self.pending_b: list[list[Action]] = [[] for _ in range(P)]  # backwards whose stage forward was issued
        self.pending_w: list[list[Action]] = [[] for _ in range(P)]  # weight grads whose I has been issued
        self.done_at: dict[Action, float] = {}
        self.first_stage = [min(s for s in range(S) if stage_to_rank[s] == r) for r in range(P)]
        self.n_local = [sum(1 for s in range(S) if stage_to_rank[s] == r) for r in range(P)]
        self.live = [0] * P  # admitted micro-batches per rank
        self.released: dict[tuple[int, int], int] = {}  # (rank, mb) -> stages whose activation is freed
        self.busy_until = [0.0] * P
        self.order: list[list[Action]] = [[] for _ in range(P)]
        self.total = S * m * (3 if split else 2)
        self.n_issued, self.t = 0, 0.0

    def ready(self, a: Action) -> bool:
        s, k, t = a.stage, a.mb, self.t
        if a.kind == "F":
            return s == 0 or self.done_at.get(Action("F", s - 1, k), float("inf")) <= t
        need = [Action("F", s, k)] + ([Action(self.bk, s + 1, k)] if s + 1 < self.S else [])
        return all(self.done_at.get(d, float("inf")) <= t for d in need)

    def issue(self, r: int, a: Action) -> None:
        self.order[r].append(a)
        self.done_at[a] = self.busy_until[r] = self.t + self.cost[a.kind]
        self.n_issued += 1
        if a.kind == "F":
            self.live[r] += a.stage == self.first_stage[r]
            self.pending_b[r].append(Action(self.bk, a.stage, a.mb))
        elif a.kind == "I":
            self.pending_w[r].append(Action("W", a.stage, a.mb))
        if a.kind in "BW":
            n = self.released[(r, a.mb)] = self.released.get((r, a.mb), 0) + 1
            self.live[r] -= n == self.n_local[r]

    def next_f(self, r: int, force: bool) -> Action | None:
        """The first ready forward of rank r that its activation limit admits (any ready one when forced)."""
        for i, a in enumerate(self.pending_f[r]):
            if self.ready(a) and (a.stage != self.first_stage[r] or self.live[r] < self.limits[r] or force):
                return self.pending_f[r].pop(i)
        return None

    def pick(self, r: int, force: bool) -> Action | None:
        order, policy = self.order[r], self.policy
        bs = [a for a in self.pending_b[r] if self.ready(a)]
        if policy == "f-first" or (policy == "alternate" and order and order[-1].kind != "F"):
            f = self.next_f(r, force)
            if f is not None:
                return f
        if bs:
            # Smallest micro-batch, then the later stage: the one the ranks upstream are waiting on.
            a = min(bs, key=lambda a: (a.mb, -a.stage))
            self.pending_b[r].remove(a)
            return a
        f = self.next_f(r, force)
        if f is not None:
            return f
        if self.pending_w[r]:
            return self.pending_w[r].pop(0)
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
