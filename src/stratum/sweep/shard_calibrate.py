"""The calibration of ``sharded-lrtf``: what a job's shard tasks really hold a slot for on this machine.

Under sharded-lrtf every job runs under the offload engine at the sweep's device budget as a chain of shard tasks
handed between slots, so its seconds on a slot are not a plain job's: the engine's set-up (its placement plan and
bandwidth probes), chunk copies between the tiers, the optimizer step, the gate's hand-overs and waiting for
another job's set-up all add to its profiled compute. This calibration measures them the way a sweep runs them:
the base config at each calibration preset, ``slots`` offload jobs of each, all in one shard worker
(:mod:`stratum.sweep.shard_worker`, as a sweep runs them) on ``slots`` slots — slots busy, tasks handed between
jobs, the jobs' set-ups one at a time, the worker's one-time costs (the engine's bandwidth probes) shared by its
jobs — and fits :class:`stratum.sweep.calibrate.Calibration`'s form to each job's slot-holding seconds, read from
the worker's grant log: a step's seconds are its tasks' (median over the steps), the fixed part the rest (the
first task holds the job's set-up; the one after its last step the last optimizer step, evaluation and
checkpoint). Its "profiled step" is the offload planner's predicted step at the budget
(:func:`stratum.sweep.predict.offload_step_s`), not the plain profile's: what the budget costs — recomputed or
spilled activations, chunk copies — differs by model and sequence length, and the planner models it, so the
calibration is left to fit what it does not (hand-overs, the gate, the optimizer, contention).

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
from stratum.sweep.predict import offload_step_s
from stratum.sweep.shard_lrtf import tasks_per_step
from stratum.sweep.shard_worker import ShardJob, shard_worker_main, task_seconds


def shard_cache_path(cache: Path) -> Path:
    """Where the sharded calibration is kept beside the plain one cached at ``cache``."""
    return cache.with_name(f"{cache.stem}.sharded{cache.suffix or '.json'}")


def shard_calibration_key(base: Config, *, threads: int, slots: int, budget: str, shard_blocks: int) -> str:
    """What a sharded calibration depends on: the plain one's key, the budget and the shard size."""
    return json.dumps([calibration_key(base, threads=threads, slots=slots), "sharded-lrtf", budget, shard_blocks])


def shard_calibration(base: Config, *, threads: int, slots: int, budget: str, shard_blocks: int, work_dir: Path,
                      cache: Path) -> Calibration:
    """The cached sharded-lrtf calibration for ``base`` at ``budget`` on this machine, measured (and cached at
    :func:`shard_cache_path` of ``cache``) if there is none."""
    key = shard_calibration_key(base, threads=threads, slots=slots, budget=budget, shard_blocks=shard_blocks)
    path = shard_cache_path(cache)
    if (cal := load_calibration(path, key)) is not None:
        return cal
    cal = measure_sharded(base, threads=threads, slots=slots, budget=budget, shard_blocks=shard_blocks,
                          work_dir=work_dir)
    save_calibration(path, key, cal)
    return cal


def measure_sharded(base: Config, *, threads: int, slots: int, budget: str, shard_blocks: int,
                    work_dir: Path) -> Calibration:
    """Train ``base`` at each calibration preset, ``slots`` copies of each, as sharded-lrtf jobs at ``budget`` in
    one shard worker on ``slots`` slots; the calibration fitted to each job's slot-holding seconds (measured under
    the sweep's contention, so its contention factor is 1)."""
    plain = calibration_configs(base)
    profiles = calibration_profiles(plain, threads)
    configs = [with_items(c, ("train", "engine", "offload"), ("offload", "device_budget", budget)) for c in plain]
    jobs: list[tuple[ShardJob, Config, Profile]] = []
    for i, (cfg, prof) in enumerate(zip(configs, profiles)):
        per_step = tasks_per_step(len(prof.blocks), shard_blocks, cfg.micro_batches_per_step)
        for k in range(slots):
            out = work_dir / "sharded" / f"p{i}c{k}"
            out.mkdir(parents=True, exist_ok=True)
            (out / "job.toml").write_text(to_toml(with_items(cfg, ("train", "out_dir", str(out)))))
            # remaining time as profiled: the larger jobs first, as the sweep's rule would order them
            jobs.append((ShardJob(id=f"p{i}c{k}", config_path=str(out / "job.toml"),
                                  tasks_left=per_step * cfg.train.steps, task_s=prof.step_s / per_step,
                                  shard_blocks=shard_blocks), cfg, prof))
    tasks = _run([j for j, _, _ in jobs], slots=slots, threads=threads, root=work_dir / "sharded")
    predicted = [offload_step_s(cfg, prof) for cfg, prof in zip(configs, profiles)]
    samples = [sample_from_tasks(tasks.get(job.id, []), per_step=job.tasks_left // cfg.train.steps,
                                 steps=cfg.train.steps, profiled_step_s=predicted[configs.index(cfg)],
                                 state_bytes=prof.train_state_bytes) for job, cfg, prof in jobs]
    return from_samples(samples, samples)


def _run(jobs: list[ShardJob], *, slots: int, threads: int, root: Path) -> dict[str, list[float]]:
    """``jobs`` in one shard worker on ``slots`` slots, to their end; each job's tasks' seconds on a slot."""
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
                           f"failed; see {root / 'shards.log'} and its jobs' worker.log")
    return task_seconds(root / "shard_tasks.jsonl")


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
