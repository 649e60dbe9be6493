"""Allocation policies: which job runs on which devices, decided again at every arrival and completion.

- ``static-dp``: each job gets exactly the devices it asks for, data parallel, strictly first come first served
  (the head of the queue waits for its devices and everyone behind it waits too); a job keeps its devices to the
  end.
- ``elastic`` (Saxena et al., "Effective Elastic Scaling of Deep Learning Workloads", MASCOTS 2020): at every
  arrival and completion every job's device count and global batch are chosen again by dynamic programming over
  the jobs' scaling curves, maximising the sum of the jobs' speed-ups over one device; a job's batch may grow from
  ``batch`` to ``max_batch`` (its work in sequences stays fixed). A job whose device count or batch stays keeps
  its devices; one that is resized, moved or resumed pays a checkpoint-restart (:meth:`Elastic.restart_s`):
  its training state saved to host memory and loaded back over the host link, and a process start-up.
- ``elastic-devices``: the same programme with every job's batch fixed at ``batch`` — Saxena et al.'s baseline,
  which scales the number of GPUs but not the batch, so that what batch scaling adds can be read apart from what
  re-allocating devices adds.

The burst policies (DeepPool) are in :mod:`stratum.cluster.burst`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from stratum.cluster.cluster import Cluster, Run
from stratum.cluster.trace import Job
from stratum.errors import StratumError
from stratum.ir.prices import transfer_s

AGE_BONUS = 1e-6
"""Value the elastic programme adds for running a job at all, more for older ones: among allocations of equal
speed-up it runs more jobs, oldest first."""


class Policy(Protocol):
    name: str

    def allocate(self, now: float, active: Sequence[Job], running: dict[str, Run]) -> dict[str, Run]:
        """The runs from ``now`` on, given the unfinished arrived jobs (arrival order) and the current runs."""


class StaticDP:
    """Requested devices, data parallel, first come first served, no preemption."""

    name = "static-dp"

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def allocate(self, now: float, active: Sequence[Job], running: dict[str, Run]) -> dict[str, Run]:
        runs = dict(running)
        free = self.cluster.free(runs.values())
        for job in active:
            if job.id in runs:
                continue
            mine = self.cluster.fitting(job, free)
            if job.devices > len(mine):
                break
            ranks = self.cluster.pick(mine, job.devices)
            free = [r for r in free if r not in ranks]
            runs[job.id] = self.start(job, ranks)
        return runs

    def start(self, job: Job, ranks: tuple[int, ...]) -> Run:
        """How ``job`` runs on the devices it asked for: data parallel."""
        return self.cluster.dp_run(job, job.batch, ranks)


class Elastic:
    """Saxena et al.'s re-allocation of devices and batch by dynamic programming over scaling curves."""

    name = "elastic"

    def __init__(self, cluster: Cluster, *, startup_s: float):
        if not 0 <= startup_s < float("inf"):
            raise StratumError(f"restart start-up must be a time >= 0 seconds, got {startup_s}")
        self.cluster = cluster
        self.startup_s = startup_s
        self._curves: dict[str, list[tuple[float, int]]] = {}
        self._started: set[str] = set()

    def restart_s(self, job: Job) -> float:
        """Seconds a resize costs ``job``: its training state over the host link twice (saved, then loaded by
        every device of the new group in parallel) and the start-up of the new processes."""
        state = self.cluster.models[job.id].state_bytes
        return 2 * transfer_s(state, self.cluster.hw.host_link) + self.startup_s

    def batches(self, job: Job) -> list[int]:
        """The global batches ``job`` may run at, smallest first: its own and its ``max_batch``."""
        return sorted({job.batch, job.batch_limit})

    def curve(self, job: Job) -> list[tuple[float, int]]:
        """(sequences/s, batch) on n = 0, 1, … devices (the first n of those that hold it; 0 for none): the best
        of :meth:`batches`, the smallest on a tie."""
        if job.id not in self._curves:
            out = [(0.0, job.batch)]
            held = self.cluster.holders[job.id]
            for n in range(1, min(len(held), max(self.batches(job))) + 1):
                best = (0.0, job.batch)
                for b in self.batches(job):
                    if b >= n:
                        rate = b / self.cluster.dp(job, b, sorted(held[:n])).step_s
                        if rate > best[0] * (1 + 1e-12):
                            best = (rate, b)
                out.append(best)
            self._curves[job.id] = out
        return self._curves[job.id]

    def counts(self, active: Sequence[Job]) -> list[int]:
        """Devices per job maximising the summed speed-up (the dynamic programme over jobs × devices)."""
        size = self.cluster.size
        best = np.full(size + 1, -np.inf)
        best[0] = 0.0
        choices = []
        for i, job in enumerate(active):
            curve = self.curve(job)
            new, arg = best.copy(), np.zeros(size + 1, dtype=int)
            for n in range(1, len(curve)):
                value = curve[n][0] / curve[1][0] + AGE_BONUS * (len(active) - i)
                cand = np.full(size + 1, -np.inf)
                cand[n:] = best[:size + 1 - n] + value
                better = cand > new + 1e-12
                new, arg = np.where(better, cand, new), np.where(better, n, arg)
            best = new
            choices.append(arg)
        g = int(np.argmax(best))
        counts = []
        for arg in reversed(choices):
            counts.append(int(arg[g]))
            g -= counts[-1]
        return counts[::-1]

    def allocate(self, now: float, active: Sequence[Job], running: dict[str, Run]) -> dict[str, Run]:
        want = {job.id: (n, self.curve(job)[n][1]) for job, n in zip(active, self.counts(active)) if n}
        runs = {k: r for k, r in running.items() if want.get(k) == (len(r.ranks), r.batch)}  # kept as they are
        free = self.cluster.free(runs.values())
        # the programme counts devices; those that hold the fewest jobs' models are placed first, and a job that
        # finds fewer devices that hold it than counted runs on those it finds
        placing = sorted((j for j in active if j.id in want and j.id not in runs),
                         key=lambda j: len(self.cluster.holders[j.id]))
        for job in placing:
            mine = self.cluster.fitting(job, free)
            n = min(want[job.id][0], len(mine))
            if not n:
                continue
            batch = self.curve(job)[n][1]
            old = running.get(job.id)
            if old is not None and (len(old.ranks), old.batch) == (n, batch) and set(old.ranks) <= set(mine):
                run = old  # where it was, as it was: no restart
            else:
                run = self.cluster.dp_run(job, batch, self.cluster.pick(mine, n))
                run = replace(run, restart_s=self.restart_s(job)) if job.id in self._started else run
            free = [r for r in free if r not in run.ranks]
            runs[job.id] = run
            self._started.add(job.id)
        return runs


class ElasticDevices(Elastic):
    """Saxena et al.'s baseline: devices re-allocated by the same programme, every job at its own batch."""

    name = "elastic-devices"

    def batches(self, job: Job) -> list[int]:
        return [job.batch]
