"""Run a sweep: expand it, record it, and keep every slot busy with job segments until all jobs are final.

The loop polls the workers (every ``POLL_S``), records each segment's outcome in the state database, and gives
each free slot the next task: an ASHA promotion first, else the scheduler's pick among the pending jobs. A
failed segment (non-zero exit, dead worker, non-finite loss, over ``sweep.job_timeout_s``, no step for
``sweep.stall_timeout_s``) is retried from the job's checkpoint up to ``sweep.retries`` times; the other jobs go
on regardless.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stratum.atomic import atomic_write_bytes, atomic_write_text
from stratum.config import Config, to_toml
from stratum.data.prepare import prepare_data
from stratum.errors import StratumError
from stratum.procs import pid_alive
from stratum.profile.profile import Profile
from stratum.sweep.asha import Asha
from stratum.sweep.expand import Job, check_jobs, distinct_data, expand, job_config, job_out_dir
from stratum.sweep.live import last_record
from stratum.sweep.local import LocalBackend, LocalWorker
from stratum.sweep.plot import loss_png
from stratum.sweep.predict import job_profiles, make_predict, memory_need
from stratum.sweep.ray_backend import RayBackend
from stratum.sweep.results import results_csv, table
from stratum.sweep.schedulers import Policy, make_policy
from stratum.sweep.segment import (
    INTERRUPTED_EXIT,
    Backend,
    Segment,
    await_stop,
    checkpoint_step,
    diverged,
    failure_reason,
    segment_records,
    stop_segment,
)
from stratum.sweep.shard_run import check_shardable, run_sharded
from stratum.sweep.spec import SweepSpec, job_threads, load_sweep
from stratum.sweep.state import DONE, FAILED, PAUSED, PENDING, RUNNING, STOPPED, JobRow, SweepState, spec_fingerprint
from stratum.units import fmt_bytes, parse_budget

POLL_S = 0.2
STOP_GRACE_S = 60.0


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
    running: dict[int, Segment] = field(default_factory=dict)
    """Slot → the segment running there."""
    predicted_end: dict[int, float] = field(default_factory=dict)
    """Slot → the predicted end (seconds since the sweep started) of its segment (planned scheduler)."""
    resident: dict[str, Segment] = field(default_factory=dict)
    """Job → its paused worker (slice_by = pause): the job's state in that process's memory until it continues."""
    backend: Backend | None = None
    """Where segments run (set by :func:`run_sweep`)."""
    makespan_s: float = 0.0
    """Wall seconds of this invocation's scheduling loop: first segment start to last segment end."""


def open_sweep(path: str | os.PathLike, *, say: Callable[[str], None] = print) -> Sweep:
    """Parse, expand and check the sweep; create or reopen its state (one-line errors before any job starts)."""
    spec = load_sweep(path)
    jobs = expand(spec)
    sweep_dir = Path(spec.settings.out_dir).expanduser()
    configs = check_jobs(spec, jobs, sweep_dir)
    if spec.settings.early_stop == "asha":
        _check_asha(spec, jobs, configs)
    for cfg in distinct_data(configs):
        prepare_data(cfg)  # corpus errors before anything is written; and the workers find the caches ready
    state = SweepState(sweep_dir)
    fingerprint = spec_fingerprint({j.id: j.overrides for j in jobs}, spec.base_overrides)
    recorded = state.meta("jobs")
    if recorded is not None and recorded != fingerprint:
        raise StratumError(f"sweep.out_dir {str(sweep_dir)!r} holds another sweep (its jobs differ from this "
                           "file's); choose a new sweep.out_dir, or restore the file that sweep was run with")
    if recorded is None:
        state.set_meta("jobs", fingerprint)
    state.add_jobs([(j.id, j.index, j.label, c.train.steps) for j, c in zip(jobs, configs)])
    sweep = Sweep(spec=spec, jobs={j.id: j for j in jobs}, configs={j.id: c for j, c in zip(jobs, configs)},
                  dir=sweep_dir, state=state, say=say)
    if spec.settings.early_stop == "asha":
        sweep.asha = _asha_from_state(spec, state)
    if spec.settings.scheduler == "sharded-lrtf":
        check_shardable(sweep.configs)
    if spec.settings.device_budget.strip():
        fit_to_budget(sweep)
    return sweep


