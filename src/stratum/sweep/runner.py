"""Run a sweep: open it, record it, and keep every slot busy with job segments until all jobs are final.

The loop polls the workers (every ``POLL_S``, and at once when a local worker ends), records each segment's
outcome in the state database (:mod:`stratum.sweep.harvest`), and gives the free slots their next work
(:mod:`stratum.sweep.dispatch`): an ASHA promotion first, else the scheduler's starts — under ``planned`` a job
may hold several slots at once, run as one multi-process ``stratum train`` of its plan. A failed segment (non-zero
exit, dead worker or rank, non-finite loss, over ``sweep.job_timeout_s``, no step for ``sweep.stall_timeout_s``)
is retried from the job's checkpoint up to ``sweep.retries`` times; the other jobs go on regardless.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import time
from collections.abc import Callable
from pathlib import Path

from stratum.atomic import atomic_write_bytes, atomic_write_text
from stratum.errors import StratumError
from stratum.procs import pid_alive, sigterm_as_interrupt
from stratum.sweep.asha_state import stop_paused
from stratum.sweep.dir_lock import hold
from stratum.sweep.dispatch import Expect, fill, paused_itself, paused_worker, pending, unique
from stratum.sweep.gang_plan import Option
from stratum.sweep.harvest import harvest
from stratum.sweep.job_strategy import options_of
from stratum.sweep.launched import group_alive
from stratum.sweep.local import LocalBackend
from stratum.sweep.plot import loss_png
from stratum.sweep.predict import make_alone_share, make_predict
from stratum.sweep.predicted_makespan import predicted_makespan, write_makespan
from stratum.sweep.ray_backend import RayBackend
from stratum.sweep.results import makespan_line, read_makespan, results_csv, table
from stratum.sweep.schedulers import Policy, Start, make_policy
from stratum.sweep.segment import POLL_S, STOP_GRACE_S, Backend, await_stop, checkpointed_values, segment_records
from stratum.sweep.setup import Sweep, open_sweep, sweep_profiles, write_job_configs
from stratum.sweep.shard_run import device_memory, run_sharded, slot_step_seconds
from stratum.sweep.spec import job_threads
from stratum.sweep.state import FINAL, PAUSED, PENDING, JobRow
from stratum.sweep.sweep_calibration import PREDICTING, auto_calibration

__all__ = ["Sweep", "open_sweep", "run_sweep", "write_results"]


def run_sweep(path: str | os.PathLike, *, say: Callable[[str], None] = print,
              tick: Callable[[Sweep], None] | None = None, retry_failed: bool = False) -> Sweep:
    """Run (or resume) the sweep in ``path`` to the end (or its time budget); returns the finished Sweep.
    ``tick`` is called at every poll (a live display); ``retry_failed`` gives failed jobs their retries again."""
    sweep = open_sweep(path, say=say)
    lock = hold(sweep.dir)
    try:
        with sigterm_as_interrupt():  # timeout, systemd, Slurm: the workers stop with a checkpoint, as on Ctrl-C
            _run(sweep, say=say, tick=tick, retry_failed=retry_failed)
    finally:
        if sweep.backend is not None:
            sweep.backend.close()
        lock.close()
    return sweep


def _run(sweep: Sweep, *, say: Callable[[str], None], tick: Callable[[Sweep], None] | None,
         retry_failed: bool) -> None:
    """:func:`run_sweep` on the opened, locked sweep."""
    if retry_failed:
        for job_id in sweep.state.reset_failed():
            say(f"{job_id}: failed before; it runs again from its last checkpoint (--retry-failed)")
    sweep.backend = make_backend(sweep)
    interrupted = sweep.state.requeue_interrupted()
    for job_id in interrupted:
        say(f"{job_id}: was running when the sweep stopped; it resumes from its last checkpoint")
    _wait_gone(interrupted)
    write_job_configs(sweep)
    if not _left_to_run(sweep):  # a finished sweep run again: its results and its measured makespan stand
        write_results(sweep.dir, sweep.state.jobs(), say=say)
        say(makespan_line(read_makespan(sweep.dir) or {}))
        return
    sweep.backend.warm_up()  # workers import torch while the planner profiles
    s = sweep.spec.settings
    predict = _predict(sweep)
    options = _planned_options(sweep, predict)
    predicted = predicted_makespan(sweep, predict, options) if predict is not None else None
    if predicted is not None:
        say(predicted.line())
    write_makespan(sweep.dir, scheduler=s.scheduler, predicted=predicted, measured_s=None)
    t0 = time.monotonic()
    if s.scheduler == "sharded-lrtf":
        assert predict is not None  # (sharded-lrtf needs predictions)
        run_sharded(backend=sweep.backend, state=sweep.state, configs=sweep.configs,
                    profiles=sweep_profiles(sweep), predict=predict, sweep_dir=sweep.dir, slots=s.slots,
                    threads=job_threads(s), shard_blocks=s.shard_blocks, retries=s.retries,
                    time_budget_s=s.time_budget_s, asha=sweep.asha, say=say,
                    tick=(lambda: tick(sweep)) if tick is not None else None, devices=s.devices,
                    memory=device_memory(s, next(iter(sweep.configs.values()))))
    else:
        policy = make_policy(s.scheduler, predict=predict, slots=s.slots, time_limit_s=s.plan_time_limit_s,
                             gap=s.plan_gap, options=options,
                             first_plan=predicted.plan if predicted is not None else None)
        expect: Expect | None = None
        if options is not None:
            expect = lambda st: options(st.job)[st.strategy].seconds  # noqa: E731
        elif predict is not None:
            expect = lambda st: min(predict(st.job).values())  # noqa: E731
        _loop(sweep, policy, expect, tick)
    # a makespan is measured only where the sweep ended, not where its time budget stopped it
    sweep.makespan_s = None if _left_to_run(sweep) else time.monotonic() - t0
    write_results(sweep.dir, sweep.state.jobs(), say=say)
    say(makespan_line(write_makespan(sweep.dir, scheduler=s.scheduler, predicted=predicted,
                                     measured_s=sweep.makespan_s)))


def _left_to_run(sweep: Sweep) -> bool:
    """Some job is not yet done, stopped or failed."""
    return any(r.status not in FINAL for r in sweep.state.jobs())


def _predict(sweep: Sweep) -> Callable[[str], dict[str, float]] | None:
    """The jobs' predicted times for the schedulers that read them, through the sweep's calibration —
    sweep.calibration = "auto" measures it now, or reads it from the sweep directory (not when no job is left to
    order); fifo orders by none, and predicts them (for its predicted makespan) only with a calibration."""
    s = sweep.spec.settings
    if s.scheduler not in PREDICTING:
        if s.calibration.strip() == "off":
            return None
        sweep.say(f"calibration: for the predicted makespan only (scheduler {s.scheduler!r} orders by none)")
    if s.calibration.strip() == "auto" and any(r.status in (PENDING, PAUSED) for r in sweep.state.jobs()):
        sweep.calibration = auto_calibration(s, sweep.dir, sweep.configs, sweep_profiles(sweep), sweep.say)
    profiles = sweep_profiles(sweep)
    slot_s = slot_step_seconds(sweep.dir, sweep.configs, profiles, s.shard_blocks) \
        if s.scheduler == "sharded-lrtf" else None
    return make_predict(sweep.state, sweep.configs, profiles, calibration=sweep.calibration, slot_step_s=slot_s)


def _planned_options(sweep: Sweep, predict: Callable[[str], dict[str, float]] | None,
                     ) -> Callable[[str], dict[str, Option]] | None:
    """planned: each job's strategies in seconds for what remains of it (None for the other schedulers)."""
    s = sweep.spec.settings
    if s.scheduler != "planned" or predict is None:
        return None
    share = make_alone_share(sweep.state, sweep.configs, sweep_profiles(sweep), sweep.calibration)
    return options_of(sweep.candidates, sweep.state, sweep.configs, predict, share, sweep.launch_s, s.segment_steps)


