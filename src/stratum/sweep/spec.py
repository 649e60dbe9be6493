"""The sweep file: a ``[sweep]`` table (scheduler, slots, early stop, search space) plus a base training config.

A sweep file is a training config with one more section::

    [sweep]
    out_dir = "runs/sweep"          # state.db, jobs/<id>/ (each an ordinary run directory), results.csv
    slots = 2                       # jobs at once
    scheduler = "fifo"              # fifo | lrtf | sharded-lrtf | planned
    calibration = "off"             # off | auto | a calibration file: what predicted job times go through

    [sweep.grid]                    # every combination
    "optim.lr" = [1e-3, 3e-3]
    "model.preset" = ["tiny", "mini"]

    [sweep.random]                  # sweep.samples draws per grid point
    "optim.min_lr" = {log_uniform = [1e-5, 1e-4]}

    [train]                         # the base config every job starts from (as in `stratum train --config`)
    steps = 100

Everything is checked here and in :mod:`stratum.sweep.expand` before any job starts; a mistake is a one-line
:class:`~stratum.errors.StratumError` that names the key and says what to do.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stratum.config import SECTIONS
from stratum.errors import StratumError
from stratum.sweep.shard_size import AUTO
from stratum.units import parse_budget, parse_bytes

SCHEDULERS = ("fifo", "lrtf", "sharded-lrtf", "planned")
BACKENDS = ("local", "ray")
EARLY_STOPS = ("", "asha")
SLICE_BY = ("checkpoint", "pause")
CALIBRATIONS = ("off", "auto")
"""sweep.calibration's words; anything else is a file's path."""
RANDOM_KINDS = ("choice", "uniform", "log_uniform", "int")
MAX_JOBS = 10_000  # a sweep larger than this is almost surely a mistyped range, and would only fill memory


@dataclass(kw_only=True)
class SweepSettings:
    """The ``[sweep]`` table's scalar keys."""

    out_dir: str = "runs/sweep"
    """The sweep directory: state.db (jobs, attempts, results), jobs/<id>/ (each job's run directory),
    results.csv; relative paths are relative to the current directory, as train.out_dir is."""
    base: str = ""
    """A training config file the jobs start from (relative to the sweep file); this file's own sections apply on
    top of it, then each job's values. "" = the defaults."""
    scheduler: str = "fifo"
    """Which job a freed slot takes: fifo (sweep order, one job per slot); lrtf (the job with the longest
    remaining predicted time, time-sliced in segments of sweep.segment_steps steps, its state in its checkpoint
    between segments); sharded-lrtf (Hydra: jobs as chains of shard tasks of sweep.shard_blocks blocks under the
    offload engine, a freed slot taking the shard task of the job with the longest remaining time); or planned
    (a makespan-minimising assignment of jobs to slots from profiled step times, solved as a MILP with PuLP,
    greedy without it)."""
    backend: str = "local"
    """Where jobs run: local (worker processes on this machine) or ray (one Ray actor per slot; the ray extra)."""
    ray_address: str = ""
    """backend = ray: the cluster to join (ray.init(address=...)); "" = start a local Ray instance."""
    slots: int = 1
    """Jobs that run at once (each a worker process); at most the CPU cores for CPU jobs."""
    devices: list[str] = field(default_factory=list)
    """The device of each slot, e.g. ["cuda:0", "cuda:1"] (then sweep.slots is their number); [] = sweep.slots
    slots on train.device of the base config."""
    device_memory: str = ""
    """sharded-lrtf: bytes each device may hold for the jobs on it together, e.g. "40GB": a job that waits keeps
    its device memory while the waiting jobs' bytes and the device's running and staged jobs at
    sweep.device_budget fit, and gives it back otherwise; "" = a GPU's memory, no limit on the CPU (whose
    "device" tier is RAM: a give-back there only copies). It must hold (slots on the device + 1) × the budget."""
    device_budget: str = ""
    """Device memory per slot, e.g. "2GB" (GPU memory; RAM on a CPU-only machine): a job whose training state plus
    one micro-batch's activations (from its profile) exceed it runs under the offload engine with this device
    budget, its state spilled to host and disk between uses; "" = no limit."""
    threads_per_job: int = 0
    """Torch CPU threads of each job's process; 0 = CPU cores // slots (at least 1), so jobs do not fight over
    cores."""
    retries: int = 1
    """How often a failed job (NaN loss, dead worker) is run again from its last checkpoint before it is marked
    failed for good."""
    time_budget_s: float = 0.0
    """Wall-clock seconds the sweep may run; then running jobs stop with a checkpoint (resumable by running the
    same command again) and no new job starts. 0 = no limit."""
    job_timeout_s: float = 0.0
    """Longest a single job attempt may run before it is killed and counted as failed; 0 = no limit."""
    stall_timeout_s: float = 3600.0
    """A worker whose job records no step for this many seconds of running (start-up included) is taken as hung:
    it is killed and the attempt counts as failed (retried from the checkpoint). 0 = never."""
    segment_steps: int = 0
    """Steps per segment: a job stops with a checkpoint every this many steps and its slot is given out again
    (lrtf needs it ≥ 1); 0 = a job runs to its end (or its next ASHA rung) once started."""
    slice_by: str = "checkpoint"
    """How a time slice (sweep.segment_steps) ends: checkpoint (the worker saves the job's state and exits; the
    next slice resumes from the checkpoint) or pause (the worker is stopped where it is, its state resident in
    host memory, and continued later: no checkpoint I/O, but every started job keeps its memory; local backend,
    CPU jobs)."""
    samples: int = 0
    """Random draws per grid point from [sweep.random]; 0 = 1 when [sweep.random] has keys, else none."""
    seed: int = 0
    """Seed of the random search (the jobs' own train.seed is a config key like any other)."""
    early_stop: str = ""
    """"" (off) or asha: stop the worst jobs at rungs by successive halving on the eval loss."""
    asha_min_steps: int = 0
    """asha: the first rung, in steps (must be a multiple of train.eval_interval); rungs are min_steps·eta^k
    below train.steps."""
    asha_eta: int = 3
    """asha: reduction factor; the best 1/eta of the jobs at a rung go on to the next."""
    shard_blocks: int = AUTO
    """sharded-lrtf: blocks per shard task (a task is their forward, or their backward, for one micro-batch);
    0 = per job, the most blocks whose parameters and gradients fit in half its device budget (Hydra's shard
    beside the next one's prefetch: stratum.sweep.shard_size)."""
    calibration: str = "off"
    """What the predicted times of lrtf, planned and sharded-lrtf go through beyond the profiles (docs/sweep.md):
    "off" (profiles, then each job's own measured steps); "auto" (measured on this machine for this sweep when it
    starts — sharded-lrtf: its own job shapes, a few steps each; tens of seconds — and kept in the sweep
    directory, so a resumed sweep reuses it); or a calibration file's path (relative to the sweep file), e.g. one
    an "auto" sweep wrote (calibration.json; sharded-lrtf: calibration.sharded.json)."""
    plan_time_limit_s: float = 10.0
    """planned: the MILP solver's time limit; past it the best plan found so far is used (greedy if none)."""
    plan_gap: float = 0.01
    """planned: the solver stops once its plan is proved within this share of the optimum (0 = prove it optimal,
    up to plan_time_limit_s): every re-plan waits on the solver, and a dozen jobs or more seldom prove optimal
    before the limit."""
    plans: list[str] = field(default_factory=list)
    """planned: the strategies a job may run as — "local" (one slot: the job's own config) and Plan trees over k
    slots at once, "replicate(k)" or "pipeline(k)" (k processes of threads_per_job threads, the same global
    batch); [] = local, and on the local backend with CPU slots also replicate(k) and pipeline(k) for
    k = 2..slots. With sweep.devices (of one kind) a job over k slots runs rank r on its r-th slot's device."""