def fit_to_budget(sweep: Sweep) -> None:
    """Jobs that would not fit a slot's sweep.device_budget under the plain engine run under the offload engine
    with that budget (their state on the host and disk tiers between uses); jobs with their own engine or plan
    are left as they are (the trainer checks those against their own budgets). Under sharded-lrtf every job runs
    under the offload engine (its shard tasks are the engine's blocks)."""
    budget = parse_budget(sweep.spec.settings.device_budget, "sweep.device_budget")
    if budget is None:  # "auto": no budget to fit
        return
    profiles = sweep_profiles(sweep)
    every = sweep.spec.settings.scheduler == "sharded-lrtf"
    for job_id, cfg in list(sweep.configs.items()):
        need = memory_need(profiles[job_id])
        if (need <= budget and not every) or cfg.train.engine != "plain" or cfg.parallel.plan.strip():
            continue
        text = sweep.spec.settings.device_budget.strip()
        sweep.configs[job_id] = job_config(sweep.spec, sweep.jobs[job_id], sweep.dir, [
            "train.engine='offload'", f"offload.device_budget={text!r}"])
        sweep.say(f"{job_id}: needs {fmt_bytes(need)} on its device, "
                  + (f"over sweep.device_budget = {text}: it runs" if need > budget else "runs as shard tasks")
                  + " under the offload engine")


def _check_asha(spec: SweepSpec, jobs: list[Job], configs: list[Config]) -> None:
    s = spec.settings
    for job, cfg in zip(jobs, configs):
        ev = cfg.train.eval_interval
        if ev == 0 or s.asha_min_steps % ev:
            raise StratumError(f"sweep job {job.id}: asha compares eval losses at rungs, so train.eval_interval "
                               f"({ev}) must divide sweep.asha_min_steps ({s.asha_min_steps}); e.g. set "
                               f"train.eval_interval = {s.asha_min_steps}")


def _asha_from_state(spec: SweepSpec, state: SweepState) -> Asha:
    """The rung results recorded so far; a job that reported at a rung and is no longer paused (or stopped)
    there was promoted from it."""
    asha = Asha(min_steps=spec.settings.asha_min_steps, eta=spec.settings.asha_eta)
    status = {j.id: (j.status, j.step) for j in state.jobs()}
    for job, step, metric in state.rungs():
        asha.report(job, step, metric)
        st, at = status[job]
        if not (st in (PAUSED, STOPPED) and at == step):
            asha.promote(job, step)
    return asha


def slot_device(sweep: Sweep, slot: int) -> str | None:
    """The device a slot's jobs run on; None = the job's own train.device."""
    devices = sweep.spec.settings.devices
    return devices[slot] if devices else None


