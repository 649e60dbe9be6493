"""Which jobs the free slots start: ``fifo`` (sweep order), ``lrtf`` (longest remaining time first) or ``planned``
(the makespan plan: each job's strategy, its slots — one, or k at once for replicate(k) / pipeline(k) — and its
turn).

A policy sees the free slots, the pending jobs (in sweep order), what runs where with its predicted end, and the
time; the real runner and the simulator call the same policies, so a simulated makespan and a measured one share
their choices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from stratum.sweep.gang import plan_jobs
from stratum.sweep.gang_plan import GangPlan, Option

Running = dict[int, tuple[str, float]]
"""Slot → (the job running there, its predicted end); a job over k slots appears on each of them."""


@dataclass(frozen=True, kw_only=True)
class Start:
    """A job to start now."""

    job: str
    """Its id."""
    slots: tuple[int, ...]
    """The free slots it holds until it ends (one, or k for a k-slot strategy)."""
    strategy: str = "local"
    """How it runs: local (its own config on one slot), or a Plan tree over its slots (replicate(k), …)."""


class Policy(Protocol):
    def starts(self, free: list[int], pending: list[str], running: Running, now: float) -> list[Start]:
        """The jobs the free slots ``free`` start now (none: leave them idle)."""


class Fifo:
    """One job per free slot, in sweep order: the baseline of running a list of configs."""

    def starts(self, free: list[int], pending: list[str], running: Running, now: float) -> list[Start]:
        return [Start(job=j, slots=(s,)) for s, j in zip(free, pending)]


class Lrtf:
    """The pending jobs with the longest remaining predicted time (ties: sweep order) — Hydra's rule, applied to
    time slices of whole jobs (segments of sweep.segment_steps steps) rather than to shards of layers."""

    def __init__(self, predict: Callable[[str], dict[str, float]]):
        self.predict = predict

    def starts(self, free: list[int], pending: list[str], running: Running, now: float) -> list[Start]:
        remaining = {j: min(self.predict(j).values()) for j in pending}
        order = sorted(pending, key=lambda j: (-remaining[j], pending.index(j)))
        return [Start(job=j, slots=(s,)) for s, j in zip(free, order)]


class Planned:
    """Follows a makespan plan (:func:`stratum.sweep.gang.plan_jobs`: MILP, greedy fallback) over the pending
    jobs' options, re-planned whenever the pending and running jobs are not what the plan expects (a job ended —
    early, late or failed — or started off the plan), with the running jobs' slots busy until their predicted
    ends. Starts the jobs whose planned start has come and whose slots are all free; a job whose slots are not
    yet all free waits for them."""

    def __init__(self, options: Callable[[str], dict[str, Option]], slots: int, *, time_limit_s: float,
                 gap: float = 0.0):
        self.options = options
        self.slots = slots
        self.time_limit_s = time_limit_s
        self.gap = gap
        self.plans: list[GangPlan] = []
        self._key: tuple | None = None
        self._planned_at = 0.0

    def adopt(self, plan: GangPlan, jobs: list[str]) -> None:
        """Start from ``plan``, made over ``jobs`` (in sweep order) with every slot free — the sweep's predicted
        makespan's — rather than solving the same MILP again at the first call; kept while the first call's
        pending jobs are those."""
        self.plans = [plan]
        self._key = _key(jobs, {})
        self._planned_at = 0.0

    def starts(self, free: list[int], pending: list[str], running: Running, now: float) -> list[Start]:
        if not pending:
            return []
        if _key(pending, running) != self._key:
            free_at = [max(0.0, running[s][1] - now) if s in running else 0.0 for s in range(self.slots)]
            self.plans.append(plan_jobs({j: self.options(j) for j in pending}, free_at,
                                        time_limit_s=self.time_limit_s, gap=self.gap))
            self._planned_at = now
        out: list[Start] = []
        taken: set[int] = set()
        for job, p in sorted(self.plans[-1].placed.items(), key=lambda kv: (kv[1].start, kv[0])):
            if job in pending and self._planned_at + p.start <= now + 1e-9 and set(p.slots) <= set(free) - taken:
                out.append(Start(job=job, slots=p.slots, strategy=p.strategy))
                taken.update(p.slots)
        # starting what the plan starts keeps it valid: the next call re-plans only if something else changed
        started = {st.job for st in out}
        self._key = _key([j for j in pending if j not in started],
                         {**running, **{s: (st.job, 0.0) for st in out for s in st.slots}})
        return out


def _key(pending: list[str], running: Running) -> tuple:
    return tuple(pending), tuple(sorted((s, j) for s, (j, _) in running.items()))


def make_policy(name: str, *, predict: Callable[[str], dict[str, float]] | None, slots: int,
                time_limit_s: float, gap: float = 0.0, options: Callable[[str], dict[str, Option]] | None = None,
                first_plan: tuple[GangPlan, list[str]] | None = None) -> Policy:
    """The policy ``name``; ``planned`` plans over ``options`` (each job's strategies), by default one slot per
    strategy of ``predict``, starting from ``first_plan`` (a plan and the jobs it was made over) if given."""
    if name == "fifo":
        return Fifo()
    if name == "lrtf":
        assert predict is not None
        return Lrtf(predict)
    if name == "planned":
        if options is None:
            assert predict is not None
            pred = predict
            options = lambda j: {n: Option(seconds=t) for n, t in pred(j).items()}  # noqa: E731
        policy = Planned(options, slots, time_limit_s=time_limit_s, gap=gap)
        if first_plan is not None:
            policy.adopt(*first_plan)
        return policy
    raise ValueError(name)