@dataclass(kw_only=True)
class RandomKey:
    """One key of [sweep.random]: how its values are drawn."""

    kind: str
    """choice, uniform, log_uniform or int (inclusive bounds)."""
    values: list[Any]
    """The choices (kind = choice) or the two bounds."""


@dataclass(kw_only=True)
class SweepSpec:
    """A parsed sweep file."""

    path: Path
    """The sweep file."""
    settings: SweepSettings
    """The [sweep] table's scalar keys."""
    base_overrides: list[str]
    """This file's own training sections, as ``section.key=value`` overrides over sweep.base."""
    grid: dict[str, list[Any]]
    """[sweep.grid]: each key's values (lists and ranges expanded), in file order."""
    random: dict[str, RandomKey]
    """[sweep.random]: each key's distribution."""

    @property
    def calibration_path(self) -> Path | None:
        """The calibration file sweep.calibration names, resolved against the sweep file's directory; None for
        "off" and "auto"."""
        c = self.settings.calibration.strip()
        return None if c in CALIBRATIONS else (self.path.parent / c).expanduser()

    @property
    def base_path(self) -> Path | None:
        """The base training config file, resolved against the sweep file's directory."""
        b = self.settings.base.strip()
        return (self.path.parent / b) if b else None


def job_threads(s: SweepSettings) -> int:
    """Torch threads of each job: sweep.threads_per_job, or the cores shared out over the slots."""
    return s.threads_per_job or max(1, (os.cpu_count() or 1) // s.slots)


def toml_literal(value: Any) -> str:
    """A value as TOML, for ``section.key=value`` overrides (strings quoted, so '123' stays a string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (int, float)):
        return repr(value)
    raise StratumError(f"value {value!r} is not a string, number or boolean")


def load_sweep(path: str | os.PathLike) -> SweepSpec:
    """Read and check a sweep file (keys, types, ranges); the jobs' configs are checked by the expansion."""
    p = Path(path)
    if not p.is_file():
        raise StratumError(f"sweep file {p} does not exist")
    try:
        doc = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise StratumError(f"sweep file {p} is not valid TOML: {e or 'nested too deeply'}") from None
    except OSError as e:
        raise StratumError(f"sweep file {p} cannot be read ({e.strerror})") from None
    table = doc.pop("sweep", None)
    if not isinstance(table, dict):
        raise StratumError(f"{p} has no [sweep] table; add one with at least a [sweep.grid] or [sweep.random]")
    grid_doc = table.pop("grid", {})
    random_doc = table.pop("random", {})
    settings = _settings(table, p)
    _check_calibration(settings, p)
    grid = {k: _grid_values(k, v) for k, v in _flat_keys(grid_doc, "sweep.grid").items()}
    random = {k: _random_key(k, v) for k, v in _flat_keys(random_doc, "sweep.random").items()}
    if not grid and not random:
        raise StratumError(f"{p}: [sweep.grid] and [sweep.random] are both empty; give at least one key with "
                           "values, e.g. \"optim.lr\" = [1e-3, 3e-3]")
    n_jobs = math.prod(len(v) for v in grid.values()) * (settings.samples or (1 if random else 0) or 1)
    if n_jobs > MAX_JOBS:
        raise StratumError(f"{p}: the sweep has {n_jobs:,} jobs (grid × samples); at most {MAX_JOBS:,} — narrow "
                           "the grid or lower sweep.samples")
    both = set(grid) & set(random)
    if both:
        raise StratumError(f"{p}: {sorted(both)[0]} is in both [sweep.grid] and [sweep.random]; keep it in one")
    base_overrides = []
    for section, values in doc.items():
        if not isinstance(values, dict):
            raise StratumError(f"{p}: top-level key {section!r} must be a [section]; sections are: sweep, "
                               f"{', '.join(SECTIONS)}")
        base_overrides += [f"{section}.{k}={toml_literal(v)}" for k, v in values.items()]
    return SweepSpec(path=p, settings=settings, base_overrides=base_overrides, grid=grid, random=random)


def _settings(table: dict[str, Any], p: Path) -> SweepSettings:
    """The [sweep] table's scalar keys, typed and range-checked."""
    fields = {f.name: f for f in dataclasses.fields(SweepSettings)}
    s = SweepSettings()
    for key, value in table.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields) + ["grid", "random"], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise StratumError(f"{p}: unknown key sweep.{key}{hint}; see docs/sweep.md for the [sweep] keys")
        setattr(s, key, _typed(f"sweep.{key}", value, type(getattr(s, key))))
    _check_settings(s)
    return s


