"""The ``sharded-lrtf`` worker: one process trains every given job, each in its own thread, and lets at most ``slots``
of them compute at once — a slot goes, at every shard-task boundary, to the waiting job with the longest remaining
time (:mod:`stratum.sweep.shard_lrtf`'s rule, applied to the real tasks' ends).

Every job runs ``stratum train``'s own loop (metrics, evaluation, checkpoints, summary) under the offload engine,
whose state lives on the host/disk tiers; the engine reports each block's end (:mod:`stratum.offload.tasks`), and at
a shard's last block the job's thread gives its slot back and waits for its next turn. A waiting job's state stays
in this process's memory, so a freed slot of its device can take its next task (no checkpoint); before its slot goes
to another job its engine gives its device memory back (``turn.vacate``: its chunks home, its slots freed, its
pinned chunks and in-flight tensors copied to host memory). While every slot of a device is busy, the waiting job
its next freed slot goes to (as things stand) stages its next shard: its engine takes its memory back and starts
moving that shard's chunks to its device slots (``turn.stage_next``, the engine's prefetch with nothing in use), so
its task starts with them in place; overtaken by another job, it gives the memory back again. With ``devices`` a job
takes any device's slot for its training's first task, and that device's slots from then on (its engine's pinned
state, buffers and streams live there). A stop lets every started job finish its step, which its trainer saves. A
job's step is computed exactly as alone: what it computes depends on its own state only. What the jobs share is
torch's global generators: a job's set-up (which seeds them) holds :data:`~stratum.model.streams.GLOBAL_RNG` from
its start to its first shard boundary, every block forward of a job with dropout holds it too (it forks, seeds from
the block's stream, draws, puts back), and the thread of a job without dropout forks nothing
(:func:`~stratum.model.streams.thread_draws_nothing`), so it never waits for it. Under ASHA
(:mod:`stratum.sweep.shard_asha`) a job runs to each rung, reports there and waits without a slot until it is
promoted or the worker ends.

Runbook: the sweep runner starts this through its backend: :func:`shard_worker_main` in a forked process (local),
:func:`run_shard_worker` in one Ray actor holding every slot's CPUs (ray). Its
lines go to ``<sweep dir>/shards.log``; each job's errors also to ``jobs/<id>/worker.log``; every grant (slot, job,
its task index, the waiting jobs' remaining seconds), stage (job, the task it stages for, chunk fetches started) and
job end (slot, job) to ``<sweep dir>/shard_tasks.jsonl`` (:func:`task_seconds` reads each task's seconds on its slot
from it); each job's exit code (0, 2 bad input / NaN, 130 stopped, 1 crashed) to ``<sweep dir>/shard_exit.json`` at
the end, and on CUDA devices each one's allocator peak to ``<sweep dir>/shard_cuda_peaks.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
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
from stratum.sweep.shard_lrtf import pick_longest
from stratum.train.stopping import set_stop_check
from stratum.train.trainer import train

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # the jobs' threads all reach the scheduler within this (they only load their configs)


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


@dataclass(frozen=True)
class DeviceMemory:
    """What the give-back rule knows of the devices' memory (:meth:`SlotScheduler.acquire`)."""

    capacity: list[int | None]
    """Bytes each slot's device may hold for the jobs together (None: no limit — the CPU, whose "device" tier is
    RAM, so that a give-back there only copies)."""
    budget: int
    """Each job's device budget, bytes."""

    @property
    def limited(self) -> bool:
        """Some device's memory is limited: a waiting job there may have to give back."""
        return any(c is not None for c in self.capacity)


UNLIMITED = DeviceMemory(capacity=[], budget=0)
"""No device's memory limited: a waiting job keeps its device memory."""


class Stopped(KeyboardInterrupt):
    """The worker was asked to stop before the job's training started."""


