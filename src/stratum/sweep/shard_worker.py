"""The ``sharded-lrtf`` worker: one process trains every given job, each in its own thread, and lets at most ``slots``
of them compute at once — which job's shard task a freed slot takes, and whether a waiting job gives its device
memory back, is :mod:`stratum.sweep.slot_scheduler`'s.

Every job runs ``stratum train``'s own loop (metrics, evaluation, checkpoints, summary) under the offload engine,
whose state lives on the host/disk tiers; the engine reports each block's end (:mod:`stratum.offload.tasks`), and at
a shard's last block the job's thread gives its slot back and waits for its next turn (:class:`JobGate`). A waiting
job's state stays in this process's memory, so a freed slot of its device can take its next task (no checkpoint).
A stop lets every started job finish its step, which its trainer saves. A job's step is computed exactly as alone:
what it computes depends on its own state only. What the jobs share is torch's global generators: a job's set-up
(which seeds them) holds :data:`~stratum.model.streams.GLOBAL_RNG` from its start to its first shard boundary,
every block forward of a job with dropout holds it too (it forks, seeds from the block's stream, draws, puts
back), and the thread of a job without dropout forks nothing (:func:`~stratum.model.streams.thread_draws_nothing`),
so it never waits for it. Under ASHA (:mod:`stratum.sweep.shard_asha`) a job runs to each rung, reports there and
waits without a slot until it is promoted or the worker ends.

Runbook: the sweep runner starts this through its backend: :func:`shard_worker_main` in a forked process (local),
:func:`run_shard_worker` in one Ray actor holding every slot's CPUs (ray). Its lines go to
``<sweep dir>/shards.log``; each job's errors also to ``jobs/<id>/worker.log``; the scheduler's grant log to
``<sweep dir>/shard_tasks.jsonl``; each job's exit code (0, 2 bad input / NaN, 130 stopped, 1 crashed) to
``<sweep dir>/shard_exit.json`` at the end, and on CUDA devices each one's allocator peak to
``<sweep dir>/shard_cuda_peaks.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from stratum.atomic import atomic_write_text
from stratum.config import Config, load_config
from stratum.errors import StratumError
from stratum.model.streams import GLOBAL_RNG, thread_draws_nothing
from stratum.offload.tasks import Turn, set_gate
from stratum.runtime.device import resolve_device
from stratum.sweep.calibrate import with_items
from stratum.sweep.segment import checkpoint_step, segment_records
from stratum.sweep.shard_asha import RungBoard
from stratum.sweep.slot_scheduler import UNLIMITED, DeviceMemory, SlotScheduler
from stratum.train.stopping import set_stop_check
from stratum.train.trainer import train

logger = logging.getLogger(__name__)



@dataclass(kw_only=True)
class ShardJob:
    """A job as the shard worker sees it."""

    id: str
    """Job id (sweep order is the order given)."""
    config_path: str
    """Its job.toml."""
    tasks_left: int
    """Shard tasks to its end from where it resumes."""
    task_s: float
    """Predicted seconds of one shard task."""
    shard_blocks: int
    """Blocks per shard."""
    gives_back_every_task: bool = False
    """It gives its device memory back at every shard boundary, yielding its slot or not: the calibration's
    measure of what a give-back costs its shape (:mod:`stratum.sweep.shard_calibrate`)."""


class JobGate:
    """The offload engine's gate in one job's thread: at a shard's last block, give the slot back and wait. A
    job's set-up — from its slot's grant to its first shard boundary — holds :data:`GLOBAL_RNG`: it seeds torch's
    global generators, which the other jobs' dropout draws from."""

    def __init__(self, job: ShardJob, sched: SlotScheduler):
        self.job, self.sched = job, sched
        self.left = job.tasks_left
        self.holds_setup = False
        """The job's thread holds the set-up lock (from a training run's start to its first shard boundary)."""

    def remaining_s(self) -> float:
        return max(self.left, 0) * self.job.task_s

    def take_setup(self) -> None:
        GLOBAL_RNG.acquire()
        self.holds_setup = True

    def drop_setup(self) -> None:
        if self.holds_setup:
            self.holds_setup = False
            GLOBAL_RNG.release()

    def __call__(self, kind: str, block: int, blocks: int, turn: Turn) -> None:
        g = self.job.shard_blocks
        boundary = (block + 1) % g == 0 or block == blocks - 1 if kind == "F" else block % g == 0
        if not boundary:
            return
        self.drop_setup()
        self.left -= 1
        if self.job.gives_back_every_task:
            self.sched.give_back(self.job.id, turn)
        self.sched.acquire(self.job.id, self.remaining_s(), turn)


def _run_job(job: ShardJob, sched: SlotScheduler, board: RungBoard | None, threads: int,
             codes: dict[str, int]) -> None:
    """One job's thread: train its chain (set-up one job at a time), record the exit code."""
    gate = JobGate(job, sched)
    log = Path(job.config_path).parent / "worker.log"
    code = 0
    try:
        cfg = load_config(job.config_path)
        if cfg.model.source == "gpt" and cfg.model.dropout == 0:
            thread_draws_nothing()  # (its blocks draw nothing; it initialises from its own generators)
        set_gate(gate)
        set_stop_check(lambda: "the sweep's stop" if sched.stopping else None)
        torch.set_num_threads(threads)
        _train_chain(job, cfg, gate, sched, board)
    except StratumError as e:
        code = e.exit_code
        _append(log, f"stratum: error: {e}\n")
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # one job's crash is its own: the others go on
        code = 1
        _append(log, traceback.format_exc())
    finally:
        set_gate(None)
        set_stop_check(None)
        gate.drop_setup()
        codes[job.id] = code
        if board is not None:
            board.finish(job.id)
        sched.finish(job.id)


