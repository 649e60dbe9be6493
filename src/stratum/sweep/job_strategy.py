"""A job's strategy under the planned scheduler: the strategies it may run as (``local`` on one slot, or a Plan
tree over k slots), priced relative to its local time; the one it started with, kept in state.db so every later
segment, retry and resumed sweep runs it the same way (its checkpoints are that run's); and its config under it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from stratum.atomic import atomic_write_text
from stratum.config import Config, to_toml
from stratum.errors import StratumError
from stratum.ir.hardware import Hardware
from stratum.plan.search_cli import machine_hardware
from stratum.profile.profile import Profile
from stratum.sweep.expand import Job, job_config, job_out_dir
from stratum.sweep.gang_plan import Option
from stratum.sweep.launch_cost import launch_seconds
from stratum.sweep.segment import segment_records
from stratum.sweep.spec import SweepSpec, job_threads, plan_slots
from stratum.sweep.state import SweepState
from stratum.sweep.strategies import plan_overrides, relative_options, scaled, sweep_plans

_KEY = "strategy:"
"""state.db meta key prefix: strategy:<job id> → the strategy it started with."""


def job_candidates(spec: SweepSpec, jobs: dict[str, Job], configs: dict[str, Config],
                   profiles: dict[str, Profile], sweep_dir: Path) -> dict[str, dict[str, Option]]:
    """Job → its strategies, each Option's seconds a multiple of its local time; a one-line error for a job that
    can run as none of sweep.plans. Plans over several slots are offered to plain jobs whose config they can run
    (others keep their own engine or plan on one slot) and priced on this machine's slots, measured once
    (``stratum hardware probe``, cached). Beside local, a plan over k slots is offered only where it can be
    faster (at least k micro-batches per step, a shorter predicted step)."""
    plans = sweep_plans(spec.settings)
    wanted: dict[str, list[str]] = {}
    for job_id, cfg in configs.items():
        own = cfg.train.engine != "plain" or bool(cfg.parallel.plan.strip())
        wanted[job_id] = ["local"] if own else [p for p in plans if _runs_as(spec, jobs[job_id], cfg, p, sweep_dir)]
        if "local" in wanted[job_id]:  # a plan over k slots with fewer than k micro-batches runs no faster
            wanted[job_id] = [p for p in wanted[job_id] if cfg.micro_batches_per_step >= plan_slots(p)]
    hw: Hardware | None = None
    if any(p != "local" for ps in wanted.values() for p in ps):
        hw = machine_hardware(next(iter(configs.values())), spec.settings.slots)
    out = {}
    for job_id, cfg in configs.items():
        out[job_id] = relative_options(profiles[job_id], cfg, wanted[job_id], hw)
        if not out[job_id]:
            raise StratumError(f"sweep job {job_id} ({jobs[job_id].label}) can run as none of sweep.plans "
                               f"{plans}: add \"local\", or give it micro-batches (train.grad_accum) the "
                               "replicas can share")
    return out


def _runs_as(spec: SweepSpec, job: Job, cfg: Config, plan: str, sweep_dir: Path) -> bool:
    """The job's config under ``plan`` is valid (micro-batches over the replicas, the plan's own checks)."""
    try:
        strategy_config(spec, job, cfg, plan, sweep_dir)
    except StratumError:
        return False
    return True


def strategy_config(spec: SweepSpec, job: Job, cfg: Config, plan: str, sweep_dir: Path) -> Config:
    """The job's config (``cfg``) run as ``plan``: the same global batch, sweep.threads_per_job per process."""
    if plan == "local":
        return cfg
    return job_config(spec, job, sweep_dir, plan_overrides(plan, cfg, job_threads(spec.settings)))


def pinned(state: SweepState, job_id: str) -> str | None:
    """The strategy the job started with, None before it started."""
    return state.meta(_KEY + job_id)


def pin(state: SweepState, job_id: str, plan: str) -> None:
    state.set_meta(_KEY + job_id, plan)


def write_job_config(path: Path, cfg: Config) -> None:
    """jobs/<id>/job.toml: what a worker loads, and what a person runs to repeat the job alone."""
    text = to_toml(cfg)
    if not path.exists() or path.read_text() != text:
        atomic_write_text(path, text)


def apply_pins(spec: SweepSpec, jobs: dict[str, Job], configs: dict[str, Config], state: SweepState,
               sweep_dir: Path) -> None:
    """Jobs that started over several slots go on as they started (``configs`` updated in place)."""
    for job_id, cfg in list(configs.items()):
        plan = pinned(state, job_id)
        if plan is not None and plan != "local":
            configs[job_id] = strategy_config(spec, jobs[job_id], cfg, plan, sweep_dir)


def launch_costs(candidates: dict[str, dict[str, Option]], cache_dir: Path) -> dict[int, float]:
    """Slots → the start-up a job over that many slots pays beyond a one-slot job (measured once, cached)."""
    sizes = {o.devices for opts in candidates.values() for o in opts.values() if o.devices > 1}
    return {k: launch_seconds(k, cache_dir) for k in sorted(sizes)}


def options_of(candidates: dict[str, dict[str, Option]], state: SweepState, configs: dict[str, Config],
               predict: Callable[[str], dict[str, float]], share: Callable[[str], float],
               launch_s: dict[int, float], segment_steps: int) -> Callable[[str], dict[str, Option]]:
    """Job → its strategies in seconds for what remains of it: its predicted local time times each one's ratio
    (over several slots, of its time alone: ``share``), plus, over several slots, the start-up of each segment
    left (``launch_s``); a started job only its own strategy (once it has run over several slots, its measured
    time is that strategy's, taken as it is)."""
    def options(job_id: str) -> dict[str, Option]:
        remaining = min(predict(job_id).values())
        plan = pinned(state, job_id)
        opts = candidates[job_id]
        if plan is None:
            out = scaled(opts, remaining, share(job_id))
        elif plan not in opts:  # sweep.plans changed since it started: it goes on as it started
            out = {plan: Option(seconds=remaining, devices=plan_slots(plan))}
        elif plan != "local" and len(segment_records(configs[job_id])) > 1:
            out = {plan: Option(seconds=remaining, devices=opts[plan].devices)}
        else:
            out = scaled({plan: opts[plan]}, remaining, share(job_id))
        row = state.job(job_id)
        segments = -(-(row.steps - row.step) // segment_steps) if segment_steps else 1
        return {n: replace(o, seconds=o.seconds + segments * launch_s.get(o.devices, 0.0)) for n, o in out.items()}
    return options


def job_toml(sweep_dir: Path, job: Job) -> Path:
    return job_out_dir(sweep_dir, job) / "job.toml"