# ---- the loop ---------------------------------------------------------------------------------------------
def run_sweep(path: str | os.PathLike, *, say: Callable[[str], None] = print,
              tick: Callable[[Sweep], None] | None = None, retry_failed: bool = False) -> Sweep:
    """Run (or resume) the sweep in ``path`` to the end (or its time budget); returns the finished Sweep.
    ``tick`` is called at every poll (a live display); ``retry_failed`` gives failed jobs their retries again."""
    sweep = open_sweep(path, say=say)
    lock = _lock(sweep.dir)
    try:
        if retry_failed:
            for job_id in sweep.state.reset_failed():
                say(f"{job_id}: failed before; it runs again from its last checkpoint (--retry-failed)")
        sweep.backend = make_backend(sweep)
        interrupted = sweep.state.requeue_interrupted()
        for job_id in interrupted:
            say(f"{job_id}: was running when the sweep stopped; it resumes from its last checkpoint")
        _wait_gone(interrupted)
        _write_job_configs(sweep)
        sweep.backend.warm_up()  # workers import torch while the planner profiles
        s = sweep.spec.settings
        needs_predictions = s.scheduler in ("lrtf", "sharded-lrtf", "planned")
        predict = make_predict(sweep.state, sweep.configs, sweep_profiles(sweep)) if needs_predictions else None
        t0 = time.monotonic()
        if s.scheduler == "sharded-lrtf":
            assert predict is not None  # (sharded-lrtf needs predictions)
            run_sharded(state=sweep.state, configs=sweep.configs, profiles=sweep_profiles(sweep), predict=predict,
                        sweep_dir=sweep.dir, slots=s.slots, threads=job_threads(s), shard_blocks=s.shard_blocks,
                        retries=s.retries, time_budget_s=s.time_budget_s, say=say,
                        tick=(lambda: tick(sweep)) if tick is not None else None)
        else:
            policy = make_policy(s.scheduler, predict=predict, slots=s.slots, time_limit_s=s.plan_time_limit_s)
            _loop(sweep, policy, predict, tick)
        sweep.makespan_s = time.monotonic() - t0
        write_results(sweep.dir, sweep.state.jobs(), say=say)
    finally:
        if sweep.backend is not None:
            sweep.backend.close()
        lock.close()
    return sweep


def sweep_profiles(sweep: Sweep) -> dict[str, Profile]:
    """The sweep's job profiles, cached in <sweep dir>/profiles/."""
    return job_profiles(sweep.configs, threads=job_threads(sweep.spec.settings),
                        cache_dir=sweep.dir / "profiles")


def make_backend(sweep: Sweep) -> Backend:
    """The backend sweep.backend names: local worker processes, or Ray actors (GPU slots ask for a GPU)."""
    s = sweep.spec.settings
    if s.backend == "ray":
        gpu_slots = {i for i in range(s.slots) if (slot_device(sweep, i) or "").startswith("cuda")}
        return RayBackend(address=s.ray_address, slots=s.slots, threads=job_threads(s), gpu_slots=gpu_slots)
    return LocalBackend()


def _lock(sweep_dir: Path):
    """Hold an exclusive lock on the sweep directory: two sweeps must not run the same jobs."""
    fh = open(sweep_dir / ".lock", "w")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        raise StratumError(f"another sweep is running in {sweep_dir}; wait for it, or use "
                           "`stratum sweep status DIR` to watch it") from None
    return fh


def _wait_gone(pids: dict[str, int | None], timeout_s: float = 30.0) -> None:
    """The workers of a killed sweep die with it (PR_SET_PDEATHSIG) but may take a moment; a job must not be
    started while its old worker still writes to its directory."""
    deadline = time.monotonic() + timeout_s
    for job_id, pid in pids.items():
        while pid is not None and pid_alive(pid):
            if time.monotonic() > deadline:
                raise StratumError(f"{job_id}: the worker of the stopped sweep (pid {pid}) is still running; stop "
                                   "it, then run the same command again")
            time.sleep(0.1)


def _write_job_configs(sweep: Sweep) -> None:
    """jobs/<id>/job.toml: what a worker loads, and what a person runs to repeat the job alone."""
    for job_id, cfg in sweep.configs.items():
        path = job_out_dir(sweep.dir, sweep.jobs[job_id]) / "job.toml"
        text = to_toml(cfg)
        if not path.exists() or path.read_text() != text:
            atomic_write_text(path, text)


