"""The runner's side of ``sharded-lrtf``: start one shard worker (:mod:`stratum.sweep.shard_worker`) for the
pending jobs, watch it, record each job's outcome, and start another for the jobs left to retry.

Every job runs under the offload engine at ``sweep.device_budget`` (set up by the runner before this), as a chain
of shard tasks; its predicted remaining time — what the rule compares — is the runner's prediction (its shape's
seconds on a slot from sharded-lrtf's calibration with ``sweep.calibration``, else its profile; its own measured
steps once it has run) spread over its tasks: ``tasks_left × task_s``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stratum.atomic import atomic_write_text
from stratum.config import Config
from stratum.errors import StratumError
from stratum.profile.profile import Profile
from stratum.sweep.asha import Asha, rung_steps
from stratum.sweep.asha_state import asha_from_state, promote_at_end, report_rung, stop_paused
from stratum.sweep.expand import device_capacity, named_slot_devices
from stratum.sweep.live import EVAL_WINDOW, tail_records
from stratum.sweep.segment import (
    INTERRUPTED_EXIT,
    POLL_S,
    STOP_GRACE_S,
    Backend,
    checkpoint_step,
    diverged,
    failure_reason,
    result_values,
    segment_records,
)
from stratum.sweep.shard_lrtf import tasks_per_step
from stratum.sweep.shard_size import job_shard_blocks
from stratum.sweep.shard_worker import ShardJob
from stratum.sweep.slot_scheduler import DeviceMemory, task_seconds
from stratum.sweep.spec import SweepSettings
from stratum.sweep.state import DONE, FAILED, PAUSED, PENDING, RUNNING, SweepState
from stratum.units import parse_budget


def check_shardable(configs: dict[str, Config]) -> None:
    """Each job runs one process under the plain or offload engine (its shard tasks are the offload engine's
    blocks), not in the background: the jobs are threads of one worker, and a background job's SCHED_IDLE would
    apply to the whole process, the other jobs with it (a foreground job's stream priority is its thread's own)."""
    for job_id, cfg in configs.items():
        if cfg.train.engine not in ("plain", "offload") or cfg.parallel.plan.strip():
            raise StratumError(f"sweep job {job_id}: sharded-lrtf runs jobs under the offload engine; "
                               f"train.engine = {cfg.train.engine!r} / parallel.plan are not supported with it")
        if cfg.train.priority == "background":
            raise StratumError(f"sweep job {job_id}: sharded-lrtf runs every job in one worker process, whose "
                               f"priority is all its jobs'; train.priority = {cfg.train.priority!r} needs another "
                               "scheduler (fifo, lrtf, planned), which gives each job a process")


def shard_jobs(state: SweepState, configs: dict[str, Config], profiles: dict[str, Profile],
               predict: Callable[[str], dict[str, float]], shard_blocks: int, asha: Asha | None) -> list[ShardJob]:
    """The jobs a worker takes, as chains from their checkpoints to their ends: the pending ones and, under ASHA
    while some job may still report or be promoted, the paused ones (a report may promote them)."""
    rows = state.jobs()
    take = {PENDING}
    if asha is not None and (any(r.status == PENDING for r in rows)
                             or asha_from_state(state, min_steps=asha.min_steps, eta=asha.eta).promotable()):
        take.add(PAUSED)
    out = []
    for row in rows:
        if row.status not in take:
            continue
        cfg = configs[row.id]
        blocks = job_shard_blocks(profiles[row.id], cfg, shard_blocks)
        per_step = tasks_per_step(len(profiles[row.id].blocks), blocks, cfg.micro_batches_per_step)
        left = per_step * max(row.steps - checkpoint_step(Path(cfg.train.out_dir)), 0)
        out.append(ShardJob(id=row.id, config_path=str(Path(cfg.train.out_dir) / "job.toml"), tasks_left=left,
                            task_s=predict(row.id)["plain"] / max(left, 1), shard_blocks=blocks))
    return out


def slot_step_seconds(sweep_dir: Path, configs: dict[str, Config], profiles: dict[str, Profile],
                      shard_blocks: int) -> dict[str, float]:
    """Job → the seconds one of its steps held slots in the sweep's earlier workers (its shard tasks' median from
    ``shard_tasks.jsonl`` × its tasks per step), for the jobs that ran at least two tasks."""
    path = sweep_dir / "shard_tasks.jsonl"
    if not path.exists():
        return {}
    out = {}
    for job, seconds in task_seconds(path).items():
        ran = sorted(t for t in seconds if t > 0)  # (a worker's last grant on a slot is closed by none: 0)
        if job in configs and len(ran) > 1:
            cfg, profile = configs[job], profiles[job]
            per_step = tasks_per_step(len(profile.blocks), job_shard_blocks(profile, cfg, shard_blocks),
                                      cfg.micro_batches_per_step)
            out[job] = ran[len(ran) // 2] * per_step
    return out


def device_memory(s: SweepSettings, cfg: Config) -> DeviceMemory:
    """The give-back rule's view of the sweep's devices: each slot's device's capacity (sweep.device_memory, a
    GPU's memory, or no limit on the CPU) and the jobs' device budget."""
    budget = parse_budget(s.device_budget, "sweep.device_budget")
    return DeviceMemory(capacity=[device_capacity(d, s.device_memory) for d in named_slot_devices(s, cfg)],
                        budget=int(budget or 0))


def report_missed(state: SweepState, configs: dict[str, Config], asha: Asha) -> None:
    """A pending job whose checkpoint stands at a rung it has not reported at (its sweep, or worker, was killed
    between the two) is reported there now, from its metrics: it pauses there as it would have."""
    rungs = asha_from_state(state, min_steps=asha.min_steps, eta=asha.eta)
    for row in state.jobs():
        cfg = configs[row.id]
        step = checkpoint_step(Path(cfg.train.out_dir))
        if row.status == PENDING and step in rung_steps(asha.min_steps, asha.eta, row.steps) \
                and row.id not in rungs.results.get(step, {}):
            report_rung(state, rungs, row.id, step, segment_records(cfg), 0)


def run_sharded(*, backend: Backend, state: SweepState, configs: dict[str, Config], profiles: dict[str, Profile],
                predict: Callable[[str], dict[str, float]], sweep_dir: Path, slots: int, threads: int,
                shard_blocks: int, retries: int, time_budget_s: float, asha: Asha | None,
                say: Callable[[str], None], tick: Callable[[], None] | None, devices: list[str],
                memory: DeviceMemory) -> None:
    """Run shard workers until no job is pending (or the time budget is spent); then, under ASHA, stop the jobs
    left at their rungs."""
    t0 = time.monotonic()
    while True:
        if asha is not None:
            report_missed(state, configs, asha)
        if not (jobs := shard_jobs(state, configs, profiles, predict, shard_blocks, asha)):
            if asha is not None and promote_at_end(state, asha_from_state(state, min_steps=asha.min_steps,
                                                                           eta=asha.eta), say):
                continue
            break
        deadline = t0 + time_budget_s if time_budget_s else None
        spent = _one_worker(jobs, backend=backend, state=state, configs=configs, sweep_dir=sweep_dir, slots=slots,
                            threads=threads, retries=retries, deadline=deadline, say=say, tick=tick, asha=asha,
                            devices=devices, memory=memory)
        if spent:
            say(f"time budget of {time_budget_s:g} s spent: the jobs stopped at the end of their steps, with a "
                "checkpoint; run the same command to go on")
            return
    if asha is not None:
        stop_paused(state, asha_from_state(state, min_steps=asha.min_steps, eta=asha.eta), say)


def _one_worker(jobs: list[ShardJob], *, backend: Backend, state: SweepState, configs: dict[str, Config],
                sweep_dir: Path, slots: int, threads: int, retries: int, deadline: float | None,
                say: Callable[[str], None], tick: Callable[[], None] | None, asha: Asha | None,
                devices: list[str], memory: DeviceMemory) -> bool:
    """One worker over ``jobs``; records their outcomes (a job at a rung is the worker's to record). True when
    the time budget stopped it."""
    exit_path = sweep_dir / "shard_exit.json"
    exit_path.unlink(missing_ok=True)
    spec_path = sweep_dir / "shard_spec.json"
    rungs = {"min_steps": asha.min_steps, "eta": asha.eta} if asha is not None else None
    atomic_write_text(spec_path, json.dumps({"sweep_dir": str(sweep_dir), "slots": slots, "threads": threads,
                                             "jobs": [vars(j) for j in jobs], "asha": rungs,
                                             "devices": backend.worker_devices(devices),
                                             "memory": asdict(memory)}))
    start = {j.id: checkpoint_step(Path(configs[j.id].train.out_dir)) for j in jobs}
    for j in jobs:  # before the worker may write (a job at a rung stays paused until the worker promotes it)
        if state.job(j.id).status != PAUSED:
            state.update(j.id, status=RUNNING)
    worker = backend.start_shard_worker(spec_path, cpus=slots * threads,
                                        gpus=len({d for d in devices if d.startswith("cuda")}))
    began = time.monotonic()
    for j in jobs:
        state.update(j.id, pid=worker.pid)
    on = f" on {', '.join(sorted(set(devices)))}" if devices else ""
    say(f"sharded-lrtf: {len(jobs)} job(s) as shard tasks on {slots} slot(s){on} (worker pid {worker.pid})")
    progress = _Progress(start=dict(start), status={j.id: state.job(j.id).status for j in jobs})
    stopped = False
    try:
        while worker.poll() is None:
            if deadline is not None and time.monotonic() > deadline and not stopped:
                worker.terminate()  # once: every started job ends its step with a checkpoint and stops
                stopped = True
            if tick is not None:
                tick()
            progress.report(state, configs, say)
            worker.join(POLL_S)
    except BaseException:
        worker.terminate()
        worker.join(STOP_GRACE_S)
        worker.kill()
        raise
    finally:
        if worker.poll() is None:
            worker.join(STOP_GRACE_S)
            worker.kill()
            worker.join(STOP_GRACE_S)
        codes = json.loads(exit_path.read_text()) if exit_path.exists() else {}
        for j in jobs:
            _record(state, j.id, codes.get(j.id, worker.poll() or -9), configs[j.id], retries,
                    time.monotonic() - began, start[j.id], say)
    return stopped


@dataclass
class _Progress:
    """What the runner has said of the worker's jobs: the worker prints nothing (its log is shards.log), so the
    runner reads each job's metrics and recorded status while it runs — a job's first step, its eval losses, its
    waits at rungs and promotions — as plain lines like the other schedulers' (every job shares every slot, so
    none is "on" one)."""

    start: dict[str, int]
    """Job → the last step already said (its checkpoint's at the worker's start)."""
    status: dict[str, str]
    """Job → its status as last seen."""
    begun: set[str] = field(default_factory=set)

    def report(self, state: SweepState, configs: dict[str, Config], say: Callable[[str], None]) -> None:
        for job, seen in self.start.items():
            records = [r for r in tail_records(Path(configs[job].train.out_dir) / "metrics.jsonl", EVAL_WINDOW)
                       if r["step"] > seen]
            if records and job not in self.begun:
                self.begun.add(job)
                loss = records[0].get("loss")
                say(f"{job}: training from step {seen} as shard tasks"
                    + (f", loss {loss:.4f}" if isinstance(loss, float) else ""))
            for r in records:
                if isinstance(r.get("eval_loss"), float):
                    say(f"{job}: step {r['step']}/{configs[job].train.steps}, eval loss {r['eval_loss']:.4f}")
            if records:
                self.start[job] = records[-1]["step"]
            status = state.job(job).status
            if status != self.status[job] and (status == PAUSED or self.status[job] == PAUSED):
                say(f"{job}: " + (f"waits at the rung of step {self.start[job]}" if status == PAUSED
                                  else f"promoted at step {self.start[job]}, goes on"))
            self.status[job] = status


def _record(state: SweepState, job_id: str, code: int, cfg: Config, retries: int, run_s: float, start: int,
            say: Callable[[str], None]) -> None:
    """A job's outcome in the state: done, pending (stopped, or failed with retries left) or failed; a job the
    worker left at a rung stays paused."""
    row = state.job(job_id)
    out = Path(cfg.train.out_dir)
    records = segment_records(cfg)
    state.update(job_id, pid=None, run_s=row.run_s + run_s)
    if row.status == PAUSED:
        return
    if code == INTERRUPTED_EXIT:
        state.update(job_id, status=PENDING, step=checkpoint_step(out))
        return
    reason = failure_reason(code, out / "worker.log") if code != 0 else diverged(records)
    if reason is None and (not records or records[-1]["step"] < row.steps):
        reason = f"ended at step {records[-1]['step'] if records else 0} of {row.steps}"
    if reason is not None:
        attempts = row.attempts + 1
        retry = attempts <= retries
        state.update(job_id, status=PENDING if retry else FAILED, attempts=attempts, reason=reason,
                     step=checkpoint_step(out))
        say(f"{job_id}: failed: {reason}; " + (f"retry {attempts} of {retries} from its last checkpoint" if retry
                                               else "no retries left"))
        return
    values = result_values(records, start)
    state.update(job_id, status=DONE, **values)
    say(f"{job_id}: done, loss {values['loss']:.4f}"
        + (f", eval loss {values['eval_loss']:.4f}" if values["eval_loss"] is not None else ""))