def make_backend(sweep: Sweep) -> Backend:
    """The backend sweep.backend names: local worker processes, or Ray actors (GPU slots ask for a GPU)."""
    s = sweep.spec.settings
    if s.backend == "ray":
        gpu_slots = {i for i, d in enumerate(s.devices) if d.startswith("cuda")}
        return RayBackend(address=s.ray_address, slots=s.slots, threads=job_threads(s), gpu_slots=gpu_slots)
    return LocalBackend()


def _wait_gone(pids: dict[str, int | None], timeout_s: float = 30.0) -> None:
    """The workers of a killed sweep die with it (PR_SET_PDEATHSIG) but may take a moment — a multi-process
    job's ranks write their checkpoint first; a job must not be started while its old worker (or a rank in its
    launcher's process group) still writes to its directory."""
    deadline = time.monotonic() + timeout_s
    for job_id, pid in pids.items():
        while pid is not None and (pid_alive(pid) or group_alive(pid)):
            if time.monotonic() > deadline:
                raise StratumError(f"{job_id}: the worker of the stopped sweep (pid {pid}) is still running; stop "
                                   "it, then run the same command again")
            time.sleep(0.1)


def _loop(sweep: Sweep, policy: Policy, expect: Callable[[Start], float] | None,
          tick: Callable[[Sweep], None] | None) -> None:
    """Poll, record, refill, until no job can run (or the time budget is spent)."""
    s = sweep.spec.settings
    t0 = time.monotonic()
    try:
        while True:
            harvest(sweep)
            if s.time_budget_s and time.monotonic() - t0 > s.time_budget_s:
                sweep.say(f"time budget of {s.time_budget_s:g} s spent: stopping the running jobs with a "
                          "checkpoint; run the same command to go on")
                _stop_all(sweep)
                return
            fill(sweep, policy, expect, time.monotonic() - t0)
            if not sweep.running:
                if pending(sweep):
                    raise RuntimeError("pending jobs but the scheduler started none with every slot free")
                _stop_paused(sweep)
                return
            if tick is not None:
                tick(sweep)
            wait_for_an_end(sweep, POLL_S)
    except BaseException:  # Ctrl-C or an error: the workers stop with a checkpoint and their jobs stay resumable
        _stop_all(sweep)
        raise


