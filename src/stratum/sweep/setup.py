"""A sweep, opened: its file parsed, its jobs expanded and checked (one-line errors before any job starts), its
state database created or reopened, and what the sweep decides for its jobs (the offload engine under
sweep.device_budget; the planned scheduler's strategies) recorded in their configs."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stratum.config import Config, shared_settings
from stratum.data.prepare import make_tokenizer, prepare_data
from stratum.errors import StratumError
from stratum.offload.planner import NoFit
from stratum.profile.profile import Profile
from stratum.runtime.device import resolve_device
from stratum.sweep.asha import Asha
from stratum.sweep.asha_state import asha_from_state
from stratum.sweep.expand import Job, check_jobs, data_key, distinct_data, expand, job_config
from stratum.sweep.gang_plan import Option
from stratum.sweep.job_strategy import apply_pins, job_candidates, job_toml, launch_costs, write_job_config
from stratum.sweep.predict import job_profiles, memory_need, offload_placement
from stratum.sweep.segment import Backend, Segment
from stratum.sweep.shape_cost import ShapeCalibration, shape_key
from stratum.sweep.shard_run import check_shardable
from stratum.sweep.spec import SweepSpec, job_threads, load_sweep
from stratum.sweep.state import SweepState, spec_fingerprint
from stratum.sweep.sweep_calibration import given_calibration
from stratum.train.fit import check_fits
from stratum.units import fmt_bytes, parse_budget


@dataclass(kw_only=True)
class Sweep:
    """A loaded, checked sweep and its state."""

    spec: SweepSpec
    """The parsed sweep file."""
    jobs: dict[str, Job]
    """Job id → job, in sweep order."""
    configs: dict[str, Config]
    """Job id → its training config."""
    dir: Path
    """The sweep directory."""
    state: SweepState
    """state.db."""
    say: Callable[[str], None]
    """Where progress lines go."""
    asha: Asha | None = None
    """The rung bookkeeping when sweep.early_stop = asha."""
    candidates: dict[str, dict[str, Option]] = field(default_factory=dict)
    """planned: job → the strategies it may run as, each Option's seconds a multiple of its local time."""
    launch_s: dict[int, float] = field(default_factory=dict)
    """planned: slots → the start-up a job over that many slots pays beyond a one-slot job, per segment."""
    running: dict[int, Segment] = field(default_factory=dict)
    """Slot → the segment running there (a job over k slots: the same segment on each)."""
    predicted_end: dict[int, float] = field(default_factory=dict)
    """Slot → the predicted end (seconds since the sweep started) of its segment (planned scheduler)."""
    resident: dict[str, Segment] = field(default_factory=dict)
    """Job → its paused worker (slice_by = pause): the job's state in that process's memory until it continues."""
    backend: Backend | None = None
    """Where segments run (set by :func:`stratum.sweep.runner.run_sweep`)."""
    calibration: ShapeCalibration | None = None
    """What the predictions go through beyond the profiles (sweep.calibration): the file it names, read when the
    sweep opens; "auto"'s, measured or read from the sweep directory when it runs; None = "off"."""
    makespan_s: float | None = None
    """Wall seconds of this invocation's scheduling loop, first segment start to last segment end, where it ran
    every job to its end (None: it did not run, or its time budget stopped it)."""