def _loop(sweep: Sweep, policy: Policy, predict: Callable[[str], dict[str, float]] | None,
          tick: Callable[[Sweep], None] | None) -> None:
    """Poll, record, refill, until no job can run (or the time budget is spent)."""
    s = sweep.spec.settings
    t0 = time.monotonic()
    try:
        while True:
            _harvest(sweep)
            if s.time_budget_s and time.monotonic() - t0 > s.time_budget_s:
                sweep.say(f"time budget of {s.time_budget_s:g} s spent: stopping the running jobs with a "
                          "checkpoint; run the same command to go on")
                _stop_all(sweep)
                return
            for slot in range(s.slots):
                if slot not in sweep.running:
                    _fill(sweep, slot, policy, predict, time.monotonic() - t0)
            if not sweep.running:
                if _pending(sweep):
                    raise RuntimeError("pending jobs but the scheduler started none with every slot free")
                _stop_paused(sweep)
                return
            if tick is not None:
                tick(sweep)
            time.sleep(POLL_S)
    except BaseException:  # Ctrl-C or an error: the workers stop with a checkpoint and their jobs stay resumable
        _stop_all(sweep)
        raise


def _pending(sweep: Sweep) -> list[str]:
    return [j.id for j in sweep.state.jobs() if j.status == PENDING]


def _fill(sweep: Sweep, slot: int, policy: Policy, predict, now: float) -> None:
    """Start the next task on a free slot: an ASHA promotion, else the scheduler's pick."""
    task = None
    if sweep.asha is not None and (promo := sweep.asha.promotable()) is not None:
        job_id, rung = promo
        sweep.asha.promote(job_id, rung)
        sweep.say(f"{job_id}: promoted at step {rung} (among the best 1/{sweep.asha.eta} there)")
        task = job_id
    if task is None:
        running = {sl: (seg.job, sweep.predicted_end.get(sl, now)) for sl, seg in sweep.running.items()}
        task = policy.pick(slot, _pending(sweep), running, now)
    if task is None:
        return
    if task in sweep.resident:
        _continue(sweep, task, slot, predict, now)
        return
    row = sweep.state.job(task)
    cfg = sweep.configs[task]
    out = Path(cfg.train.out_dir)
    start = checkpoint_step(out)
    stop_at = _stop_at(sweep, start, row.steps)
    assert sweep.backend is not None  # (run_sweep starts one before it schedules)
    seg = sweep.backend.start(job=task, slot=slot, config_path=out / "job.toml", start_step=start, stop_at=stop_at,
                              device=slot_device(sweep, slot), threads=job_threads(sweep.spec.settings),
                              log_path=out / "worker.log")
    sweep.running[slot] = seg
    if predict is not None:
        sweep.predicted_end[slot] = now + min(predict(task).values())
    sweep.state.update(task, status=RUNNING, slot=slot, pid=seg.worker.pid)
    seg.slice_from = start
    sweep.say(f"{task}: started on slot {slot} ({sweep.jobs[task].label}), steps {start} → {stop_at}"
              + (f", attempt {row.attempts + 1}" if row.attempts else ""))


def _continue(sweep: Sweep, job: str, slot: int, predict, now: float) -> None:
    """Continue a paused worker on ``slot`` (slice_by = pause): its state never left its memory."""
    seg = sweep.resident.pop(job)
    seg.slot = slot
    seg.slice_from = _current_step(sweep, seg)
    assert seg.paused_at is not None  # (set by _pause)
    seg.paused_s += time.monotonic() - seg.paused_at
    seg.paused_at = None
    _paused_worker(seg).resume()
    sweep.running[slot] = seg
    if predict is not None:
        sweep.predicted_end[slot] = now + min(predict(job).values())
    sweep.state.update(job, status=RUNNING, slot=slot)
    sweep.say(f"{job}: continued on slot {slot} at step {seg.slice_from}")


def _current_step(sweep: Sweep, seg: Segment) -> int:
    rec = last_record(Path(sweep.configs[seg.job].train.out_dir) / "metrics.jsonl")
    return rec["step"] if rec is not None else seg.start_step


def _stop_at(sweep: Sweep, step: int, steps: int) -> int:
    """Where a job's next segment ends: its end, its next ASHA rung or (slice_by = checkpoint) the end of a time
    slice, whichever first."""
    s = sweep.spec.settings
    stop = sweep.asha.next_stop(step, steps) if sweep.asha is not None else steps
    seg = s.segment_steps if s.slice_by == "checkpoint" else 0
    return min(stop, step + seg) if seg else stop


