"""``stratum sweep simulate``: the sweep file's jobs, profiled here, under every scheduler — on the file's slots,
or on a described cluster (``--hardware FILE``, a ``[hardware]`` table) — SIMULATED: nothing runs, nothing is
written to the sweep directory."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from stratum.atomic import atomic_write_bytes, check_writable
from stratum.data.prepare import prepare_data
from stratum.errors import StratumError
from stratum.ir.hardware import Hardware
from stratum.sweep.cluster_sim import ClusterJob, simulate_cluster
from stratum.sweep.expand import check_jobs, distinct_data, expand
from stratum.sweep.plot import gantt_png
from stratum.sweep.predict import job_profiles, predicted_seconds
from stratum.sweep.shard_lrtf import tasks_per_step
from stratum.sweep.shard_size import job_shard_blocks
from stratum.sweep.simulate import simulate, simulate_sharded
from stratum.sweep.spec import SCHEDULERS, job_threads, load_sweep


def simulate_sweep(path: str | os.PathLike, *, png: Path | None, say: Callable[[str], None] = print,
                   hardware: Hardware | None = None) -> dict:
    """SIMULATED: the sweep under every scheduler on its slots, each job taking its profiled step time × steps
    (a lower bound: no optimizer step, data or start-up), without running a job or writing to the sweep
    directory. Prints makespan and utilisation per scheduler; writes a Gantt PNG of the schedules if asked.
    With ``hardware``, on that cluster's devices instead, with memory and several-device strategies
    (:mod:`stratum.sweep.cluster_sim`; the profiles' times are taken at device speed 1)."""
    if png is not None:
        check_writable(png, "--png", ".png")  # before the profiles: a bad path is refused before any work
    spec = load_sweep(path)
    s = spec.settings
    jobs = expand(spec)
    configs = {j.id: c for j, c in zip(jobs, check_jobs(spec, jobs, Path(s.out_dir).expanduser()))}
    for cfg in distinct_data(configs.values()):
        prepare_data(cfg)
    profiles = job_profiles(configs, threads=job_threads(s), cache_dir=None)
    steps = {j: c.train.steps for j, c in configs.items()}
    if hardware is not None:
        cluster = {j: ClusterJob(profile=profiles[j], microbatches=c.micro_batches_per_step, steps=c.train.steps)
                   for j, c in configs.items()}
        results = simulate_cluster(cluster, hardware, shard_blocks=s.shard_blocks,
                                   time_limit_s=s.plan_time_limit_s, gap=s.plan_gap).results
        slots = hardware.num_devices
        say(f"SIMULATED: {len(steps)} jobs on the {slots} device(s) of the hardware spec, profiled block times; "
            "nothing was run")
    else:
        step_s = {j: predicted_seconds(profiles[j], c, 1) for j, c in configs.items()}
        seg = s.segment_steps or max(1, min(steps.values()) // 4)
        tasks = {j: tasks_per_step(len(profiles[j].blocks), job_shard_blocks(profiles[j], c, s.shard_blocks),
                                   c.micro_batches_per_step) for j, c in configs.items()}
        results = {name: simulate_sharded(steps, step_s, tasks, slots=s.slots) if name == "sharded-lrtf" else
                   simulate(name, steps, step_s, slots=s.slots, segment_steps=seg if name == "lrtf" else 0,
                            time_limit_s=s.plan_time_limit_s, gap=s.plan_gap) for name in SCHEDULERS}
        slots = s.slots
        why = "" if s.segment_steps else ": sweep.segment_steps is unset, a quarter of the shortest job's steps"
        say(f"SIMULATED: {len(steps)} jobs on {s.slots} slot(s), profiled forward+backward times (lrtf in slices "
            f"of {seg} steps{why}); nothing was run")
        if not s.device_budget.strip():
            say("sharded-lrtf: shard tasks of the jobs' profiled block times, the offload engine's copies not "
                "priced (sweep.device_budget is unset; a real sharded-lrtf sweep needs one)")
    fifo = results["fifo"].makespan
    for name, r in results.items():
        say(f"{name:12} makespan {r.makespan:9.2f} s  utilisation {r.utilisation:6.1%}  "
            f"{fifo / r.makespan if r.makespan else 0:.2f}x fifo's throughput")
    if png is not None:
        data = gantt_png({n: r.runs for n, r in results.items()}, slots)
        if data is None:
            raise StratumError("--png needs matplotlib: pip install 'stratum[plot]'")
        atomic_write_bytes(png, data)
        say(f"wrote {png}")
    return {n: {"makespan_s": r.makespan, "utilisation": r.utilisation} for n, r in results.items()}