def open_sweep(path: str | os.PathLike, *, say: Callable[[str], None] = print) -> Sweep:
    """Parse, expand and check the sweep; create or reopen its state (one-line errors before any job starts)."""
    spec = load_sweep(path)
    given = given_calibration(spec)  # a bad file is an error before anything is written
    jobs = expand(spec)
    sweep_dir = Path(spec.settings.out_dir).expanduser()
    configs = check_jobs(spec, jobs, sweep_dir)
    if spec.settings.early_stop == "asha":
        _check_asha(spec, jobs, configs)
    for cfg in distinct_data(configs):
        prepare_data(cfg)  # corpus errors before anything is written; and the workers find the caches ready
    if spec.settings.scheduler == "sharded-lrtf":
        check_shardable({j.id: c for j, c in zip(jobs, configs)})  # before the sweep's state is written
    state = SweepState(sweep_dir)
    sweep = Sweep(spec=spec, jobs={j.id: j for j in jobs}, configs={j.id: c for j, c in zip(jobs, configs)},
                  dir=sweep_dir, state=state, say=say, calibration=given)
    if spec.settings.device_budget.strip():
        fit_to_budget(sweep)
    # a resumed sweep's jobs train as they did: their settings as the sweep decided them (an engine a changed
    # device_budget would switch included) are compared first, by job and key; then the jobs themselves
    settings = {job_id: shared_settings(c) for job_id, c in sweep.configs.items()}
    recorded_settings = state.meta("settings")
    _check_settings(recorded_settings, settings, sweep_dir)
    fingerprint = spec_fingerprint({j.id: j.overrides for j in jobs}, spec.base_overrides)
    recorded = state.meta("jobs")
    if recorded is not None and recorded != fingerprint:
        raise StratumError(f"sweep.out_dir {str(sweep_dir)!r} holds another sweep (its jobs differ from this "
                           "file's); choose a new sweep.out_dir, or restore the file that sweep was run with")
    if spec.settings.scheduler in ("fifo", "lrtf"):  # (sharded-lrtf streams a job; planned may spread it)
        _check_fits(sweep)
    if spec.settings.scheduler == "planned":
        sweep.candidates = job_candidates(spec, sweep.jobs, sweep.configs, sweep_profiles(sweep), sweep_dir)
        sweep.launch_s = launch_costs(sweep.candidates, next(iter(sweep.configs.values())).cache_dir / "hardware")
    # the jobs are recorded once every check passed: a refused file leaves no jobs, so a corrected one runs here
    if recorded is None:
        state.set_meta("jobs", fingerprint)
    if recorded_settings is None:  # (also a sweep recorded before its settings were)
        state.set_meta("settings", json.dumps(settings, sort_keys=True))
    state.add_jobs([(j.id, j.index, j.label, c.train.steps) for j, c in zip(jobs, configs)])
    if spec.settings.early_stop == "asha":
        sweep.asha = asha_from_state(state, min_steps=spec.settings.asha_min_steps, eta=spec.settings.asha_eta)
    if spec.settings.scheduler == "planned":
        apply_pins(spec, sweep.jobs, sweep.configs, state, sweep_dir)
    return sweep


def _check_settings(text: str | None, settings: dict[str, dict[str, str]], sweep_dir: Path) -> None:
    """A resumed sweep's jobs must train as they did: every setting but a machine's own (config.LOCAL_SETTINGS) as
    recorded (``text``, None for a new sweep) — a changed base file changes every job without changing the sweep
    file, a changed sweep.device_budget a job's engine. Keys one side lacks (a setting added by a newer Stratum)
    are not compared."""
    if text is None:
        return
    was = json.loads(text)
    for job, now in settings.items():
        before = was.get(job, {})
        for key in sorted(now.keys() & before.keys()):
            if now[key] != before[key]:
                raise StratumError(f"sweep.out_dir {str(sweep_dir)!r} holds this sweep run with other settings: job "
                                   f"{job}'s {key} was {before[key]}, is now {now[key]} (the sweep file or its "
                                   "sweep.base file changed); restore it, or choose a new sweep.out_dir")


def _check_fits(sweep: Sweep) -> None:
    """A job whose training state cannot fit its device (RAM on a CPU) is refused before any job starts, as
    `stratum train` refuses it, rather than failing each of its attempts. The tokenizer is read once per distinct
    [data] section (a BPE is a file to load)."""
    vocab = {data_key(c): make_tokenizer(c).vocab_size for c in distinct_data(sweep.configs.values())}
    for job_id, cfg in sweep.configs.items():
        try:
            check_fits(cfg, resolve_device(cfg.train.device), tokenizer_vocab=vocab[data_key(cfg)])
        except StratumError as e:
            raise StratumError(f"sweep job {job_id} ({sweep.jobs[job_id].label}): {e}") from None


