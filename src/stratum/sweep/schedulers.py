"""Which job a freed slot takes: ``fifo`` (sweep order), ``lrtf`` (longest remaining time first) or ``planned``
(the makespan plan's queue for that slot).

A policy sees the pending jobs (in sweep order), what runs where with its predicted end, and the time; the real
runner and the simulator call the same policies, so a simulated makespan and a measured one share their choices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from stratum.sweep.makespan import MakespanPlan, plan_makespan


class Policy(Protocol):
    def pick(self, slot: int, pending: list[str], running: dict[int, tuple[str, float]], now: float) -> str | None:
        """The job slot ``slot`` starts now, or None to leave it idle."""


class Fifo:
    """One job per free slot, in sweep order: the baseline of running a list of configs."""

    def pick(self, slot: int, pending: list[str], running: dict[int, tuple[str, float]], now: float) -> str | None:
        return pending[0] if pending else None


class Lrtf:
    """The pending job with the longest remaining predicted time (ties: sweep order) — Hydra's rule, applied to
    time slices of whole jobs (segments of sweep.segment_steps steps) rather than to shards of layers."""

    def __init__(self, predict: Callable[[str], dict[str, float]]):
        self.predict = predict

    def pick(self, slot: int, pending: list[str], running: dict[int, tuple[str, float]], now: float) -> str | None:
        if not pending:
            return None
        remaining = {j: min(self.predict(j).values()) for j in pending}
        return max(pending, key=lambda j: (remaining[j], -pending.index(j)))


class Planned:
    """Follows a makespan plan (MILP, greedy fallback) over the pending jobs, re-planned whenever the set of
    pending or running jobs changes (a job ended — early, late or failed — or started), with the running jobs'
    slots busy until their predicted ends."""

    def __init__(self, predict: Callable[[str], dict[str, float]], slots: int, *, time_limit_s: float):
        self.predict = predict
        self.slots = slots
        self.time_limit_s = time_limit_s
        self.plans: list[MakespanPlan] = []
        self._key: tuple | None = None

    def pick(self, slot: int, pending: list[str], running: dict[int, tuple[str, float]], now: float) -> str | None:
        if not pending:
            return None
        key = (tuple(pending), tuple(sorted((s, j) for s, (j, _) in running.items())))
        if key != self._key:
            free_at = [max(0.0, running[s][1] - now) if s in running else 0.0 for s in range(self.slots)]
            self.plans.append(plan_makespan({j: self.predict(j) for j in pending}, free_at,
                                            time_limit_s=self.time_limit_s))
            self._key = key
        queue = self.plans[-1].queues[slot]
        return queue[0] if queue else None


def make_policy(name: str, *, predict: Callable[[str], dict[str, float]] | None, slots: int,
                time_limit_s: float) -> Policy:
    if name == "fifo":
        return Fifo()
    if name == "lrtf":
        assert predict is not None
        return Lrtf(predict)
    if name == "planned":
        assert predict is not None
        return Planned(predict, slots, time_limit_s=time_limit_s)
    raise ValueError(name)
