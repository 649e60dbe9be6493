"""SIMULATED sweeps: the schedulers' choices over predicted step times, as a discrete-event simulation.

Nothing runs: each step of a job takes exactly its predicted seconds. Jobs run in segments of ``segment_steps``
(0 = whole jobs), as the real runner gives them out; the real runner's makespan is checked against this
prediction (benchmarks/sweep_bench.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from stratum.atomic import atomic_write_bytes
from stratum.data.prepare import prepare_data
from stratum.errors import StratumError
from stratum.sweep.expand import check_jobs, distinct_data, expand
from stratum.sweep.plot import gantt_png
from stratum.sweep.predict import job_profiles, predicted_seconds
from stratum.sweep.schedulers import make_policy
from stratum.sweep.shard_lrtf import chain, makespan, sharded_lrtf, tasks_per_step
from stratum.sweep.spec import SCHEDULERS, job_threads, load_sweep


@dataclass(kw_only=True)
class SimResult:
    """A simulated sweep (SIMULATED: predicted times, not measurements)."""

    runs: list[tuple[float, int, str, float]]
    """Every segment as (start, slot, job, end) seconds, in start order."""
    makespan: float
    """End of the last segment."""
    utilisation: float
    """Busy slot-seconds over slots × makespan."""


def simulate(scheduler: str, steps: dict[str, int], step_s: dict[str, float], *, slots: int,
             segment_steps: int = 0, time_limit_s: float = 10.0) -> SimResult:
    """Run ``scheduler`` over jobs (in sweep order: ``steps``' order) on ``slots`` identical slots."""
    remaining = dict(steps)
    policy = make_policy(scheduler, predict=lambda j: {"plain": remaining[j] * step_s[j]}, slots=slots,
                         time_limit_s=time_limit_s)
    pending = [j for j in steps if remaining[j] > 0]
    running: dict[int, tuple[str, float]] = {}
    runs: list[tuple[float, int, str, float]] = []
    now = 0.0
    while pending or running:
        for s in range(slots):
            if s not in running and pending:
                job = policy.pick(s, pending, running, now)
                if job is not None:
                    n = min(segment_steps or remaining[job], remaining[job])
                    pending.remove(job)
                    running[s] = (job, now + n * step_s[job])
                    runs.append((now, s, job, now + n * step_s[job]))
                    remaining[job] -= n
        if not running:
            raise RuntimeError(f"the policy left {len(pending)} job(s) unscheduled with every slot free")
        now = min(end for _, end in running.values())
        for s in [s for s, (_, end) in running.items() if end == now]:  # every segment ending now, then picks
            job = running.pop(s)[0]
            if remaining[job] > 0:
                pending.append(job)
                pending.sort(key=list(steps).index)
    makespan = max((e for *_, e in runs), default=0.0)
    busy = sum(e - b for b, _, _, e in runs)
    return SimResult(runs=runs, makespan=makespan, utilisation=busy / (slots * makespan) if makespan else 0.0)


def simulate_sharded(steps: dict[str, int], step_s: dict[str, float], tasks: dict[str, int], *,
                     slots: int) -> SimResult:
    """sharded-lrtf over jobs of ``tasks[j]`` shard tasks per step, each ``step_s[j] / tasks[j]`` seconds
    (:func:`stratum.sweep.shard_lrtf.sharded_lrtf`); runs are the tasks."""
    chains = {j: chain(n, tasks[j], step_s[j] / tasks[j]) for j, n in steps.items()}
    placed = sharded_lrtf(chains, slots)
    runs = [(t.start, t.slot, t.job, t.end) for t in placed]
    span = makespan(placed)
    busy = sum(t.end - t.start for t in placed)
    return SimResult(runs=runs, makespan=span, utilisation=busy / (slots * span) if span else 0.0)


def simulate_sweep(path: str | os.PathLike, *, png: Path | None, say: Callable[[str], None] = print) -> dict:
    """SIMULATED: the sweep under every scheduler on its slots, each job taking its profiled step time × steps
    (a lower bound: no optimizer step, data or start-up), without running a job or writing to the sweep
    directory. Prints makespan and utilisation per scheduler; writes a Gantt PNG of the schedules if asked."""
    spec = load_sweep(path)
    s = spec.settings
    jobs = expand(spec)
    configs = {j.id: c for j, c in zip(jobs, check_jobs(spec, jobs, Path(s.out_dir).expanduser()))}
    for cfg in distinct_data(configs.values()):
        prepare_data(cfg)
    profiles = job_profiles(configs, threads=job_threads(s), cache_dir=None)
    steps = {j: c.train.steps for j, c in configs.items()}
    step_s = {j: predicted_seconds(profiles[j], c, 1) for j, c in configs.items()}
    seg = s.segment_steps or max(1, min(steps.values()) // 4)
    tasks = {j: tasks_per_step(len(profiles[j].blocks), s.shard_blocks, c.micro_batches_per_step)
             for j, c in configs.items()}
    results = {name: simulate_sharded(steps, step_s, tasks, slots=s.slots) if name == "sharded-lrtf" else
               simulate(name, steps, step_s, slots=s.slots, segment_steps=seg if name == "lrtf" else 0,
                        time_limit_s=s.plan_time_limit_s) for name in SCHEDULERS}
    say(f"SIMULATED: {len(steps)} jobs on {s.slots} slot(s), profiled forward+backward times (lrtf slices of "
        f"{seg} steps); nothing was run")
    fifo = results["fifo"].makespan
    for name, r in results.items():
        say(f"{name:12} makespan {r.makespan:9.2f} s  utilisation {r.utilisation:6.1%}  "
            f"{fifo / r.makespan if r.makespan else 0:.2f}x fifo's throughput")
    if png is not None:
        data = gantt_png({n: r.runs for n, r in results.items()}, s.slots)
        if data is None:
            raise StratumError("--png needs matplotlib: pip install 'stratum[plot]'")
        atomic_write_bytes(png, data)
        say(f"wrote {png}")
    return {n: {"makespan_s": r.makespan, "utilisation": r.utilisation} for n, r in results.items()}