def fit_to_budget(sweep: Sweep) -> None:
    """Jobs that would not fit a slot's sweep.device_budget under the plain engine run under the offload engine
    with that budget (their state on the host and disk tiers between uses); jobs with their own engine or plan
    are left as they are (the trainer checks those against their own budgets). Under sharded-lrtf every job runs
    under the offload engine (its shard tasks are the engine's blocks), its AdamW state on the host unless its
    config says where: a waiting job gives its device memory back, and the optimizer's state on the device would
    stay there."""
    budget = parse_budget(sweep.spec.settings.device_budget, "sweep.device_budget")
    if budget is None:  # "auto": no budget to fit
        return
    profiles = sweep_profiles(sweep)
    every = sweep.spec.settings.scheduler == "sharded-lrtf"
    planned: set[str] = set()
    refused: list[tuple[int, str, StratumError]] = []
    for job_id, cfg in list(sweep.configs.items()):
        need = memory_need(profiles[job_id])
        if (need <= budget and not every) or cfg.train.engine != "plain" or cfg.parallel.plan.strip():
            continue
        text = sweep.spec.settings.device_budget.strip()
        sets = ["train.engine='offload'", f"offload.device_budget={text!r}"]
        if every and cfg.offload.optimizer_tier == "auto":
            sets.append("offload.optimizer_tier='host'")  # (what a waiting job's engine cannot give back)
        sweep.configs[job_id] = job_config(sweep.spec, sweep.jobs[job_id], sweep.dir, sets)
        try:
            _check_placement(job_id, sweep.configs[job_id], profiles[job_id], planned)
        except NoFit as no_fit:  # every job is checked: the error names the budget that fits them all
            refused.append((no_fit.smallest_device or 0, job_id, no_fit))
            continue
        sweep.say(f"{job_id}: needs {fmt_bytes(need)} on its device, "
                  + (f"over sweep.device_budget = {text}: it runs" if need > budget else "runs as shard tasks")
                  + " under the offload engine")


    if refused:
        _, worst, error = max(refused, key=lambda r: r[0])
        others = f" (and {len(refused) - 1} more job(s) needing less)" if len(refused) > 1 else ""
        raise StratumError(f"sweep job {worst}{others} under sweep.device_budget: {error}")


def _check_placement(job_id: str, cfg: Config, profile: Profile, planned: set[str]) -> None:
    """The offload engine places ``cfg``'s job at its budget (once per distinct model, batch and offload setting in
    ``planned``), else a one-line error naming the job and the smallest budget that works — before any job starts,
    rather than every job of that shape failing when it does."""
    key = shape_key(cfg) + json.dumps(cfg.to_dict()["offload"], sort_keys=True)
    if key in planned:
        return
    try:
        offload_placement(cfg, profile)
    except NoFit:
        raise
    except StratumError as e:
        raise StratumError(f"sweep job {job_id} under sweep.device_budget: {e}") from None
    planned.add(key)


def _check_asha(spec: SweepSpec, jobs: list[Job], configs: list[Config]) -> None:
    s = spec.settings
    for job, cfg in zip(jobs, configs):
        if s.asha_min_steps >= cfg.train.steps:
            raise StratumError(f"sweep job {job.id}: sweep.asha_min_steps ({s.asha_min_steps}) is not below its "
                               f"train.steps ({cfg.train.steps}), so asha has no rung to stop it at; set "
                               "asha_min_steps below train.steps (the first rung), or early_stop = \"off\"")
        ev = cfg.train.eval_interval
        if ev == 0 or s.asha_min_steps % ev:
            raise StratumError(f"sweep job {job.id}: asha compares eval losses at rungs, so train.eval_interval "
                               f"({ev}) must divide sweep.asha_min_steps ({s.asha_min_steps}); e.g. set "
                               f"train.eval_interval = {s.asha_min_steps}")


def slot_devices(sweep: Sweep, slots: tuple[int, ...]) -> tuple[str, ...] | None:
    """The devices of a job's slots, in rank order; None = the job's own train.device."""
    devices = sweep.spec.settings.devices
    return tuple(devices[s] for s in slots) if devices else None


def sweep_profiles(sweep: Sweep) -> dict[str, Profile]:
    """The sweep's job profiles, cached in <sweep dir>/profiles/."""
    return job_profiles(sweep.configs, threads=job_threads(sweep.spec.settings),
                        cache_dir=sweep.dir / "profiles")


def write_job_configs(sweep: Sweep) -> None:
    """jobs/<id>/job.toml of every job."""
    for job_id, cfg in sweep.configs.items():
        write_job_config(job_toml(sweep.dir, sweep.jobs[job_id]), cfg)
