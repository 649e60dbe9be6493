"""``sweep.calibration``: the calibration a sweep's predictions go through — none ("off"), the file it names, or
("auto") one measured for this sweep on this machine and kept in the sweep directory.

``lrtf`` and ``planned`` use the plain calibration (:mod:`stratum.sweep.plain_calibrate`), ``sharded-lrtf`` its
own (:mod:`stratum.sweep.shard_calibrate`); both measure the sweep's own job shapes and are fitted alike
(:mod:`stratum.sweep.shape_cost`); ``fifo`` predicts nothing. "auto" keeps its measurement in
``<sweep dir>/calibration.json`` (sharded-lrtf: ``calibration.sharded.json``) rather than in a per-machine cache:
it is measured on this sweep's own job shapes, so it is the sweep's; a resumed sweep orders its jobs with the
numbers it started with (as its profiles, kept in ``<sweep dir>/profiles/``); and its key (machine, torch,
threads, slots, settings, shapes) still makes a sweep directory moved to another machine measure again.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from stratum.config import Config
from stratum.profile.profile import Profile
from stratum.sweep.calibrate import read_given
from stratum.sweep.plain_calibrate import plain_calibration
from stratum.sweep.shape_cost import PLAIN, SHARDED, ShapeCalibration, parse_shape_calibration
from stratum.sweep.shard_calibrate import shard_cache_path, shard_calibration
from stratum.sweep.shard_run import device_memory
from stratum.sweep.spec import SweepSettings, SweepSpec, job_threads

PREDICTING = ("lrtf", "sharded-lrtf", "planned")
"""The schedulers that order or plan jobs by predicted time (and so read a calibration)."""
AUTO_CACHE = "calibration.json"
"""The plain calibration's file in the sweep directory (sharded-lrtf's: :func:`shard_cache_path` of it)."""


def calibration_kind(settings: SweepSettings) -> str:
    """The kind of calibration the sweep's scheduler reads."""
    return SHARDED if settings.scheduler == "sharded-lrtf" else PLAIN


def given_calibration(spec: SweepSpec) -> ShapeCalibration | None:
    """The calibration of the file ``sweep.calibration`` names, of the kind the scheduler reads; None for "off"
    and "auto" (measured when the sweep runs). A file that holds none is a one-line error."""
    path = spec.calibration_path
    if path is None:
        return None
    kind = calibration_kind(spec.settings)
    return read_given(path, "sweep.calibration:", lambda doc: parse_shape_calibration(doc, kind), kind)


def auto_calibration(settings: SweepSettings, sweep_dir: Path, configs: dict[str, Config],
                     profiles: dict[str, Profile], say: Callable[[str], None]) -> ShapeCalibration:
    """The calibration cached in ``sweep_dir`` for this machine and these jobs, or measured now (its training in
    ``<sweep dir>/calibration/``, removed after) and cached; says which, and what it holds."""
    threads = job_threads(settings)
    cache = sweep_dir / AUTO_CACHE
    work = sweep_dir / "calibration"
    sharded = calibration_kind(settings) == SHARDED
    path = shard_cache_path(cache) if sharded else cache
    before = stamp(path)
    say(f"calibration for {settings.scheduler}'s predictions: {path} if it holds this machine's and these jobs', "
        "else measured now (this sweep's job shapes, a few steps each"
        + (")" if sharded else ", alone and with every slot busy)"))
    t0 = time.monotonic()
    jobs, profs = list(configs.values()), [profiles[j] for j in configs]
    try:
        if sharded:
            cal = shard_calibration(jobs, profs, threads=threads, slots=settings.slots,
                                    shard_blocks=settings.shard_blocks, work_dir=work, cache=cache,
                                    memory=device_memory(settings, jobs[0]))
        else:
            cal = plain_calibration(jobs, profs, threads=threads, slots=settings.slots, work_dir=work, cache=cache)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    how = "as cached" if stamp(path) == before else f"measured in {time.monotonic() - t0:.0f} s"
    say(f"calibration: {how}: {cal.describe()}")
    return cal


def stamp(path: Path) -> int | None:
    """The file's modification time (None: no file): a calibration that was measured rewrote its cache."""
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None