def _check_calibration(s: SweepSettings, p: Path) -> None:
    """sweep.calibration: "off", "auto" or a file that exists (what it holds is read when the sweep opens)."""
    c = s.calibration.strip()
    if not c:
        raise StratumError("sweep.calibration must be \"off\", \"auto\" or a calibration file's path; got \"\"")
    if c not in CALIBRATIONS and not (p.parent / c).expanduser().is_file():
        raise StratumError(f"sweep.calibration = {c!r}: no such file (relative to the sweep file's directory); "
                           "give a calibration file, \"auto\" (measure it) or \"off\"")


def _typed(key: str, value: Any, typ: type) -> Any:
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            example = {"sweep.devices": '["cuda:0", "cuda:1"]', "sweep.plans": '["local", "replicate(2)"]'}
            raise StratumError(f"{key} must be a list of strings"
                               + (f", e.g. {example[key]}" if key in example else ""))
        return value
    if isinstance(value, bool) != (typ is bool) or not isinstance(value, typ):
        what = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[typ]
        raise StratumError(f"{key} must be {what}, got {value!r}")
    return value


def _check_settings(s: SweepSettings) -> None:
    if s.scheduler not in SCHEDULERS:
        raise StratumError(f"sweep.scheduler = {s.scheduler!r} is not one of: {', '.join(SCHEDULERS)}")
    if s.backend not in BACKENDS:
        raise StratumError(f"sweep.backend = {s.backend!r} is not one of: {', '.join(BACKENDS)}")
    if s.early_stop not in EARLY_STOPS:
        raise StratumError(f"sweep.early_stop = {s.early_stop!r} is not \"\" (off) or \"asha\"")
    parse_budget(s.device_budget, "sweep.device_budget")
    if s.device_memory.strip():
        parse_bytes(s.device_memory, "sweep.device_memory")
    if s.device_budget.strip().endswith("%"):
        raise StratumError("sweep.device_budget must be a size, e.g. \"2GB\" (a percentage depends on the job)")
    if not s.out_dir.strip():
        raise StratumError("sweep.out_dir must not be empty")
    checks = [("slots", s.slots >= 1, "must be ≥ 1"), ("threads_per_job", s.threads_per_job >= 0, "must be ≥ 0"),
              ("retries", s.retries >= 0, "must be ≥ 0"), ("time_budget_s", s.time_budget_s >= 0, "must be ≥ 0"),
              ("job_timeout_s", s.job_timeout_s >= 0, "must be ≥ 0"),
              ("stall_timeout_s", s.stall_timeout_s >= 0, "must be ≥ 0 (0 = never)"),
              ("segment_steps", s.segment_steps >= 0, "must be ≥ 0"), ("samples", s.samples >= 0, "must be ≥ 0"),
              ("seed", s.seed >= 0, "must be ≥ 0"), ("asha_eta", s.asha_eta >= 2, "must be ≥ 2"),
              ("asha_min_steps", s.asha_min_steps >= 0, "must be ≥ 0"),
              ("plan_time_limit_s", s.plan_time_limit_s > 0, "must be > 0"),
              ("plan_gap", 0 <= s.plan_gap < 1, "must be in [0, 1)"),
              ("shard_blocks", s.shard_blocks >= 0, "must be ≥ 1, or 0 for what fits the device budget")]
    checks += [(f.name, math.isfinite(getattr(s, f.name)), "must be a finite number")
               for f in dataclasses.fields(s) if isinstance(getattr(s, f.name), float)]
    for key, ok, what in checks:
        if not ok:
            raise StratumError(f"sweep.{key} {what}")
    if s.slice_by not in SLICE_BY:
        raise StratumError(f"sweep.slice_by = {s.slice_by!r} is not one of: {', '.join(SLICE_BY)}")
    if s.slice_by == "pause" and s.backend != "local":
        raise StratumError("sweep.slice_by = \"pause\" stops local worker processes; use it with backend = "
                           "\"local\", or slice_by = \"checkpoint\"")
    if s.slice_by == "pause" and any(d.startswith("cuda") for d in s.devices):
        raise StratumError("sweep.slice_by = \"pause\" would leave paused jobs holding GPU memory; use slice_by "
                           "= \"checkpoint\" on GPUs")
    if s.scheduler == "lrtf" and s.segment_steps < 1:
        raise StratumError("sweep.scheduler = \"lrtf\" time-slices jobs: set sweep.segment_steps ≥ 1 (steps per "
                           "slice; each slice ends with a checkpoint)")
    if s.scheduler == "sharded-lrtf":
        _check_sharded(s)
    if s.early_stop == "asha" and s.asha_min_steps < 1:
        raise StratumError("sweep.early_stop = \"asha\" needs sweep.asha_min_steps ≥ 1 (the first rung, in steps)")
    if s.devices:
        s.slots = len(s.devices)
    _check_plans(s)
    # (what this machine lacks is said after what the file gets wrong)
    if s.backend == "ray" and importlib.util.find_spec("ray") is None:
        raise StratumError("sweep.backend = \"ray\" needs Ray: pip install 'stratum[ray]' (or use the local backend)")


