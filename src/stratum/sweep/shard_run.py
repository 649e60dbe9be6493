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
from pathlib import Path

from stratum.atomic import atomic_write_text
from stratum.config import Config
from stratum.errors import StratumError
from stratum.profile.profile import Profile
from stratum.sweep.local import start_process
from stratum.sweep.segment import checkpoint_step, diverged, failure_reason, segment_records
from stratum.sweep.shard_lrtf import tasks_per_step
from stratum.sweep.shard_worker import ShardJob, shard_worker_main
from stratum.sweep.state import DONE, FAILED, PENDING, RUNNING, SweepState

POLL_S = 0.2
STOP_GRACE_S = 60.0
INTERRUPTED = 130


def check_shardable(configs: dict[str, Config]) -> None:
    """Steps of interleaved jobs must draw nothing from torch's global RNG (they share it): no dropout; each job
    runs one process under the plain or offload engine, in fp32 or bf16."""
    for job_id, cfg in configs.items():
        if cfg.model.dropout > 0:
            raise StratumError(f"sweep job {job_id}: sweep.scheduler = \"sharded-lrtf\" interleaves jobs that share "
                               f"torch's random state, so model.dropout must be 0 (got {cfg.model.dropout:g}); use "
                               "lrtf or fifo for jobs with dropout")
        if cfg.train.precision == "fp16":  # (its loss scaling is the offload engine's alone, untested interleaved)
            raise StratumError(f"sweep job {job_id}: sharded-lrtf does not run train.precision = 'fp16' jobs; use "
                               "bf16 or fp32, or the lrtf or fifo scheduler")
        if cfg.train.engine not in ("plain", "offload") or cfg.parallel.plan.strip():
            raise StratumError(f"sweep job {job_id}: sharded-lrtf runs jobs under the offload engine; "
                               f"train.engine = {cfg.train.engine!r} / parallel.plan are not supported with it")


def shard_jobs(state: SweepState, configs: dict[str, Config], profiles: dict[str, Profile],
               predict: Callable[[str], dict[str, float]], shard_blocks: int) -> list[ShardJob]:
    """The pending jobs as the worker takes them: chains from their checkpoints to their ends."""
    out = []
    for row in state.jobs():
        if row.status != PENDING:
            continue
        cfg = configs[row.id]
        per_step = tasks_per_step(len(profiles[row.id].blocks), shard_blocks, cfg.micro_batches_per_step)
        left = per_step * max(row.steps - checkpoint_step(Path(cfg.train.out_dir)), 0)
        out.append(ShardJob(id=row.id, config_path=str(Path(cfg.train.out_dir) / "job.toml"), tasks_left=left,
                            task_s=predict(row.id)["plain"] / max(left, 1), shard_blocks=shard_blocks))
    return out


def run_sharded(*, state: SweepState, configs: dict[str, Config], profiles: dict[str, Profile],
                predict: Callable[[str], dict[str, float]], sweep_dir: Path, slots: int, threads: int,
                shard_blocks: int, retries: int, time_budget_s: float, say: Callable[[str], None],
                tick: Callable[[], None] | None) -> None:
    """Run shard workers until no job is pending (or the time budget is spent)."""
    t0 = time.monotonic()
    while jobs := shard_jobs(state, configs, profiles, predict, shard_blocks):
        spent = _one_worker(jobs, state=state, configs=configs, sweep_dir=sweep_dir, slots=slots, threads=threads,
                            retries=retries, deadline=t0 + time_budget_s if time_budget_s else None, say=say,
                            tick=tick)
        if spent:
            say(f"time budget of {time_budget_s:g} s spent: the jobs stopped at a shard boundary; run the same "
                "command to go on (each resumes from its last checkpoint)")
            return


def _one_worker(jobs: list[ShardJob], *, state: SweepState, configs: dict[str, Config], sweep_dir: Path,
                slots: int, threads: int, retries: int, deadline: float | None, say: Callable[[str], None],
                tick: Callable[[], None] | None) -> bool:
    """One worker over ``jobs``; records their outcomes. True when the time budget stopped it."""
    exit_path = sweep_dir / "shard_exit.json"
    exit_path.unlink(missing_ok=True)
    spec_path = sweep_dir / "shard_spec.json"
    atomic_write_text(spec_path, json.dumps({"sweep_dir": str(sweep_dir), "slots": slots, "threads": threads,
                                             "jobs": [vars(j) for j in jobs]}))
    start = {j.id: checkpoint_step(Path(configs[j.id].train.out_dir)) for j in jobs}
    worker = start_process(shard_worker_main, (str(spec_path),), "stratum-sweep-shards")
    began = time.monotonic()
    for j in jobs:
        state.update(j.id, status=RUNNING, pid=worker.pid)
    say(f"sharded-lrtf: {len(jobs)} job(s) as shard tasks on {slots} slot(s) (worker pid {worker.pid})")
    stopped = False
    try:
        while worker.poll() is None:
            if deadline is not None and time.monotonic() > deadline and not stopped:
                worker.terminate()  # once: every job leaves at its next shard boundary
                stopped = True
            if tick is not None:
                tick()
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


def _record(state: SweepState, job_id: str, code: int, cfg: Config, retries: int, run_s: float, start: int,
            say: Callable[[str], None]) -> None:
    """A job's outcome in the state: done, pending (stopped, or failed with retries left) or failed."""
    row = state.job(job_id)
    out = Path(cfg.train.out_dir)
    records = segment_records(cfg)
    state.update(job_id, pid=None, run_s=row.run_s + run_s)
    if code == INTERRUPTED:
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
    last = records[-1]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    tps = sorted(r["tokens_per_s"] for r in records if r["step"] > start) or [last["tokens_per_s"]]
    state.update(job_id, status=DONE, step=last["step"], loss=last["loss"],
                 eval_loss=evals[-1] if evals else None, tokens_per_s=tps[len(tps) // 2], reason="")
    say(f"{job_id}: done, loss {last['loss']:.4f}" + (f", eval loss {evals[-1]:.4f}" if evals else ""))
