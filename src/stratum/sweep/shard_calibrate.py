"""The calibration of ``sharded-lrtf``: what a job's shard tasks really hold a slot for on this machine.

Under sharded-lrtf every job runs under the offload engine at the sweep's device budget as a chain of shard tasks
handed between slots, so its seconds on a slot are not a plain job's: the engine's set-up (its placement plan and
bandwidth probes), chunk copies between the tiers, the optimizer step, the gate's hand-overs and waiting for
another job's set-up all add to its profiled compute. This calibration measures them the way a sweep runs them:
the base config at each calibration preset as ``slots + 1`` offload jobs in the sweep's own shard worker
(:mod:`stratum.sweep.shard_worker`) on ``slots`` slots — every slot busy, tasks handed between jobs, the jobs'
set-ups one at a time — and fits :class:`stratum.sweep.calibrate.Calibration`'s form to the jobs' mean
slot-holding seconds, read from the worker's grant log: a step's seconds are its tasks' (median over the steps),
the fixed part the rest (the first task holds the job's set-up; the one after its last step the last optimizer
step, evaluation and checkpoint).

It is cached beside the plain calibration (``<cache stem>.sharded.json``), keyed also by the budget and the
shard size.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from stratum.atomic import atomic_write_text
from stratum.config import Config, to_toml
from stratum.errors import StratumError
from stratum.profile.profile import Profile
from stratum.sweep.calibrate import (
    CALIBRATION_TIMEOUT_S,
    Calibration,
    Sample,
    calibration_configs,
    calibration_key,
    calibration_profiles,
    from_samples,
    load_calibration,
    save_calibration,
    with_items,
)
from stratum.sweep.local import start_process
from stratum.sweep.shard_lrtf import tasks_per_step
from stratum.sweep.shard_worker import ShardJob, shard_worker_main, task_seconds


def shard_cache_path(cache: Path) -> Path:
    """Where the sharded calibration is kept beside the plain one cached at ``cache``."""
    return cache.with_name(f"{cache.stem}.sharded{cache.suffix or '.json'}")


def shard_calibration(base: Config, *, threads: int, slots: int, budget: str, shard_blocks: int, work_dir: Path,
                      cache: Path) -> Calibration:
    """The cached sharded-lrtf calibration for ``base`` at ``budget`` on this machine, measured (and cached at
    :func:`shard_cache_path` of ``cache``) if there is none."""
    key = json.dumps([calibration_key(base, threads=threads, slots=slots), "sharded-lrtf", budget, shard_blocks])
    path = shard_cache_path(cache)
    if (cal := load_calibration(path, key)) is not None:
        return cal
    cal = measure_sharded(base, threads=threads, slots=slots, budget=budget, shard_blocks=shard_blocks,
                          work_dir=work_dir)
    save_calibration(path, key, cal)
    return cal


def measure_sharded(base: Config, *, threads: int, slots: int, budget: str, shard_blocks: int,
                    work_dir: Path) -> Calibration:
    """Train ``base`` at each calibration preset as ``slots + 1`` sharded-lrtf jobs at ``budget`` on ``slots``
    slots; the calibration fitted to their mean slot-holding seconds (measured under the sweep's contention, so
    its contention factor is 1)."""
    plain = calibration_configs(base)
    profiles = calibration_profiles(plain, threads)
    samples = []
    for i, (cfg, prof) in enumerate(zip(plain, profiles)):
        cfg = with_items(cfg, ("train", "engine", "offload"), ("offload", "device_budget", budget))
        samples.append(_run(cfg, prof, copies=slots + 1, slots=slots, threads=threads, shard_blocks=shard_blocks,
                            root=work_dir / f"sharded{i}"))
    return from_samples(samples, samples)


def _run(cfg: Config, prof: Profile, *, copies: int, slots: int, threads: int, shard_blocks: int,
         root: Path) -> Sample:
    """``copies`` jobs of ``cfg`` in one shard worker on ``slots`` slots, to their end; their mean Sample."""
    per_step = tasks_per_step(len(prof.blocks), shard_blocks, cfg.micro_batches_per_step)
    steps = cfg.train.steps
    jobs = []
    for i in range(copies):
        out = root / f"j{i}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "job.toml").write_text(to_toml(with_items(cfg, ("train", "out_dir", str(out)))))
        jobs.append(ShardJob(id=f"cal{i}", config_path=str(out / "job.toml"), tasks_left=per_step * steps,
                             task_s=1.0, shard_blocks=shard_blocks))
    spec_path = root / "shard_spec.json"
    atomic_write_text(spec_path, json.dumps({"sweep_dir": str(root), "slots": slots, "threads": threads,
                                             "jobs": [vars(j) for j in jobs]}))
    worker = start_process(shard_worker_main, (str(spec_path), os.getpid()), "stratum-calibration-shards")
    deadline = time.monotonic() + CALIBRATION_TIMEOUT_S
    while worker.poll() is None and time.monotonic() < deadline:
        worker.join(0.05)
    exit_path = root / "shard_exit.json"
    codes = json.loads(exit_path.read_text()) if exit_path.exists() else {}
    if worker.poll() is None or any(codes.get(j.id) != 0 for j in jobs):
        if worker.poll() is None:
            worker.kill()
        raise StratumError(f"a sharded calibration job did not finish within {CALIBRATION_TIMEOUT_S:.0f} s or "
                           f"failed; see {root / 'shards.log'} and {root / 'j0' / 'worker.log'}")
    tasks = task_seconds(root / "shard_tasks.jsonl")
    each = [sample_from_tasks(tasks.get(j.id, []), per_step=per_step, steps=steps,
                              profiled_step_s=prof.step_s * cfg.micro_batches_per_step,
                              state_bytes=prof.train_state_bytes) for j in jobs]
    return Sample(profiled_step_s=each[0].profiled_step_s, state_bytes=each[0].state_bytes,
                  step_s=sum(e.step_s for e in each) / len(each), fixed_s=sum(e.fixed_s for e in each) / len(each))


def sample_from_tasks(tasks: list[float], *, per_step: int, steps: int, profiled_step_s: float,
                      state_bytes: int) -> Sample:
    """A job's Sample from its tasks' seconds on a slot (chain order; ``per_step`` tasks a step): a step's
    seconds are the median of its ``steps`` steps' task sums; the fixed part is the rest of all its tasks (the
    first task holds the job's set-up, the one after its last step the last optimizer step, evaluation and
    checkpoint)."""
    if len(tasks) < per_step * steps:
        raise StratumError(f"a sharded calibration job ran {len(tasks)} shard tasks, fewer than its "
                           f"{per_step * steps}; see its worker.log")
    sums = sorted(sum(tasks[s * per_step:(s + 1) * per_step]) for s in range(steps))
    step_s = sums[len(sums) // 2]
    return Sample(profiled_step_s=profiled_step_s, state_bytes=state_bytes, step_s=step_s,
                  fixed_s=sum(tasks) - steps * step_s)