def _slice_over(sweep: Sweep, seg: Segment) -> bool:
    """slice_by = pause: the segment has run its slice and another job waits for a slot."""
    s = sweep.spec.settings
    if s.slice_by != "pause" or not s.segment_steps:
        return False
    if _current_step(sweep, seg) < seg.slice_from + s.segment_steps:
        return False
    return any(j != seg.job for j in _pending(sweep)) or (sweep.asha is not None
                                                          and sweep.asha.promotable() is not None)


def _paused_worker(seg: Segment) -> LocalWorker:
    """``seg``'s worker, which slice_by = pause stops and continues: a local process (spec.py refuses pause on
    another backend)."""
    assert isinstance(seg.worker, LocalWorker)
    return seg.worker


def _pause(sweep: Sweep, slot: int, seg: Segment) -> None:
    _paused_worker(seg).pause()
    seg.paused_at = time.monotonic()
    del sweep.running[slot]
    sweep.predicted_end.pop(slot, None)
    sweep.resident[seg.job] = seg
    step = _current_step(sweep, seg)
    sweep.state.update(seg.job, status=PENDING, step=step)
    sweep.say(f"{seg.job}: paused at step {step}, its state kept in its worker's memory")


def _harvest(sweep: Sweep) -> None:
    """Record every segment that ended, ran past sweep.job_timeout_s or stalled; pause those whose slice is
    over."""
    for slot, seg in list(sweep.running.items()):
        rc = seg.poll()
        if rc is None and _slice_over(sweep, seg):
            _pause(sweep, slot, seg)
            continue
        reason = _overdue(sweep, seg) if rc is None else None
        if rc is None and reason is None:
            continue
        del sweep.running[slot]
        sweep.predicted_end.pop(slot, None)
        _record(sweep, seg, reason)
    for job, seg in list(sweep.resident.items()):
        if seg.poll() is not None:  # a paused worker was killed
            del sweep.resident[job]
            _record(sweep, seg, None)


def _overdue(sweep: Sweep, seg: Segment) -> str | None:
    """Stop a running segment past sweep.job_timeout_s (asked to checkpoint first) or without a new step for
    sweep.stall_timeout_s (killed: a hung worker answers no signal); the reason, or None if it may go on."""
    s = sweep.spec.settings
    rec = last_record(Path(sweep.configs[seg.job].train.out_dir) / "metrics.jsonl")
    step = rec["step"] if rec is not None else -1
    if step != seg.progress_step:
        seg.progress_step, seg.progress_run_s = step, seg.run_s()
    if s.job_timeout_s and seg.run_s() > s.job_timeout_s:
        stop_segment(seg, grace_s=STOP_GRACE_S)
        return f"timed out after {s.job_timeout_s:g} s (sweep.job_timeout_s)"
    if s.stall_timeout_s and seg.run_s() - seg.progress_run_s > s.stall_timeout_s:
        seg.worker.kill()
        seg.worker.join(STOP_GRACE_S)
        return f"no step for {s.stall_timeout_s:g} s: killed as hung (sweep.stall_timeout_s)"
    return None