SLOT_PLAN = re.compile(r"(replicate|pipeline)\((\d+)\)")
"""A strategy over several slots: replicate(k) or pipeline(k)."""


def plan_slots(text: str) -> int:
    """The slots a sweep.plans entry holds at once: 1 for local, k for replicate(k) or pipeline(k)."""
    m = SLOT_PLAN.fullmatch(text.replace(" ", ""))
    return int(m.group(2)) if m else 1


def _check_plans(s: SweepSettings) -> None:
    """sweep.plans: known strategies, read by the planned scheduler, several slots only where they can run."""
    if not s.plans:
        return
    if s.scheduler != "planned":
        raise StratumError("sweep.plans is read by scheduler = \"planned\" (the strategies it chooses between); "
                           "remove it or set scheduler = \"planned\"")
    for text in s.plans:
        if text != "local" and not SLOT_PLAN.fullmatch(text.replace(" ", "")):
            raise StratumError(f"sweep.plans: {text!r} is not \"local\", \"replicate(k)\" or \"pipeline(k)\"")
        k = plan_slots(text)
        if not 1 <= k <= s.slots or (text != "local" and k < 2):
            raise StratumError(f"sweep.plans: {text!r} holds {k} slots; it needs 2 ≤ k ≤ sweep.slots ({s.slots})")
    if any(plan_slots(t) > 1 for t in s.plans):
        _check_multi_slot(s)


