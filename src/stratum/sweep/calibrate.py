"""What a sweep job costs beyond its profiled forward + backward, as a line: the form a calibration keeps for the
job shapes it did not measure, and the pieces both calibrations share (a measured job's Sample, the machine's
key, reading a calibration file).

A profile times the blocks' forward and backward only. A job run by the sweep also spends a fixed part (worker
start, data and token cache, model build, the final evaluation and checkpoint), which grows with the model's
training state, and a per-step part (optimizer step, data, Python) beside its profiled compute; and slots that
share the machine's cores slow each other. The line through measured jobs is::

    job seconds = (fixed_s + fixed_s_per_byte · state bytes
                   + steps · (step_scale · profiled step seconds + step_overhead_s)) · contention

The measured shapes themselves are priced as measured (:mod:`stratum.sweep.shape_cost`). An unreadable or
foreign cache is ignored (measured again), never trusted.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TypeVar

import torch

from stratum.config import Config, config_from_dict
from stratum.errors import StratumError

CALIBRATION_TIMEOUT_S = 300.0
"""A calibration job that runs longer than this is a failure, not a measurement."""
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One calibration job's figures."""

    profiled_step_s: float
    """Its profile's forward + backward seconds per optimizer step."""
    state_bytes: int
    """Its training state (parameters, gradients, optimizer moments), bytes."""
    step_s: float
    """Its measured median optimizer-step seconds."""
    fixed_s: float
    """Its wall seconds (worker start to exit) less its steps at the median step's seconds (so the first
    steps' warm-up counts as fixed)."""


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """How a job's real seconds follow from its profile on this machine (see the module docstring)."""

    fixed_s: float
    """Seconds every job spends outside its steps, whatever its size."""
    fixed_s_per_byte: float
    """Further seconds outside the steps per byte of training state (build, evaluation, checkpoint)."""
    step_scale: float
    """Measured step seconds per profiled step second."""
    step_overhead_s: float
    """Measured step seconds beside the profiled compute (optimizer, data, Python)."""
    contention: float
    """A job's seconds with ``slots`` jobs running at once over its seconds alone."""

    def job_seconds(self, *, profiled_step_s: float, state_bytes: int, steps: int) -> float:
        """Predicted wall seconds of a job of ``steps`` optimizer steps run by the sweep."""
        fixed = self.fixed_s + self.fixed_s_per_byte * state_bytes
        per_step = self.step_scale * profiled_step_s + self.step_overhead_s
        return max(0.0, fixed + steps * per_step) * self.contention

    def describe(self) -> str:
        """The fit as a formula of a job's profiled step and state bytes, for a progress line."""
        return (f"job s = ({self.fixed_s:.2f} s {signed(self.fixed_s_per_byte * 1e9, 'ns/B × state', 1)} + steps × "
                f"({self.step_scale:.2f} × profiled step {signed(self.step_overhead_s * 1e3, 'ms', 0)})) × "
                f"{self.contention:.2f}")


def signed(value: float, unit: str, digits: int) -> str:
    """``value`` as a term of a sum: "+ 1.5 unit" or "- 1.5 unit"."""
    return f"{'-' if value < 0 else '+'} {abs(value):.{digits}f} {unit}"


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of ys over xs; with one distinct x, slope 0 through the mean."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0.0:
        return 0.0, my
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


def from_samples(alone: list[Sample], together: list[Sample]) -> Calibration:
    """The calibration fitted to jobs measured alone, with contention = the jobs' summed step seconds run
    together (``together[i]`` is ``alone[i]``'s job) over alone: weighted by step time, so the largest job, whose
    steps are least dominated by timer and cache noise, counts most."""
    step_scale, step_overhead_s = fit_line([s.profiled_step_s for s in alone], [s.step_s for s in alone])
    per_byte, fixed_s = fit_line([float(s.state_bytes) for s in alone], [s.fixed_s for s in alone])
    alone_s = sum(s.step_s for s in alone)
    contention = sum(s.step_s for s in together) / alone_s if alone_s > 0 else 1.0
    return Calibration(fixed_s=fixed_s, fixed_s_per_byte=per_byte, step_scale=step_scale,
                       step_overhead_s=step_overhead_s, contention=max(1.0, contention))


def calibration_key(base: Config, *, threads: int, slots: int) -> str:
    """What a calibration depends on: the machine, torch, the workers' threads, the slots sharing the cores, and
    the train settings a job's fixed part follows."""
    t = base.train
    return json.dumps([platform.node(), os.cpu_count(), torch.__version__, threads, slots, t.micro_batch_size,
                       t.eval_interval, t.eval_batches, t.precision, t.device], sort_keys=True)


def parse_calibration(doc: object) -> Calibration:
    """The calibration in a calibration file's JSON document; ValueError (what is wrong) if it holds none."""
    values = doc.get("calibration") if isinstance(doc, dict) else None
    if not isinstance(values, dict):
        raise ValueError("it has no \"calibration\" table")
    names = {f.name for f in fields(Calibration)}
    if set(values) != names:
        raise ValueError(f"its calibration must have exactly the fields {', '.join(sorted(names))}")
    for n in sorted(names):
        v = values[n]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"its calibration's {n} is not a finite number ({v!r})")
    return Calibration(**{n: float(values[n]) for n in names})


def read_given(path: Path, what: str, parse: Callable[[object], T], kind: str) -> T:
    """What ``parse`` reads from the file at ``path`` (``what`` named it), whatever machine it was measured on
    (the user chose it); a one-line error if it cannot be read or holds no ``kind`` calibration."""
    try:
        return parse(json.loads(path.read_text()))
    except (OSError, ValueError, RecursionError) as e:  # (RecursionError: JSON nested too deeply)
        raise StratumError(f"{what} {path} is not a {kind} calibration file ({e}); give one the sweep wrote, or "
                           "\"auto\" or \"off\"") from None


def load_cached(path: Path, key: str, parse: Callable[[object], T]) -> T | None:
    """What ``parse`` reads from the cache at ``path`` if it is ``key``'s; None if there is none, it is
    unreadable, or it is another key's."""
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or doc.get("key") != key:
            return None
        return parse(doc)
    except (OSError, ValueError):
        return None


def with_items(cfg: Config, *items: tuple[str, str, object]) -> Config:
    """``cfg`` with (section, key, value) items replaced."""
    d = cfg.to_dict()
    for section, key, value in items:
        d[section][key] = value
    return config_from_dict(d)
