"""The calibration of fifo, lrtf and planned: what a sweep's own job shapes take on this machine, run as the
sweep runs them (a worker process per job from the sweep's forkserver, :class:`stratum.sweep.local.LocalBackend`).

Each of the sweep's distinct shapes (:func:`stratum.sweep.shape_cost.pick_shapes`: at most MAX_SHAPES, spread
over their profiled step times) trains SHAPE_STEPS steps twice: alone (then SHAPE_STEPS more from its checkpoint,
which prices a restart), then as ``slots`` copies at once (every slot busy, so how much the shape slows beside
others is measured per shape, not as one factor for all). A job's
step seconds are its median step (the first, warm-up step left out), its fixed seconds the rest of its wall time
from worker start to exit. A job of a measured shape is predicted as its shape's busy cost; a shape not measured
by the line through the measured ones (:func:`stratum.sweep.shape_cost.fit`).

It is cached at the given path, keyed by the machine, the slots, the threads and the shapes
(:func:`stratum.sweep.shape_cost.shapes_key`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from stratum.config import Config, to_toml
from stratum.errors import StratumError
from stratum.profile.profile import Profile
from stratum.sweep.calibrate import CALIBRATION_TIMEOUT_S, Sample, with_items
from stratum.sweep.local import LocalBackend
from stratum.sweep.segment import Segment
from stratum.sweep.shape_cost import (
    PLAIN,
    SHAPE_STEPS,
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
from stratum.train.metrics import median
from stratum.train.trainer import read_metrics


def one_slot(cfg: Config) -> Config:
    """A job's config as one slot runs it: a plan over several slots is priced from its one-slot shape (the
    planned scheduler's strategies, :mod:`stratum.sweep.strategies`)."""
    return with_items(cfg, ("parallel", "plan", "")) if cfg.parallel.plan.strip() else cfg


def plain_calibration_key(configs: list[Config], *, threads: int, slots: int) -> str:
    return shapes_key([one_slot(c) for c in configs], threads=threads, slots=slots, kind=PLAIN)


def plain_calibration(configs: list[Config], profiles: list[Profile], *, threads: int, slots: int,
                      work_dir: Path, cache: Path) -> ShapeCalibration:
    """The cached calibration of the job ``configs`` (``profiles[i]`` is ``configs[i]``'s) on this machine,
    measured (and cached at ``cache``) if there is none."""
    key = plain_calibration_key(configs, threads=threads, slots=slots)
    if (cal := load_shape_calibration(cache, key, PLAIN)) is not None:
        return cal
    cal = measure(configs, profiles, threads=threads, slots=slots, work_dir=work_dir)
    save_shape_calibration(cache, key, cal)
    return cal


def measure(configs: list[Config], profiles: list[Profile], *, threads: int, slots: int,
            work_dir: Path) -> ShapeCalibration:
    """Train each of the sweep's shapes SHAPE_STEPS steps alone, then SHAPE_STEPS more from that run's checkpoint
    (what a restart costs: :func:`restart_s`), then ``slots`` copies at once, and fit."""
    backend = LocalBackend()
    backend.warm_up()
    alone: list[Measured] = []
    busy: list[Measured] = []
    restart: dict[str, float] = {}
    try:
        for i, (cfg, prof) in enumerate(pick_shapes([one_slot(c) for c in configs], profiles)):
            cfg = with_items(cfg, ("train", "steps", SHAPE_STEPS))
            alone += _run(backend, [cfg], prof, work_dir / f"alone{i}", threads)
            restart[shape_key(cfg)] = restart_s(backend, cfg, work_dir / f"alone{i}" / "j0", threads)
            busy += _run(backend, [cfg] * slots, prof, work_dir / f"busy{i}", threads)
    finally:
        backend.close()
    return replace(fit(PLAIN, busy, alone), restart=restart)


def restart_s(backend: LocalBackend, cfg: Config, out: Path, threads: int) -> float:
    """Seconds a segment that resumes ``cfg``'s finished run in ``out`` spends beyond its SHAPE_STEPS steps: a
    worker's start, the checkpoint loaded, the next one saved (what each time slice after a job's first pays under
    lrtf with ``slice_by = "checkpoint"``)."""
    more = with_items(cfg, ("train", "steps", 2 * SHAPE_STEPS), ("train", "out_dir", str(out)))
    (out / "job.toml").write_text(to_toml(more))
    seg = backend.start(job="cal-restart", slots=(0,), config_path=out / "job.toml", start_step=SHAPE_STEPS,
                        stop_at=2 * SHAPE_STEPS, devices=None, threads=threads, log_path=out / "log.txt",
                        slice_steps=0)
    wall = _wait([(seg, out)])[0] - seg.started
    recs = [r for r in read_metrics(out) if r.get("step", 0) > SHAPE_STEPS]
    step_s = median(recs, "step_s")
    if step_s is None:
        raise StratumError(f"a calibration job's restart recorded no step times; see {out / 'log.txt'}")
    return max(0.0, wall - len(recs) * step_s)


def _run(backend: LocalBackend, configs: list[Config], prof: Profile, root: Path,
         threads: int) -> list[Measured]:
    """Run ``configs`` at once, one worker each on a slot of its own, to their end; what each took."""
    segs: list[tuple[Segment, Path]] = []
    for i, cfg in enumerate(configs):
        out = root / f"j{i}"
        out.mkdir(parents=True, exist_ok=True)
        job_cfg = with_items(cfg, ("train", "out_dir", str(out)))
        (out / "job.toml").write_text(to_toml(job_cfg))
        segs.append((backend.start(job=f"cal{i}", slots=(i,), config_path=out / "job.toml", start_step=0,
                                   stop_at=cfg.train.steps, devices=None, threads=threads,
                                   log_path=out / "log.txt", slice_steps=0), out))
    ended = _wait(segs)
    return [job_measured(out, ended[i] - seg.started, configs[i], prof) for i, (seg, out) in enumerate(segs)]


def job_measured(out: Path, wall_s: float, cfg: Config, prof: Profile) -> Measured:
    """A calibration job's figures from its run directory's metrics and its worker's wall seconds: its step the
    median step (the first, warm-up step left out), its fixed part the rest of the wall time."""
    recs = read_metrics(out)
    step_s = median(recs, "step_s")
    if step_s is None:
        raise StratumError(f"a calibration job recorded no step times; see {out / 'log.txt'}")
    sample = Sample(profiled_step_s=prof.step_s * cfg.micro_batches_per_step, state_bytes=prof.train_state_bytes,
                    step_s=step_s, fixed_s=wall_s - len(recs) * step_s)
    return Measured(shape=shape_key(cfg), label=shape_label(cfg), sample=sample)


def _wait(segs: list[tuple[Segment, Path]]) -> dict[int, float]:
    """Each worker's exit time; a one-line error (the others killed) if one fails or outlives the timeout."""
    ended: dict[int, float] = {}
    deadline = time.monotonic() + CALIBRATION_TIMEOUT_S
    while len(ended) < len(segs) and time.monotonic() < deadline:
        for i, (seg, _) in enumerate(segs):
            if i not in ended and seg.worker.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.02)
    if bad := [out for i, (seg, out) in enumerate(segs) if i not in ended or seg.worker.poll() != 0]:
        for seg, _ in segs:
            if seg.worker.poll() is None:
                seg.worker.kill()
        raise StratumError(f"a calibration job did not finish within {CALIBRATION_TIMEOUT_S:.0f} s or "
                           f"failed; see {bad[0] / 'log.txt'}")
    return ended