def _record(sweep: Sweep, seg: Segment, forced_reason: str | None) -> None:
    sweep.state.update(seg.job, pid=None)
    row = sweep.state.job(seg.job)
    records = segment_records(sweep.configs[seg.job])
    run_s = row.run_s + seg.run_s()
    rc = seg.poll()
    reason = forced_reason or (failure_reason(rc, seg.log_path) if rc else diverged(records))  # (rc: it ended)
    if rc == INTERRUPTED_EXIT and forced_reason is None:
        sweep.state.update(seg.job, status=PENDING, run_s=run_s, step=_last_step(records))
        sweep.say(f"{seg.job}: stopped by a signal with a checkpoint; it resumes on the next run")
        return
    if reason is not None:
        attempts = row.attempts + 1
        retry = attempts <= sweep.spec.settings.retries
        # the step stays the last recorded good one: the retry resumes from the checkpoint, not the failure
        sweep.state.update(seg.job, status=PENDING if retry else FAILED, attempts=attempts, reason=reason,
                           run_s=run_s)
        sweep.say(f"{seg.job}: failed: {reason}; " + (f"retry {attempts} of {sweep.spec.settings.retries} from "
                                                      "its last checkpoint" if retry else "no retries left"))
        return
    last = records[-1]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    seg_recs = [r["tokens_per_s"] for r in records if r["step"] > seg.start_step][1:] or [last["tokens_per_s"]]
    values = dict(step=last["step"], loss=last["loss"], eval_loss=evals[-1] if evals else None, run_s=run_s,
                  tokens_per_s=sorted(seg_recs)[len(seg_recs) // 2], reason="")
    if last["step"] >= row.steps:
        sweep.state.update(seg.job, status=DONE, **values)
        sweep.say(f"{seg.job}: done, loss {last['loss']:.4f}"
                  + (f", eval loss {evals[-1]:.4f}" if evals else ""))
        return
    rung = last["step"]
    if sweep.asha is None or sweep.asha.next_stop(seg.start_step, row.steps) != rung:  # a time slice ended
        sweep.state.update(seg.job, status=PENDING, **values)
        return
    if "eval_loss" not in last:
        raise RuntimeError(f"{seg.job}: no eval loss at rung {rung}")  # _check_asha makes eval steps cover rungs
    assert sweep.asha is not None
    sweep.asha.report(seg.job, rung, last["eval_loss"])
    sweep.state.add_rung(seg.job, rung, last["eval_loss"], status=PAUSED, **values)
    sweep.say(f"{seg.job}: at rung {rung}, eval loss {last['eval_loss']:.4f}")


def _last_step(records: list[dict]) -> int:
    return records[-1]["step"] if records else 0


def _stop_all(sweep: Sweep) -> None:
    """Stop every worker, running or paused (SIGTERM: a checkpoint, then exit), and record their jobs as
    pending."""
    segs = list(sweep.running.values()) + list(sweep.resident.values())
    for seg in segs:
        seg.worker.terminate()
    for seg in sweep.resident.values():
        _paused_worker(seg).resume()  # a stopped process acts on SIGTERM once continued
    for seg in segs:
        await_stop(seg, grace_s=STOP_GRACE_S)
        row = sweep.state.job(seg.job)
        # where the job resumes: a worker killed after the grace time may have logged steps past its checkpoint
        step = checkpoint_step(Path(sweep.configs[seg.job].train.out_dir))
        sweep.state.update(seg.job, status=PENDING, step=step, run_s=row.run_s + seg.run_s())
    sweep.running.clear()
    sweep.resident.clear()


def _stop_paused(sweep: Sweep) -> None:
    """Nothing left to run: the jobs still paused at a rung were never among its best; they stop there."""
    if sweep.asha is None:
        return
    for row in sweep.state.jobs():
        if row.status == PAUSED:
            sweep.state.update(row.id, status=STOPPED, reason=f"asha: not in the best 1/{sweep.asha.eta} at "
                                                              f"step {row.step}")
            sweep.say(f"{row.id}: stopped at step {row.step} (asha)")


def write_results(sweep_dir: Path, rows: list[JobRow], *, say: Callable[[str], None]) -> None:
    """results.csv, losses.png (with matplotlib) and the table."""
    atomic_write_text(sweep_dir / "results.csv", results_csv(rows))
    png = loss_png(sweep_dir, rows)
    if png is not None:
        atomic_write_bytes(sweep_dir / "losses.png", png)
    say(table(rows))
    say(f"results: {sweep_dir / 'results.csv'}" + (f", loss curves: {sweep_dir / 'losses.png'}" if png else ""))
