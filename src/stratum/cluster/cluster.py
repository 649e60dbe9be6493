"""What a policy allocates: a job's run on some devices, and the cluster (hardware + the jobs' model costs)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from stratum.cluster.models import ModelCosts
from stratum.cluster.scaling import StepCost, check_fits, dp_step, holders
from stratum.cluster.trace import Job
from stratum.ir.hardware import Hardware


@dataclass(frozen=True, kw_only=True)
class Run:
    """A job running on devices, as a policy placed it (until the policy changes it)."""

    job: str
    """The job's id."""
    ranks: tuple[int, ...]
    """The devices it runs on."""
    batch: int
    """Sequences per step."""
    step_s: float
    """Seconds per step as it runs now (slow-downs and shared devices included)."""
    rank_busy_s: tuple[float, ...]
    """Per device of ``ranks``: seconds it is busy per step (computing or communicating)."""
    host: str = ""
    """The foreground job whose idle device time it runs in; empty when the devices are its own."""
    restart_s: float = 0.0
    """Seconds from the run's start before it trains: a checkpoint-restart onto new devices or a new batch."""

    @property
    def busy_s(self) -> float:
        """Device-seconds busy per step, summed over its devices."""
        return sum(self.rank_busy_s)

    def idle_share(self, rank: int) -> float:
        """The share of each step device ``rank`` (one of ``ranks``) is idle."""
        return 1 - self.rank_busy_s[self.ranks.index(rank)] / self.step_s

    @property
    def rate(self) -> float:
        """Sequences per second."""
        return self.batch / self.step_s


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The hardware, every job's model costs and the devices that hold each job (by job id)."""

    hw: Hardware
    models: Mapping[str, ModelCosts]
    holders: Mapping[str, tuple[int, ...]]
    """The ranks whose memory holds the job's training state and one sequence's activations, in the order it
    takes them (:func:`stratum.cluster.scaling.holders`)."""

    @classmethod
    def of(cls, hw: Hardware, jobs: Sequence[Job], costs: Mapping[tuple[str, int], ModelCosts]) -> Cluster:
        """The cluster for ``jobs``, whose model costs ``costs`` gives by (model, seq_len); as many devices as a
        job asks for must hold it (one-line error otherwise)."""
        models = {j.id: costs[(j.model, j.seq_len)] for j in jobs}
        for j in jobs:
            check_fits(models[j.id], hw.devices, f"job {j.id!r} ({j.model}, seq_len {j.seq_len})", count=j.devices)
        return cls(hw=hw, models=models, holders={j.id: holders(models[j.id], hw.devices) for j in jobs})

    @property
    def size(self) -> int:
        return self.hw.num_devices

    def dp(self, job: Job, batch: int, ranks: Sequence[int]) -> StepCost:
        return dp_step(self.models[job.id], batch=batch, ranks=ranks, hw=self.hw)

    def dp_run(self, job: Job, batch: int, ranks: Sequence[int]) -> Run:
        """``job`` data-parallel over ``ranks`` at ``batch`` sequences per step, the devices its own."""
        c = self.dp(job, batch, ranks)
        return Run(job=job.id, ranks=tuple(ranks), batch=batch, step_s=c.step_s, rank_busy_s=c.rank_busy_s)

    def free(self, runs: Iterable[Run]) -> list[int]:
        """Devices no run holds as its own (in rank order)."""
        used = {r for run in runs if not run.host for r in run.ranks}
        return [r for r in range(self.size) if r not in used]

    def fitting(self, job: Job, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` whose memory holds ``job``, in the order it takes them (:func:`holders`)."""
        given = set(ranks)
        return [r for r in self.holders[job.id] if r in given]

    def pick(self, free: Sequence[int], n: int) -> tuple[int, ...]:
        return pick(self.hw, free, n)


def pick(hw: Hardware, free: Sequence[int], n: int) -> tuple[int, ...]:
    """``n`` of the ``free`` devices, in rank order: on one node where a node has enough (the fullest such node,
    so large holes stay whole), else the first of ``free``; within a node, the first of ``free`` too."""
    by_node: dict[int, list[int]] = {}
    for r in free:
        by_node.setdefault(hw.devices[r].node, []).append(r)
    fits = [rs for rs in by_node.values() if len(rs) >= n]
    if fits:
        return tuple(sorted(min(fits, key=len)[:n]))
    return tuple(sorted(free[:n]))