def _check_multi_slot(s: SweepSettings) -> None:
    """A job over k slots is one `stratum train` run of k processes (local ones, or one on each slot's Ray actor):
    slots of one device kind, and slices that end with a checkpoint."""
    kinds = {"cpu" if d == "cpu" else "cuda" if d.startswith("cuda") else d for d in s.devices}
    if len(kinds) > 1:
        raise StratumError(f"sweep.plans: a job over several slots may get any of them, and sweep.devices mixes "
                           f"{' and '.join(sorted(kinds))}; give devices of one kind, or plans = [\"local\"]")
    if s.slice_by == "pause":
        raise StratumError("sweep.plans: a job over several slots cannot be paused (its ranks wait on each other "
                           "with time limits); use slice_by = \"checkpoint\"")


def _check_sharded(s: SweepSettings) -> None:
    """sharded-lrtf interleaves the jobs' shard tasks in one process (local, or one Ray actor), under the offload
    engine (with sweep.devices each job on one of them: docs/sweep.md)."""
    if not s.device_budget.strip():
        raise StratumError("sweep.scheduler = \"sharded-lrtf\" keeps each job's state on the host tier between "
                           "its shard tasks: set sweep.device_budget (per job on its slot), e.g. \"64MB\"")


def _flat_keys(doc: dict[str, Any], where: str) -> dict[str, Any]:
    """``{"optim.lr": v}`` and ``{"optim": {"lr": v}}`` (TOML's dotted keys) both become ``{"optim.lr": v}``;
    every key must name a config field."""
    out: dict[str, Any] = {}
    if not isinstance(doc, dict):  # `grid = [...]` or `random = 3` beside the other [sweep] keys
        raise StratumError(f"[{where}] must be a table of section.key = values, e.g. [{where}] then "
                           "\"optim.lr\" = [1e-3, 3e-3]")
    for k, v in doc.items():
        if "." in k:
            out[k] = v
        elif isinstance(v, dict) and k in SECTIONS:
            out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    for key in out:
        _check_key(key, where)
    return out


