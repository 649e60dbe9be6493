"""The calibration of ``sharded-lrtf``: what a sweep's jobs' shard tasks really hold a slot for on this machine.

Under sharded-lrtf every job runs under the offload engine at the sweep's device budget as a chain of shard tasks
handed between slots, so its seconds on a slot are not a plain job's: the engine's set-up (its placement plan and
bandwidth probes), chunk copies between the tiers, the optimizer step, the gate's hand-overs and waiting for
another job's set-up all add to its profiled compute, and by amounts that follow the job's shape (model, sequence
length, micro-batches) more closely than any profile-based line. So the calibration runs the sweep's own
distinct job shapes (:func:`stratum.sweep.shape_cost.pick_shapes`), each twice where the sweep has several jobs
of it (:func:`calibration_jobs`), SHARD_STEPS steps each, at least ``slots + 1`` jobs in all (shapes repeated), in
one shard worker (:mod:`stratum.sweep.shard_worker`, as a sweep runs them) on ``slots`` slots — slots busy, tasks
handed between jobs, the jobs' set-ups one at a time, the worker's one-time costs shared by its jobs — and reads each
job's slot-holding seconds from the worker's grant log: a step's seconds are its tasks' (median over the steps),
the fixed part the rest (the first task holds the job's set-up; the one after its last step the last optimizer
step, evaluation and checkpoint). The costs and the line for a shape not measured are the plain calibration's
fit (:func:`stratum.sweep.shape_cost.fit`), the line against the offload planner's predicted step at the budget
(:func:`stratum.sweep.predict.offload_step_s`), which models what the budget costs (recomputed or spilled
activations, chunk copies).

The jobs keep their device memory while they wait. Where the sweep's ``device_memory`` may make waiting jobs give
it back, the rule decides how many give-backs a sweep has — the simulator plays it out
(:class:`stratum.sweep.shard_lrtf.GiveBack`) — and the calibration measures what one costs: it runs the same jobs
again, each giving back at every shard boundary (the vacate, the copies back, the chunks fetched again), and
prices a give-back of each shape as the difference in its step over the tasks in a step. Few jobs on few slots
see few give-backs of their own, where a sweep whose many waiting jobs alternate sees one nearly every task; so
the cost is measured, and the count simulated.

It is cached at ``<cache stem>.sharded.json`` beside the plain calibration, keyed also by the budget, the shard
size and the devices' capacity.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from stratum.atomic import atomic_write_text
from stratum.config import Config, to_toml
from stratum.errors import StratumError
from stratum.profile.profile import Profile
from stratum.sweep.calibrate import CALIBRATION_TIMEOUT_S, Sample, with_items
from stratum.sweep.local import start_process
from stratum.sweep.predict import offload_step_s
from stratum.sweep.shape_cost import (
    SHAPE_STEPS,
    SHARDED,
    Measured,
    ShapeCalibration,
    fit,
    load_shape_calibration,
    pick_shapes,
    save_shape_calibration,
    shape_key,
    shape_label,
    shapes_key,
)
from stratum.sweep.shard_lrtf import tasks_per_step
from stratum.sweep.shard_size import job_shard_blocks
from stratum.sweep.shard_worker import ShardJob, shard_worker_main
from stratum.sweep.slot_scheduler import UNLIMITED, DeviceMemory, task_seconds


@dataclass(frozen=True, kw_only=True)
class CalJob:
    """One calibration job: a copy of a shape."""

    id: str
    """Its id in the grant log."""
    shape: str
    """Its shape key."""
    label: str
    """Its shape in words."""
    per_step: int
    """Shard tasks per optimizer step."""
    predicted_step_s: float
    """The offload planner's predicted step of its shape (the line's abscissa)."""
    state_bytes: int
    """Its training state, bytes."""

SHARD_STEPS = 2 * SHAPE_STEPS
"""Steps of each calibration job. A job's first steps share the worker's cores with the other jobs' set-ups (each
one's placement plan and profile: seconds of CPU in a thread of the same process), which a sweep's longer jobs
barely see; the median of 8 steps lands past them, where that of 4 did not (BENCHMARKS.md)."""



SHAPE_COPIES = 2
"""The most calibration jobs of one shape (:func:`calibration_jobs`)."""


def shard_cache_path(cache: Path) -> Path:
    """Where the sharded calibration is kept beside the plain one cached at ``cache``."""
    return cache.with_name(f"{cache.stem}.sharded{cache.suffix or '.json'}")


def shard_calibration_key(configs: list[Config], *, threads: int, slots: int, shard_blocks: int,
                          memory: DeviceMemory = UNLIMITED) -> str:
    """What a sharded calibration depends on: the machine, the budget, the shard size, the devices' capacity
    (whether waiting jobs give their memory back) and the shapes."""
    return shapes_key(configs, threads=threads, slots=slots, kind=SHARDED,
                      extra=(configs[0].offload.device_budget, shard_blocks, *memory.capacity))


def shard_calibration(configs: list[Config], profiles: list[Profile], *, threads: int, slots: int,
                      shard_blocks: int, work_dir: Path, cache: Path,
                      memory: DeviceMemory = UNLIMITED) -> ShapeCalibration:
    """The cached sharded-lrtf calibration of the job ``configs`` (each with its offload budget; ``profiles[i]``
    is ``configs[i]``'s) on this machine, measured (and cached at :func:`shard_cache_path` of ``cache``) if there
    is none."""
    key = shard_calibration_key(configs, threads=threads, slots=slots, shard_blocks=shard_blocks, memory=memory)
    path = shard_cache_path(cache)
    if (cal := load_shape_calibration(path, key, SHARDED)) is not None:
        return cal
    cal = measure_shapes(configs, profiles, threads=threads, slots=slots, shard_blocks=shard_blocks,
                         work_dir=work_dir, memory=memory)
    save_shape_calibration(path, key, cal)
    return cal


def measure_shapes(configs: list[Config], profiles: list[Profile], *, threads: int, slots: int,
                   shard_blocks: int, work_dir: Path, memory: DeviceMemory = UNLIMITED) -> ShapeCalibration:
    """Train the sweep's shapes (:func:`pick_shapes`), SHARD_STEPS steps each (:func:`calibration_jobs` of each),
    at least ``slots + 1`` jobs in all, as sharded-lrtf jobs in one shard worker on ``slots`` slots, none giving
    back; their costs from the grant log. Where ``memory`` may make waiting jobs give back, the same jobs again,
    each giving back at every shard boundary: a give-back's cost per shape is the difference of the two runs'
    steps over the tasks in a step."""
    shapes = calibration_jobs(configs, profiles)
    picks = [shapes[i % len(shapes)] for i in range(max(len(shapes), slots + 1))]
    runs = [CalJob(id=f"c{i}", shape=shape_key(cfg), label=shape_label(cfg),
                   per_step=tasks_per_step(len(prof.blocks), job_shard_blocks(prof, cfg, shard_blocks),
                                           cfg.micro_batches_per_step),
                   predicted_step_s=offload_step_s(cfg, prof), state_bytes=prof.train_state_bytes)
            for i, (cfg, prof) in enumerate(picks)]
    root = work_dir / "sharded"
    kept = _run(_jobs(picks, runs, root, shard_blocks, gives_back=False), slots=slots, threads=threads, root=root)
    cal = fit_shapes(kept, runs, steps=SHARD_STEPS)
    if not memory.limited:
        return cal
    root = work_dir / "sharded_give_back"
    gave = _run(_jobs(picks, runs, root, shard_blocks, gives_back=True), slots=slots, threads=threads, root=root)
    per_shape = give_back_costs(kept, gave, runs, steps=SHARD_STEPS)
    per_byte = sorted(per_shape[r.shape] / r.state_bytes for r in runs if r.state_bytes)
    return replace(cal, give_back=per_shape, give_back_per_byte=per_byte[len(per_byte) // 2] if per_byte else 0.0)


def calibration_jobs(configs: list[Config], profiles: list[Profile]) -> list[tuple[Config, Profile]]:
    """The calibration's jobs: each picked shape (:func:`pick_shapes`) as many times as the sweep has jobs of it,
    up to SHAPE_COPIES, in shape order. Jobs of one shape tie in remaining time, so the rule hands the slot from
    one to the other at every task, each starting on caches the other left; one copy alone would measure a shape
    that keeps its slot, and a sweep's jobs of it then run 1.3–1.6× the seconds it measured (BENCHMARKS.md)."""
    count = Counter(shape_key(c) for c in configs)
    return [pick for pick in pick_shapes(configs, profiles)
            for _ in range(min(SHAPE_COPIES, count[shape_key(pick[0])]))]


def _jobs(picks: list[tuple[Config, Profile]], runs: list[CalJob], root: Path, shard_blocks: int, *,
          gives_back: bool) -> list[ShardJob]:
    """The calibration's shard jobs, each with a fresh out_dir under ``root``."""
    jobs = []
    for (cfg, prof), run in zip(picks, runs):
        out = root / run.id
        out.mkdir(parents=True, exist_ok=True)
        job_cfg = with_items(cfg, ("train", "steps", SHARD_STEPS), ("train", "out_dir", str(out)))
        (out / "job.toml").write_text(to_toml(job_cfg))
        # remaining time as profiled: the larger jobs first, as the sweep's rule would order them
        jobs.append(ShardJob(id=run.id, config_path=str(out / "job.toml"), tasks_left=run.per_step * SHARD_STEPS,
                             task_s=prof.step_s / run.per_step, shard_blocks=job_shard_blocks(prof, cfg, shard_blocks),
                             gives_back_every_task=gives_back))
    return jobs


def give_back_costs(kept: dict[str, list[float]], gave: dict[str, list[float]], runs: list[CalJob], *,
                    steps: int) -> dict[str, float]:
    """Each shape's seconds per give-back: its jobs' median step giving back at every task (``gave``) less their
    median step keeping their memory (``kept``), over the tasks in a step (the mean over the shape's jobs; ≥ 0)."""
    def step(tasks: dict[str, list[float]], r: CalJob) -> float:
        return sample_from_tasks(tasks.get(r.id, []), per_step=r.per_step, steps=steps, profiled_step_s=0.0,
                                 state_bytes=0).step_s
    out: dict[str, list[float]] = {}
    for r in runs:
        out.setdefault(r.shape, []).append(max(0.0, step(gave, r) - step(kept, r)) / r.per_step)
    return {shape: sum(v) / len(v) for shape, v in out.items()}


def fit_shapes(tasks: dict[str, list[float]], runs: list[CalJob], *, steps: int) -> ShapeCalibration:
    """The calibration from the calibration jobs' tasks' seconds on a slot (:func:`task_seconds` of their grant
    log): each job's sample (:func:`sample_from_tasks`) fitted by :func:`stratum.sweep.shape_cost.fit`."""
    return fit(SHARDED, [Measured(shape=r.shape, label=r.label,
                                  sample=sample_from_tasks(tasks.get(r.id, []), per_step=r.per_step, steps=steps,
                                                           profiled_step_s=r.predicted_step_s,
                                                           state_bytes=r.state_bytes)) for r in runs])


def _run(jobs: list[ShardJob], *, slots: int, threads: int, root: Path) -> dict[str, list[float]]:
    """``jobs`` in one shard worker on ``slots`` slots (no device's memory limited), to their end; each job's
    tasks' seconds on a slot."""
    spec_path = root / "shard_spec.json"
    atomic_write_text(spec_path, json.dumps({"sweep_dir": str(root), "slots": slots, "threads": threads,
                                             "jobs": [vars(j) for j in jobs], "memory": asdict(UNLIMITED)}))
    worker = start_process(shard_worker_main, (str(spec_path),), "stratum-calibration-shards")
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