@dataclass
class SlotScheduler:
    """Grants ``slots`` slots to waiting jobs, longest remaining time first (a job whose engine lives on a device
    among that device's slots); records every grant, stage and vacate."""

    slots: int
    order: list[str]
    tasks_path: Path
    devices: list[str] = field(default_factory=list)
    """Each slot's device; [] = none named (any job takes any slot)."""
    memory: DeviceMemory = UNLIMITED
    """Each slot's device's capacity (in slot order) and the jobs' budget: whether a waiting job gives back."""
    bound: dict[str, str] = field(default_factory=dict)
    """Job → the device its engine lives on, from its training's first grant to its end (or a rung): its engine's
    pinned state, buffers and streams stay there between its tasks, so it takes only that device's slots; a job
    not training takes any slot."""
    cond: threading.Condition = field(default_factory=threading.Condition)
    free: list[int] = field(default_factory=list)
    waiting: dict[str, float] = field(default_factory=dict)
    granted: dict[str, int] = field(default_factory=dict)
    done_tasks: dict[str, int] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    next_up: dict[str, str] = field(default_factory=dict)
    """Device → the waiting job its next freed slot goes to as things stand (its slots all busy): it stages its
    next shard."""
    staged: set[str] = field(default_factory=set)
    """Waiting jobs that have staged their next shard since their last grant (their slots' memory taken again)."""
    turns: dict[str, Turn] = field(default_factory=dict)
    """Job → its engine's turn while its training runs: what it holds on its device is in every grant's record."""
    stopping: bool = False
    opened: bool = False
    """Grants start once every job waits (all are ready at the start: the first grants compare them all)."""
    t0: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.free = list(range(self.slots))
        self.devices = self.devices or [""] * self.slots
        self._capacity = dict(zip(self.devices, self.memory.capacity))
        self._log = open(self.tasks_path, "a")

    def _fits(self, job: str, device: str) -> bool:
        """``job`` may take a slot of ``device``."""
        return self.bound.get(job, device) == device

    def _rivals(self, device: str) -> dict[str, float]:
        """The waiting jobs that may take a slot of ``device`` now, and their remaining seconds."""
        return {j: r for j, r in self.waiting.items() if self._fits(j, device) and not self._stops(j)}

    def acquire(self, job: str, remaining_s: float, turn: Turn | None = None) -> int:
        """Give back ``job``'s slot if it holds one, and wait for a slot for its next task (its remaining seconds
        ``remaining_s``) — in one step, so the job competes for the slot it frees; the slot's number. A job that
        will not keep its slot first gives its device memory back (``turn.vacate``) unless its device has room
        for it to wait with it (:meth:`_keeps`), so the next task there starts with it free; while it waits as its
        device's next in line it stages its next shard (``turn.stage_next``: its slots' memory taken again, its
        chunks moving while others compute), and gives it back (room again aside) once another job overtakes it
        — so a device holds its running tasks' memory, one staged job's, and what its capacity leaves room for."""
        remaining = round(remaining_s, 6)  # the rule compares what the log records: times equal to the
        # microsecond tie to sweep order (jobs with one profile differ only in float rounding of their tasks)
        if turn is not None:
            with self.cond:
                self.turns[job] = turn
                gives = self._yields(job, remaining) and not self._keeps(job, "keep")
            if gives:
                self._vacate(job, turn, "vacate")
        with self.cond:
            self._free(job)
            self.waiting[job] = remaining
            self._grant()
            self.cond.notify_all()  # open_when_waiting counts the waiting jobs
            # no time limit: under LRTF a short job may rightly wait for hours; every granted thread gives its
            # slot back in a finally, and a stop wakes every waiter
            while job not in self.granted and not self._stops(job):
                self.cond.wait_for(lambda: job in self.granted or self._stops(job) or self._stages(job)
                                   or self._unstages(job))
                if job in self.granted or self._stops(job):
                    break
                if self._stages(job):
                    self._stage(job, self.turns[job])
                else:
                    self._unstage(job, self.turns[job])
            if job not in self.granted:
                self.waiting.pop(job, None)
                raise Stopped()
            return self.granted[job]

    def _stops(self, job: str) -> bool:
        """The worker is stopping and ``job`` has not started its training (a started one goes on to the end of
        its step, which its trainer saves: :func:`stratum.train.stopping.set_stop_check`)."""
        return self.stopping and job not in self.turns

    def _yields(self, job: str, remaining: float) -> bool:
        """``job`` holds a slot that another waiting job would take from it now."""
        if job not in self.granted:
            return False
        rivals = self._rivals(self.devices[self.granted[job]])
        return bool(rivals) and pick_longest({**rivals, job: remaining}, self.order) != job

    def _keeps(self, job: str, why: str) -> bool:
        """``job``, about to wait, may keep its device memory (recorded under ``why`` with its bytes): its device's
        waiting jobs' bytes, its own, and its running and staged jobs at their budgets fit the device's capacity.
        So a device never holds more than its capacity, and no job has to give back later to make room: a
        running job stays under its budget, and a job that waits holding memory only leaves that set to run."""
        d = self.bound.get(job, "")
        cap = self._capacity.get(d)
        own = self.turns[job].device_bytes()
        if cap is not None:
            waiting = [t for j, t in self.turns.items() if j != job and self.bound.get(j) == d
                       and j not in self.granted and j not in self.staged]
            if sum(t.device_bytes() for t in waiting) + own + (self.devices.count(d) + 1) * self.memory.budget > cap:
                return False
        self._write({"job": job, why: own})
        return True

    def _stages(self, job: str) -> bool:
        d = self.bound.get(job)
        return (job in self.turns and d is not None and self.next_up.get(d) == job and job not in self.staged
                and not self.stopping
                and not any(self.bound.get(j) == d for j in self.staged))  # one staged job per device at a time

    def _unstages(self, job: str) -> bool:
        return job in self.staged and self.next_up.get(self.bound.get(job, "")) != job

    def _stage(self, job: str, turn: Turn) -> None:
        """Run ``job``'s stage outside the lock (called and returning with it held); record what it moved."""
        self.staged.add(job)
        task = self.done_tasks.get(job, 0)  # the task it stages for (it may be granted while staging)
        self.cond.release()
        try:
            chunks = turn.stage_next()
        finally:
            self.cond.acquire()
        self._write({"job": job, "stage": task, "chunks": chunks})

    def _unstage(self, job: str, turn: Turn) -> None:
        """A staged job overtaken by another: unless its device has room for it to keep it, its memory goes back
        (outside the lock, called and returning with it held) before the other may stage."""
        if not self._keeps(job, "unstage_keep"):
            self.cond.release()
            try:
                self._vacate(job, turn, "unstage")
            finally:
                self.cond.acquire()
        self.staged.discard(job)
        self.cond.notify_all()

    def give_back(self, job: str, turn: Turn) -> None:
        """``job`` gives its device memory back now, whatever the rule (:attr:`ShardJob.gives_back_every_task`)."""
        self._vacate(job, turn, "vacate")

    def _vacate(self, job: str, turn: Turn, why: str) -> None:
        t0 = time.monotonic()
        freed = turn.vacate()
        with self.cond:
            self._write({"job": job, why: freed, "s": round(time.monotonic() - t0, 6)})

    def finish(self, job: str) -> None:
        """``job``'s thread ends: its slot goes to the next waiting job (the end recorded, so the log tells each
        task's length)."""
        with self.cond:
            self.done.add(job)
            if job in self.granted:
                self._write({"slot": self.granted[job], "job": job, "end": True})
            self.cond.notify_all()
        self.release(job)

    def release(self, job: str) -> None:
        """``job`` ended a task and its training (to its end or a rung): its slot goes to the next waiting job."""
        with self.cond:
            self.turns.pop(job, None)  # (its engine is gone: it may start again on any device)
            self.bound.pop(job, None)
            self._free(job)
            self._grant()

    def _free(self, job: str) -> None:
        slot = self.granted.pop(job, None)
        if slot is not None:
            self.free.append(slot)
            self.free.sort()

    def open_when_waiting(self, n: int) -> None:
        """Start granting once ``n`` jobs wait (or have ended)."""
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.waiting) + len(self.done) >= n, START_TIMEOUT_S):
                raise RuntimeError(f"the jobs' threads did not start within {START_TIMEOUT_S:g} s")
            self.opened = True
            self._grant()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def _grant(self) -> None:
        if not self.opened:
            return
        for slot in list(self.free):
            if not (rivals := self._rivals(self.devices[slot])):
                continue
            job = pick_longest(rivals, self.order)
            self.free.remove(slot)
            self.bound.setdefault(job, self.devices[slot])
            record = {"slot": slot, "job": job, "task": self.done_tasks.get(job, 0), "remaining": rivals}
            if self.turns:
                record["device_bytes"] = {j: t.device_bytes() for j, t in self.turns.items()}
            self._write(record)
            del self.waiting[job]
            self.staged.discard(job)
            self.granted[job] = slot
            self.done_tasks[job] = self.done_tasks.get(job, 0) + 1
            self.cond.notify_all()
        up: dict[str, str] = {}
        for d in dict.fromkeys(self.devices):
            if rivals := self._rivals(d):
                up[d] = pick_longest(rivals, self.order)
        if up != self.next_up:
            self.next_up = up
            self.cond.notify_all()

    def _write(self, record: dict) -> None:
        self._log.write(json.dumps({"t": round(time.monotonic() - self.t0, 6), **record}) + "\n")
        self._log.flush()

    def close(self) -> None:
        self._log.close()


def task_seconds(tasks_path: Path) -> dict[str, list[float]]:
    """Each job's shard tasks' seconds holding a slot, in its chain's order, from a ``shard_tasks.jsonl``: from a
    grant to the next grant or job end on the same slot (a task still running at the log's end is left out)."""
    records = [json.loads(line) for line in tasks_path.read_text().splitlines() if line.strip()]
    out: dict[str, list[float]] = {}
    for i, r in enumerate(records):
        if r.get("end") or "slot" not in r:  # a job's end, or a stage
            continue
        nxt = next((h["t"] for h in records[i + 1:] if h.get("slot") == r["slot"]), None)
        if nxt is not None:
            out.setdefault(r["job"], []).append(max(0.0, nxt - r["t"]))
    return out


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
