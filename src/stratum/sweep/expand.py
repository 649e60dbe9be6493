"""Grid × random expansion of a sweep into jobs, each an ordinary training config with its own out_dir.

Job ``i`` is the i-th grid point (keys in file order, the last one varying fastest) with, when
[sweep.random] has keys, ``sweep.samples`` draws from a generator seeded by ``sweep.seed`` — so the same file
always gives the same jobs, and a resumed sweep finds the jobs it had.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stratum.config import Config, load_config
from stratum.errors import StratumError
from stratum.sweep.spec import RandomKey, SweepSettings, SweepSpec, toml_literal
from stratum.units import fmt_bytes, parse_budget, parse_bytes


@dataclass(kw_only=True, frozen=True)
class Job:
    """One training run of the sweep."""

    id: str
    """Stable name, also its directory under jobs/: j000, j001, …"""
    index: int
    """Position in the sweep (fifo order)."""
    values: tuple[tuple[str, Any], ...]
    """The swept keys and this job's values, in file order."""

    @property
    def overrides(self) -> list[str]:
        """The job's values as ``section.key=value`` overrides (`stratum train --set` form)."""
        return [f"{k}={toml_literal(v)}" for k, v in self.values]

    @property
    def label(self) -> str:
        return " ".join(f"{k.partition('.')[2]}={_short(v)}" for k, v in self.values)


