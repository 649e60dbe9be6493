"""DeepPool's policies: foreground jobs run burst plans; with multiplexing, background jobs fill what they leave.

- ``burst``: as ``static-dp`` (first come first served, the devices a job asks for, no preemption), but a
  foreground job runs the burst plan of its step over its devices
  (:func:`stratum.plan.burst_overlap.plan_burst_overlapped`, under the amplification limit) instead of plain
  data parallelism; background jobs run data parallel.
- ``burst+multiplex``: as ``burst``, and a background job that finds no free devices runs on as many devices of a
  running foreground job, in the time that job's plan leaves them idle (DeepPool's low-priority streams), the
  most idle devices first. On devices the host's plan never uses it runs at its own speed and costs the host
  nothing; on devices the host uses part of each step it gets the least idle share among them
  (``1 − busy / step`` of that device), less the ``interference`` fraction, and the host's steps take
  ``1 + interference`` times as long while such a guest shares its devices. Each of a host's devices carries at
  most one background job, and only where its memory holds both jobs; when the host ends, its guests keep the
  devices as their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from stratum.cluster.cluster import Cluster, Run
from stratum.cluster.policies import StaticDP
from stratum.cluster.scaling import burst_step, device_need
from stratum.cluster.trace import Job
from stratum.errors import StratumError


class Burst(StaticDP):
    """Static allocation; foreground jobs run burst plans."""

    name = "burst"

    def __init__(self, cluster: Cluster, *, amplification: float):
        super().__init__(cluster)
        if not amplification >= 1:
            raise StratumError(f"amplification must be >= 1, got {amplification}")
        self.amplification = amplification

    def start(self, job: Job, ranks: tuple[int, ...]) -> Run:
        if not job.foreground:
            return super().start(job, ranks)
        step = burst_step(self.cluster.models[job.id], batch=job.batch, ranks=ranks, hw=self.cluster.hw,
                          amplification=self.amplification)
        return Run(job=job.id, ranks=ranks, batch=job.batch, step_s=step.step_s, rank_busy_s=step.rank_busy_s)


class BurstMultiplex(Burst):
    """Burst plans for foreground jobs, background jobs in their idle device time."""

    name = "burst+multiplex"

    def __init__(self, cluster: Cluster, *, amplification: float, interference: float):
        super().__init__(cluster, amplification=amplification)
        if not 0 <= interference < 1:
            raise StratumError(f"interference must be in [0, 1), got {interference}")
        self.interference = interference
        self._alone: dict[str, Run] = {}
        self._foreground: set[str] = set()

    def start(self, job: Job, ranks: tuple[int, ...]) -> Run:
        run = super().start(job, ranks)
        self._alone[job.id] = run
        if job.foreground:
            self._foreground.add(job.id)
        return run

    def allocate(self, now: float, active: Sequence[Job], running: dict[str, Run]) -> dict[str, Run]:
        runs = {k: self._alone[k] if not r.host else r for k, r in running.items()}
        by_id = {j.id: j for j in active}
        for k, r in list(runs.items()):
            if r.host and r.host not in runs:  # its host ended: the devices are the guest's own now
                runs[k] = self.start(by_id[k], r.ranks)
        runs = super().allocate(now, active, runs)
        waiting = sum(1 for job in active if job.id not in runs and not job.foreground)
        for job in active:
            if job.id not in runs and not job.foreground:
                guest = self._guest(job, runs, waiting)
                waiting -= 1
                if guest is not None:
                    runs[job.id] = guest
        slowed = {r.host for r in runs.values() if r.host and _shares_used(r, runs[r.host])}
        return {k: replace(r, step_s=r.step_s * (1 + self.interference)) if k in slowed else r
                for k, r in runs.items()}

    def _guest(self, job: Job, runs: dict[str, Run], waiting: int) -> Run | None:
        """``job`` on the idle time of the first foreground run with enough idle devices not yet carrying a guest
        (``waiting``: the background jobs still without devices, this one included)."""
        for host in runs.values():
            if host.host or host.job not in self._foreground:
                continue  # a guest itself, or a background job
            guests = [r for r in runs.values() if r.host == host.job]
            taken = {d for r in guests for d in r.ranks}
            spare = sorted((d for d in host.ranks if d not in taken and host.idle_share(d) > 1e-9
                            and self._room(job, host, d)),
                           key=lambda d: (-host.idle_share(d), -d))  # most idle first, then the last ranks
            if len(spare) < job.devices:
                continue
            ranks = tuple(sorted(spare[:job.devices]))
            alone = self.cluster.dp_run(job, job.batch, ranks)
            guest = Run(job=job.id, ranks=ranks, batch=job.batch, step_s=alone.step_s,
                        rank_busy_s=alone.rank_busy_s, host=host.job)
            if not _shares_used(guest, host):
                return guest
            share = min(host.idle_share(d) for d in ranks) * (1 - self.interference)
            used = [d for d in spare if _uses(host, d)]
            carried = min(waiting, len(used) // job.devices)  # sharing guests it could take now, this one first
            slowed = any(_shares_used(r, host) for r in guests)
            if self._worth(job, alone, share, host, carried=0 if slowed else carried):
                return replace(guest, step_s=alone.step_s / share)
        return None

    def _room(self, job: Job, host: Run, device: int) -> bool:
        """Whether ``device`` holds ``job`` beside ``host``'s job: a guest shares its host's device memory."""
        models = self.cluster.models
        need = device_need(models[job.id]) + device_need(models[host.job])
        return need <= self.cluster.hw.devices[device].memory_bytes

    def _worth(self, job: Job, alone: Run, share: float, host: Run, *, carried: int) -> bool:
        """Whether the work the guests gain exceeds the host's work lost, both in profiled-device seconds of
        training per second. A host pays its slow-down once, for all the guests sharing its devices: the first is
        placed when the ``carried`` guests it could take from the queue, each gaining as much as this one, make
        up for it; later ones (``carried`` 0) cost it nothing more."""
        models = self.cluster.models
        gain = alone.rate * share * models[job.id].seq_s
        if not carried:
            return gain > 0
        loss = host.rate * models[host.job].seq_s * self.interference / (1 + self.interference)
        return carried * gain > loss


def _uses(host: Run, device: int) -> bool:
    """Whether ``host``'s plan keeps ``device`` busy for some of each step."""
    return host.idle_share(device) < 1 - 1e-12


def _shares_used(guest: Run, host: Run) -> bool:
    """Whether ``guest`` runs on a device ``host``'s plan uses during its steps."""
    return any(_uses(host, d) for d in guest.ranks)
