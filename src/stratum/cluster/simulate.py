"""SIMULATED cluster: a job trace replayed under an allocation policy, as a discrete-event simulation.

Nothing runs. Events are arrivals and completions; at each the policy allocates again and every running job
then trains at its run's rate (sequences per second) until the next event — progress is continuous (a job may
end mid-step), a job is done when it has trained on batch × steps sequences. A run the policy changed that
carries a ``restart_s`` (a checkpoint-restart) holds its devices without training for that long first. Every figure
is a prediction of
the one cost model (:mod:`stratum.cluster.scaling`), never a measurement.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from stratum.cluster.cluster import Cluster, Run
from stratum.cluster.policies import Policy
from stratum.cluster.trace import Job


@dataclass(kw_only=True)
class JobResult:
    """One job's fate."""

    id: str
    arrival_s: float
    start_s: float | None = None
    """When it first ran (None: never)."""
    end_s: float | None = None
    """When it finished (None: not by the end of the simulation)."""
    done: float = 0.0
    """Fraction of its work done."""

    @property
    def jct_s(self) -> float | None:
        """Job completion time: end − arrival."""
        return None if self.end_s is None else self.end_s - self.arrival_s


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A stretch of time between two events, with what the devices did in it."""

    start_s: float
    end_s: float
    busy: float
    """Devices' worth of computing (sum over runs of busy device-seconds per second)."""
    held: int
    """Devices held by a run (their own or hosting background work)."""
    runs: int
    """Jobs running."""


@dataclass(kw_only=True)
class SimResult:
    """A simulated replay (SIMULATED: predictions of the cost model, not measurements)."""

    policy: str
    devices: int
    jobs: list[JobResult]
    segments: list[Segment] = field(default_factory=list)
    end_s: float = 0.0
    """Where the simulation stopped: the last completion, or the horizon."""
    work_s: float = 0.0
    """Training done, in seconds of one profiled (speed 1) device: sequences trained × the model's seconds per
    sequence there, summed over jobs."""

    @property
    def completed(self) -> list[JobResult]:
        return [j for j in self.jobs if j.end_s is not None]

    @property
    def makespan_s(self) -> float:
        return max((j.end_s for j in self.completed if j.end_s is not None), default=0.0)

    @property
    def utilisation(self) -> float:
        """Busy device-time over devices × the simulated time."""
        busy = sum(s.busy * (s.end_s - s.start_s) for s in self.segments)
        return busy / (self.devices * self.end_s) if self.end_s else 0.0


def simulate(jobs: Sequence[Job], cluster: Cluster, policy: Policy, *, until_s: float = math.inf) -> SimResult:
    """Replay ``jobs`` (arrival order) on ``cluster`` under ``policy`` until every job is done or ``until_s``."""
    pending = deque(sorted(jobs, key=lambda j: j.arrival_s))
    results = {j.id: JobResult(id=j.id, arrival_s=j.arrival_s) for j in jobs}
    left = {j.id: float(j.work) for j in jobs}
    work = {j.id: j.work for j in jobs}
    res = SimResult(policy=policy.name, devices=cluster.size, jobs=list(results.values()))
    active: list[Job] = []
    runs: dict[str, Run] = {}
    ready: dict[str, float] = {}  # when a restarting run starts to train
    now = 0.0
    while (pending or active) and now < until_s:
        while pending and pending[0].arrival_s <= now:
            active.append(pending.popleft())
        before, runs = runs, policy.allocate(now, active, runs) if active else {}
        _check(runs, active, cluster)
        for job_id, run in runs.items():
            if results[job_id].start_s is None:
                results[job_id].start_s = now
            if run.restart_s > 0 and before.get(job_id) != run:
                ready[job_id] = now + run.restart_s
        go = {job_id: max(now, ready.get(job_id, now)) for job_id in runs}
        ends = {job_id: go[job_id] + left[job_id] / run.rate for job_id, run in runs.items()}
        nxt = min([*ends.values(), pending[0].arrival_s if pending else math.inf, until_s])
        if math.isinf(nxt):
            raise RuntimeError(f"policy {policy.name} left {len(active)} job(s) waiting with nothing to come")
        res.segments.append(Segment(start_s=now, end_s=nxt, busy=_busy(runs, go, now, nxt),
                                    held=len({d for r in runs.values() for d in r.ranks}), runs=len(runs)))
        for job_id, run in runs.items():
            trained = min(run.rate * max(0.0, nxt - go[job_id]), left[job_id])
            left[job_id] -= trained
            res.work_s += trained * cluster.models[job_id].seq_s
            if ends[job_id] <= nxt:
                left[job_id] = 0.0
                results[job_id].end_s = ends[job_id]
        now = nxt
        active = [j for j in active if left[j.id] > 0]
        runs = {k: v for k, v in runs.items() if left[k] > 0}
    for j in jobs:
        results[j.id].done = 1.0 - left[j.id] / work[j.id]
    res.end_s = now
    return res


def _busy(runs: dict[str, Run], go: dict[str, float], start: float, end: float) -> float:
    """Devices' worth of computing over [start, end]: each run's busy share, while it trains (not restarting)."""
    if end <= start:
        return sum(r.busy_s / r.step_s for k, r in runs.items() if go[k] <= start)
    return sum(r.busy_s / r.step_s * max(0.0, end - go[k]) / (end - start) for k, r in runs.items())


def _check(runs: dict[str, Run], active: Sequence[Job], cluster: Cluster) -> None:
    """A policy's runs hold only active jobs and no device twice as its own (a policy bug otherwise)."""
    ids = {j.id for j in active}
    own: list[int] = []
    for run in runs.values():
        if run.job not in ids or run.step_s <= 0 or not run.ranks:
            raise RuntimeError(f"policy produced an invalid run {run}")
        if not run.host:
            own += run.ranks
    if len(own) != len(set(own)) or any(not 0 <= r < cluster.size for r in own):
        raise RuntimeError(f"policy gave a device to two jobs: {sorted(runs.values(), key=lambda r: r.job)}")