def _short(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def expand(spec: SweepSpec) -> list[Job]:
    """Every job of the sweep, in order."""
    grid_keys = list(spec.grid)
    points = list(itertools.product(*(spec.grid[k] for k in grid_keys))) if grid_keys else [()]
    samples = spec.settings.samples or (1 if spec.random else 0)
    rng = random.Random(spec.settings.seed)
    jobs: list[Job] = []
    for point in points:
        base = list(zip(grid_keys, point))
        draws = [base + [(k, _draw(rng, r)) for k, r in spec.random.items()] for _ in range(samples)] \
            if spec.random else [base]
        for values in draws:
            i = len(jobs)
            jobs.append(Job(id=f"j{i:03d}", index=i, values=tuple(values)))
    return jobs


def _draw(rng: random.Random, r: RandomKey) -> Any:
    if r.kind == "choice":
        return rng.choice(r.values)
    lo, hi = r.values
    if r.kind == "int":
        return rng.randint(lo, hi)
    if r.kind == "log_uniform":
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return rng.uniform(lo, hi)


def job_out_dir(sweep_dir: Path, job: Job) -> Path:
    """The job's run directory (its train.out_dir)."""
    return sweep_dir / "jobs" / job.id


def job_config(spec: SweepSpec, job: Job, sweep_dir: Path, extra: Sequence[str] = ()) -> Config:
    """The job's full training config: sweep.base ← the file's sections ← the job's values ← its out_dir ←
    ``extra`` (what the sweep decides for it, e.g. the offload engine under sweep.device_budget)."""
    out = f"train.out_dir={toml_literal(str(job_out_dir(sweep_dir, job)))}"
    try:
        return load_config(spec.base_path, spec.base_overrides + job.overrides + [out, *extra])
    except StratumError as e:
        raise StratumError(f"sweep job {job.id} ({job.label}): {e}") from None


def check_jobs(spec: SweepSpec, jobs: list[Job], sweep_dir: Path) -> list[Config]:
    """Every job's config, checked before any job starts; and the slots against the devices that exist."""
    if not jobs:
        raise StratumError(f"{spec.path}: the sweep has no jobs; give [sweep.grid] values or sweep.samples ≥ 1")
    configs = [job_config(spec, j, sweep_dir) for j in jobs]
    for cfg, job in zip(configs, jobs):
        if cfg.plan.world_size() > 1:
            raise StratumError(f"sweep job {job.id}: a job's own parallel.plan over several processes (plan "
                               f"{cfg.plan}) is not run by sweeps; leave it out and let scheduler = \"planned\" "
                               "run jobs as replicate(k) or pipeline(k) over k slots (sweep.plans)")
    if spec.settings.backend == "local":  # Ray places slots on its cluster's resources (or says it cannot)
        check_devices(spec, configs[0])
    return configs


def check_devices(spec: SweepSpec, cfg: Config) -> None:
    """More slots than this machine has devices (CPU cores, GPUs) is an error, not a slow surprise."""
    s = spec.settings
    devices = named_slot_devices(s, cfg)
    cores = os.cpu_count() or 1
    gpus = torch.cuda.device_count()
    cpu_slots = sum(1 for d in devices if d in ("cpu", "auto"))  # (an auto left names the CPU: no GPU here)
    if cpu_slots > cores:
        if s.devices:
            raise StratumError(f"sweep.devices names the CPU {cpu_slots} times but this machine has {cores} cores; "
                               f"name it at most {cores} times (one slot a core)")
        raise StratumError(f"sweep.slots = {s.slots} CPU slots but this machine has {cores} cores; "
                           f"set sweep.slots ≤ {cores}")
    for d in devices:
        if d.startswith("cuda"):
            n = int(d[5:]) + 1 if d.startswith("cuda:") and d[5:].isdigit() else 1
            if n > gpus:
                fix = f"name cuda:0 … cuda:{gpus - 1}" if gpus else "leave sweep.devices out (the slots are CPU cores)"
                raise StratumError(f"sweep device {d!r} does not exist: this machine has {gpus} CUDA device(s); "
                                   f"{fix}")
        elif d not in ("cpu", "auto"):
            raise StratumError(f"sweep device {d!r} is not cpu, auto, cuda or cuda:N")
    budget = parse_budget(s.device_budget, "sweep.device_budget") if s.device_budget.strip() else None
    if s.scheduler == "sharded-lrtf" and budget is not None:
        check_shared_memory(devices, budget, lambda d: device_capacity(d, s.device_memory))


def named_slot_devices(s: SweepSettings, cfg: Config) -> list[str]:
    """Each slot's device as sharded-lrtf's memory rule sees it (auto: a GPU where there is one)."""
    gpus = torch.cuda.device_count()
    return ["cuda" if d == "auto" and gpus else d for d in (s.devices or [cfg.train.device] * s.slots)]


def device_capacity(device: str, device_memory: str) -> int | None:
    """Bytes ``device`` may hold for sharded-lrtf's jobs together: ``sweep.device_memory``, else a GPU's memory;
    None (no limit) on the CPU, whose "device" tier is RAM: a waiting job's give-back there only copies."""
    if device_memory.strip():
        return parse_bytes(device_memory, "sweep.device_memory")
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return None


def check_shared_memory(devices: list[str], budget: int, capacity_of: Callable[[str], int | None]) -> None:
    """sharded-lrtf: a device of k slots holds its k running jobs' budgets and one staged job's (waiting jobs give
    theirs back where they must), so (k + 1) × ``budget`` must fit its capacity (``capacity_of``; None: no
    limit); one line saying what does not, else nothing."""
    for d in dict.fromkeys(devices):
        k, total = devices.count(d), capacity_of(d)
        if total is not None and (k + 1) * budget > total:
            raise StratumError(
                f"sweep.device_budget = {fmt_bytes(budget)} per job: {k} running job(s) on {d} and one staged need "
                f"{fmt_bytes((k + 1) * budget)}, but {d} may hold {fmt_bytes(total)} (sweep.device_memory, else a "
                f"GPU's memory); set sweep.device_budget ≤ {fmt_bytes(total // (k + 1))} or give {d} fewer slots")


def data_key(cfg: Config) -> str:
    """What tells configs of one [data] section (corpus, tokenizer, sequence length) from another's."""
    return json.dumps(cfg.to_dict()["data"], sort_keys=True)


def distinct_data(configs) -> list[Config]:
    """One config per distinct [data] section (each is prepared once, before the workers need it)."""
    seen, out = set(), []
    for cfg in configs:
        key = data_key(cfg)
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out
