"""Seeded synthetic job traces whose sizes and durations follow a published production trace's statistics.

The distributions are those Gavel (Narayanan et al., OSDI 2020, and its public simulator) derived from
Microsoft's Philly trace (Jeon et al., "Analysis of Large-Scale Multi-Tenant GPU Clusters for DNN Training
Workloads", ATC 2019):

- devices a job asks for: 1 with probability 0.70, 2 with 0.10, 4 with 0.15, 8 with 0.05 (capped at the devices
  that hold its model; the arrival rate counts the sizes capped at the cluster only);
- run time on those devices: 10^x minutes, x uniform on [1.5, 3] with probability 0.8 (about 32 minutes to 17
  hours) and on [3, 4] with probability 0.2 (17 hours to 7 days);
- arrivals: a Poisson process, its rate set so that the devices × run time asked for per hour is ``load`` times
  the cluster's device-hours per hour.

A job's model is drawn uniformly from ``models``, its global batch is ``per_device_batch`` sequences per device
asked for, its ``max_batch`` ``batch_growth`` times that (the range elastic scaling may use), and its steps are
its drawn run time over its step time on the devices it asks for (:func:`stratum.cluster.scaling.dp_step`).
docs/cluster.md states these choices.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from stratum.cluster.trace import DEFAULT_SEQ_LEN, Job
from stratum.errors import StratumError

DEVICE_COUNTS = ((1, 0.70), (2, 0.10), (4, 0.15), (8, 0.05))
"""(devices asked for, probability): Gavel's Philly-derived job sizes."""
DURATION_MODES = ((0.8, 1.5, 3.0), (0.2, 3.0, 4.0))
"""(probability, low, high): run time 10^x minutes with x uniform on [low, high]."""
MODELS = ("gpt2-124m", "gpt2-355m", "gpt2-774m", "gpt2-1.5b")


MAX_JOBS = 100_000
"""Most jobs a generated trace holds: generating and replaying it stays within minutes."""


@dataclass(frozen=True, kw_only=True)
class TraceSpec:
    """What to generate."""

    jobs: int
    """Number of jobs (>= 1)."""
    seed: int
    """Seed of the generator: the same spec gives the same trace."""
    devices: int
    """The cluster's devices: caps job sizes and sets the arrival rate (>= 1)."""
    load: float = 1.0
    """Device-hours asked for per hour over the cluster's device-hours per hour (> 0)."""
    models: tuple[str, ...] = MODELS
    """Presets drawn from, uniformly."""
    per_device_batch: int = 8
    """Global batch per device asked for, sequences (>= 1)."""
    batch_growth: int = 4
    """max_batch over batch (>= 1): how far elastic scaling may grow a job's batch."""
    seq_len: int = DEFAULT_SEQ_LEN
    """Tokens per sequence."""

    def __post_init__(self) -> None:
        for key in ("jobs", "devices", "per_device_batch", "batch_growth", "seq_len"):
            if getattr(self, key) < 1:
                raise StratumError(f"trace: {key} must be >= 1, got {getattr(self, key)}")
        if self.jobs > MAX_JOBS:
            raise StratumError(f"trace: {self.jobs:,} jobs is more than the {MAX_JOBS:,} a trace is generated and "
                               "replayed for in minutes; generate fewer")
        if not self.load > 0 or math.isinf(self.load):
            raise StratumError(f"trace: load must be a positive number, got {self.load}")
        if not self.models:
            raise StratumError("trace: give at least one model")


def _mean_minutes() -> float:
    """Mean run time in minutes: E[10^x] for x uniform on [a, b] is (10^b − 10^a) / ((b − a) ln 10)."""
    return sum(p * (10 ** b - 10 ** a) / ((b - a) * math.log(10)) for p, a, b in DURATION_MODES)


def arrival_rate(spec: TraceSpec) -> float:
    """Jobs per second that ask for ``load`` × the cluster's device-time."""
    mean_devices = sum(min(n, spec.devices) * p for n, p in DEVICE_COUNTS)
    return spec.load * spec.devices / (mean_devices * _mean_minutes() * 60)


def _pick(rng: random.Random, table) -> int:
    r, acc = rng.random(), 0.0
    for value, p in table:
        acc += p
        if r < acc:
            return value
    return table[-1][0]


def _minutes(rng: random.Random) -> float:
    r, acc = rng.random(), 0.0
    for p, a, b in DURATION_MODES:
        acc += p
        if r < acc:
            return 10 ** rng.uniform(a, b)
    return 10 ** rng.uniform(*DURATION_MODES[-1][1:])


def generate(spec: TraceSpec, step_s: Callable[[Job], float],
             holding: Callable[[str], int] | None = None) -> list[Job]:
    """The trace: ``step_s(job)`` gives a job's seconds per step on the devices it asks for (its ``steps`` are
    ignored), which turns its drawn run time into steps; ``holding(model)`` the devices whose memory holds the
    model (by default all), at most as many as its jobs ask for."""
    rng = random.Random(spec.seed)
    rate = arrival_rate(spec)
    width = len(str(spec.jobs - 1))
    now, jobs = 0.0, []
    for i in range(spec.jobs):
        devices = min(_pick(rng, DEVICE_COUNTS), spec.devices)
        seconds = _minutes(rng) * 60
        model = spec.models[rng.randrange(len(spec.models))]
        if holding is not None:
            devices = min(devices, holding(model))
        batch = devices * spec.per_device_batch
        job = Job(id=f"j{i:0{width}d}", arrival_s=round(now, 3), model=model, batch=batch, steps=1,
                  devices=devices, max_batch=batch * spec.batch_growth if spec.batch_growth > 1 else 0,
                  seq_len=spec.seq_len)
        jobs.append(replace(job, steps=max(1, round(seconds / step_s(job)))))
        now += rng.expovariate(rate)
    return jobs