def _check_key(key: str, where: str) -> None:
    section, _, name = key.partition(".")
    known = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise StratumError(f"[{where}]: unknown key {key!r}{hint}; keys look like section.key — run `stratum "
                           "config` to list them")
    if key == "train.out_dir":
        raise StratumError(f"[{where}]: train.out_dir cannot be swept; each job's out_dir is "
                           "<sweep.out_dir>/jobs/<id>")


def _grid_values(key: str, spec: Any) -> list[Any]:
    """A grid key's values: a list, or a range {start, stop, step} (inclusive) or {start, stop, num, log}."""
    if isinstance(spec, list):
        if not spec:
            raise StratumError(f"[sweep.grid]: {key} has an empty list; give at least one value")
        twice = next((v for i, v in enumerate(spec) if v in spec[:i]), None)
        if twice is not None:  # (1e-3 and 0.001 are one value: the same job twice)
            raise StratumError(f"[sweep.grid]: {key} lists {twice!r} twice; give each value once")
        return spec
    if isinstance(spec, dict):
        return [float(f"{v:.12g}") if isinstance(v, float) else v for v in _range_values(key, spec)]
    raise StratumError(f"[sweep.grid]: {key} = {spec!r} is one value, not a list or a range; give [{spec!r}], or "
                       "set it in its section (it is then every job's)")


def _range_values(key: str, spec: dict[str, Any]) -> list[Any]:
    allowed = {"start", "stop", "step", "num", "log"}
    bad = set(spec) - allowed
    nums = [spec.get(k) for k in ("start", "stop")]
    if bad or None in nums or ("step" in spec) == ("num" in spec) \
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in nums):
        raise StratumError(f"[sweep.grid]: {key} = {spec!r} must be a list or a range {{start, stop, step}} or "
                           "{start, stop, num, log = true|false}")
    start, stop = nums
    assert isinstance(start, (int, float)) and isinstance(stop, (int, float))  # (checked above)
    if "step" in spec:
        step = spec["step"]
        if not isinstance(step, (int, float)) or step <= 0 or stop < start:
            raise StratumError(f"[sweep.grid]: {key}: step must be > 0 and stop ≥ start")
        span = (stop - start) / step
        _check_count(key, span + 1 if math.isfinite(span) else math.inf)
        n = int(span + 1e-9) + 1
        return [start + i * step for i in range(n)]
    num, log = spec["num"], spec.get("log", False)
    if not isinstance(num, int) or num < 1 or not isinstance(log, bool) or (log and min(start, stop) <= 0):
        raise StratumError(f"[sweep.grid]: {key}: num must be an integer ≥ 1, log true or false (and bounds > 0 "
                           "with log = true)")
    _check_count(key, num)
    if num == 1:
        return [float(start)]
    if log:
        ratio = (stop / start) ** (1 / (num - 1))
        return [start * ratio**i for i in range(num)]
    return [start + (stop - start) * i / (num - 1) for i in range(num)]


def _check_count(key: str, n: float) -> None:
    if n > MAX_JOBS:
        count = f"{int(n):,}" if math.isfinite(n) else "endless"
        raise StratumError(f"[sweep.grid]: {key} gives {count} values; a sweep has at most {MAX_JOBS:,} jobs — "
                           "check the range's step or num")


def _random_key(key: str, spec: Any) -> RandomKey:
    """A random key's distribution: a list (= choice) or {choice | uniform | log_uniform | int = [...]}."""
    if isinstance(spec, list):
        spec = {"choice": spec}
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in RANDOM_KINDS:
        raise StratumError(f"[sweep.random]: {key} = {spec!r} must be a list or one of "
                           f"{{{' | '.join(k + ' = [...]' for k in RANDOM_KINDS)}}}")
    kind, values = next(iter(spec.items()))
    if not isinstance(values, list) or not values:
        raise StratumError(f"[sweep.random]: {key}: {kind} needs a non-empty list")
    if kind != "choice":
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if len(values) != 2 or not numeric or values[0] > values[1] \
                or (kind == "int" and not all(isinstance(v, int) for v in values)) \
                or (kind == "log_uniform" and values[0] <= 0):
            raise StratumError(f"[sweep.random]: {key}: {kind} needs [low, high] with low ≤ high"
                               + (" (integers)" if kind == "int" else "") + (" and low > 0" if kind ==
                                                                               "log_uniform" else ""))
    return RandomKey(kind=kind, values=values)