def _train_chain(job: ShardJob, cfg: Config, gate: JobGate, sched: SlotScheduler, board: RungBoard | None) -> None:
    """Train the job from its checkpoint to its end — under ASHA a run to each rung, where it waits for its
    promotion without a slot — or until the worker ends with it at a rung."""
    steps, step = cfg.train.steps, checkpoint_step(Path(cfg.train.out_dir))
    if board is not None and board.waits(job.id) and not board.promoted(job.id):
        return
    while True:
        stop = board.next_stop(step, steps) if board is not None else steps
        device = sched.devices[sched.acquire(job.id, gate.remaining_s())]
        gate.take_setup()
        run = with_items(cfg, ("train", "device", device)) if device else cfg
        with job_stream(resolve_device(run.train.device)):
            train(run, stop_at=stop)
        gate.drop_setup()
        if board is None or stop >= steps:
            return
        sched.release(job.id)
        if not board.at_rung(job.id, stop, segment_records(cfg), step):
            return
        step = stop


def job_stream(device: torch.device) -> contextlib.AbstractContextManager:
    """On a GPU, a CUDA stream of the job's own for its thread (a thread's current stream is its own), so that the
    kernels of jobs on slots of one GPU can overlap rather than queue on its default stream; elsewhere nothing."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device))


def _append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def run_shard_jobs(jobs: list[ShardJob], *, slots: int, threads: int, sweep_dir: Path,
                   asha: dict[str, int] | None = None, devices: list[str] | None = None,
                   memory: DeviceMemory = UNLIMITED) -> dict[str, int]:
    """Train ``jobs`` on ``slots`` slots (on ``devices``, one per slot; a training job on its device's) by the
    shard-level rule (with ``asha``'s ``min_steps`` and ``eta``: ASHA at the rungs); each job's exit code. SIGTERM
    lets every started job finish its step (its shard tasks still granted by the rule), which its trainer saves,
    and stop; a job not started does not start."""
    sched = SlotScheduler(slots, [j.id for j in jobs], sweep_dir / "shard_tasks.jsonl", devices=list(devices or []),
                          memory=memory)
    board = RungBoard.open(sweep_dir, [j.id for j in jobs], say=logger.info, **asha) if asha else None
    codes: dict[str, int] = {}

    def stop(*_) -> None:
        sched.stop()
        if board is not None:
            board.stop()
    previous = signal.signal(signal.SIGTERM, stop)
    threads_ = [threading.Thread(target=_run_job, args=(j, sched, board, threads, codes), name=f"job-{j.id}",
                                 daemon=True) for j in jobs]
    try:
        for t in threads_:
            t.start()
        sched.open_when_waiting(len(jobs) - (len(board.paused) if board is not None else 0))
        for t in threads_:
            while t.is_alive():
                t.join(0.2)  # the main thread stays responsive to signals
    finally:
        signal.signal(signal.SIGTERM, previous)
        sched.close()
        if board is not None:
            board.close()
    return codes


def cuda_peaks(devices: list[str]) -> dict[str, int]:
    """``torch.cuda.max_memory_allocated`` of each CUDA device among ``devices`` in this process: what the jobs
    sharing it held at most, together (their budgets may add up to more)."""
    named = sorted({d for d in devices if d.startswith("cuda")})
    return {d: torch.cuda.max_memory_allocated(torch.device(d)) for d in named} if named else {}


def run_shard_worker(spec_path: str) -> None:
    """Read the jobs from ``spec_path`` (JSON), train them with this process's output in ``shards.log``, write
    their exit codes to ``shard_exit.json``."""
    spec = json.loads(Path(spec_path).read_text())
    sweep_dir = Path(spec["sweep_dir"])
    fd = os.open(sweep_dir / "shards.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    logging.basicConfig(level=logging.INFO, format="%(threadName)s %(message)s", stream=sys.stderr)
    jobs = [ShardJob(**j) for j in spec["jobs"]]
    codes = run_shard_jobs(jobs, slots=spec["slots"], threads=spec["threads"], sweep_dir=sweep_dir,
                           asha=spec.get("asha"), devices=spec.get("devices"),
                           memory=DeviceMemory(**spec["memory"]) if spec.get("memory") else UNLIMITED)
    if peaks := cuda_peaks(spec.get("devices") or []):
        logger.info(f"CUDA memory peaks of this worker: {peaks}")
        atomic_write_text(sweep_dir / "shard_cuda_peaks.json", json.dumps(peaks))
    atomic_write_text(sweep_dir / "shard_exit.json", json.dumps(codes))
    sys.stdout.flush()
    sys.stderr.flush()


def shard_worker_main(spec_path: str) -> None:
    """The local backend's worker process (it dies with the sweep: :func:`stratum.sweep.local.start_process`)."""
    run_shard_worker(spec_path)
    os._exit(0)  # every result is written; skip the interpreter's teardown of the jobs' threads