def wait_for_an_end(sweep: Sweep, timeout_s: float) -> None:
    """Until a running worker ends (where its backend gives a descriptor to wait on) or ``timeout_s`` passes: a
    slot freed is refilled at once, not at the next poll."""
    fds = [fd for seg in unique(sweep.running.values())
           if (fd := seg.worker.sentinel) is not None and seg.poll() is None]
    if fds:
        multiprocessing.connection.wait(fds, timeout_s)
    else:
        time.sleep(timeout_s)


def _stop_all(sweep: Sweep) -> None:
    """Stop every worker, running or paused (SIGTERM: a checkpoint, then exit), and record their jobs as
    pending."""
    segs = unique(sweep.running.values()) + list(sweep.resident.values())
    for seg in segs:
        seg.worker.terminate()
    for seg in segs:
        if paused_itself(sweep, seg):  # (paused, or stopped at a slice end since the last poll)
            paused_worker(seg).resume()  # a stopped process acts on SIGTERM once continued
    for seg in segs:
        await_stop(seg, grace_s=STOP_GRACE_S)
        row = sweep.state.job(seg.job)
        # where the job resumes: a worker killed after the grace time may have logged steps past its checkpoint
        cfg = sweep.configs[seg.job]
        sweep.state.update(seg.job, status=PENDING, run_s=row.run_s + seg.run_s(),
                           **checkpointed_values(Path(cfg.train.out_dir), segment_records(cfg)))
    sweep.running.clear()
    sweep.predicted_end.clear()
    sweep.resident.clear()


def _stop_paused(sweep: Sweep) -> None:
    if sweep.asha is not None:
        stop_paused(sweep.state, sweep.asha, sweep.say)


def write_results(sweep_dir: Path, rows: list[JobRow], *, say: Callable[[str], None]) -> None:
    """results.csv, losses.png (with matplotlib) and the table."""
    atomic_write_text(sweep_dir / "results.csv", results_csv(rows))
    png = loss_png(sweep_dir, rows)
    if png is not None:
        atomic_write_bytes(sweep_dir / "losses.png", png)
    say(table(rows))
    say(f"results: {sweep_dir / 'results.csv'}" + (f", loss curves: {sweep_dir / 'losses.png'}" if png else ""))
