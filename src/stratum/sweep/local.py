"""The ``local`` backend: each segment is a worker process on this machine.

Workers are forked from a ``forkserver`` that has imported torch and the trainer once, so a segment starts in
milliseconds rather than the seconds an interpreter needs to import torch, and the sweep process's own torch
state (profiling for the planner) never reaches a worker. On Linux a worker is killed when its parent dies
(``PR_SET_PDEATHSIG``; the forkserver exits when the sweep dies), so a killed sweep never leaves a job writing to
its directory behind the next one; a worker forked just as the sweep died exits by itself
(:mod:`stratum.dist.forked`).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

from stratum.dist import forked
from stratum.dist.roles import WORKER_ENV
from stratum.sweep.launched import launch_train
from stratum.sweep.segment import Segment, Worker, run_segment
from stratum.sweep.shard_worker import shard_worker_main

PRELOAD = ("stratum.sweep.local", "stratum.sweep.shard_worker", "torch._dynamo")
"""torch.optim imports torch._dynamo on its first optimizer (≈1.5 s): once in the server, not in every worker."""


def worker_main(config_path: str, stop_at: int, device: str | None, threads: int, log_path: str,
                slice_steps: int) -> None:
    """A segment's process: exits with :func:`run_segment`'s code. A worker, to the trainer's stop signals: Ctrl-C
    at a terminal reaches it and the sweep (which then sends SIGTERM) alike, and the second must not end it before
    its checkpoint — the sweep kills a worker that outlasts its grace time anyway."""
    os.environ[WORKER_ENV] = "1"
    sys.exit(run_segment(config_path, stop_at, device, threads, log_path, slice_steps))


def start_process(target, args: tuple, name: str) -> LocalWorker:
    """Fork ``target(*args)`` from the forkserver (imports done once there); it is killed when the sweep dies."""
    return LocalWorker(forked.start_forked(target, args, name=name, preload=PRELOAD, death_signal=signal.SIGKILL))


class LocalWorker:
    """A forked worker process (the runner's :class:`~stratum.sweep.segment.Worker`); under sweep.slice_by = pause
    (local backend only) it stops itself at a slice's end (:class:`~stratum.sweep.segment.SliceGate`), which
    :meth:`stopped` tells, and is continued."""

    def __init__(self, proc: multiprocessing.process.BaseProcess):
        self.proc = proc
        self.pid: int | None = proc.pid
        self.sentinel: int | None = proc.sentinel

    def poll(self) -> int | None:
        return self.proc.exitcode

    def terminate(self) -> None:
        if self.proc.exitcode is None:
            self.proc.terminate()  # SIGTERM: the trainer checkpoints after its step

    def kill(self) -> None:
        if self.proc.exitcode is None:
            self.proc.kill()

    def join(self, timeout_s: float) -> None:
        self.proc.join(timeout_s)

    def stopped(self) -> bool:
        """Stopped by a signal (SIGSTOP), its state in memory, using no CPU: /proc's state field, after the
        command name's closing parenthesis (the name itself may hold any character)."""
        if self.proc.exitcode is not None or self.proc.pid is None:
            return False
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return False
        return stat[stat.rindex(")") + 2:][:1] in ("T", "t")

    def resume(self) -> None:
        if self.proc.exitcode is None and self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGCONT)


class LocalBackend:
    """Worker processes on this machine."""

    def warm_up(self) -> None:
        """Start the forkserver now (its imports take seconds), so it is ready by the first segment."""
        forked.warm_up(PRELOAD)

    def start(self, *, job: str, slots: tuple[int, ...], config_path: Path, start_step: int, stop_at: int,
              devices: tuple[str, ...] | None, threads: int, log_path: Path, slice_steps: int) -> Segment:
        """Start a worker that trains the job of ``config_path`` from its last checkpoint to ``stop_at``: a forked
        worker, or for a plan of several processes a ``stratum train`` launcher of them
        (:mod:`stratum.sweep.launched`)."""
        worker: Worker
        if len(slots) > 1:
            worker = launch_train(config_path, stop_at, threads, log_path, devices)
        else:
            worker = start_process(worker_main, (str(config_path), stop_at, devices[0] if devices else None, threads,
                                                 str(log_path), slice_steps), f"stratum-sweep-{job}")
        return Segment(job=job, slot=slots[0], start_step=start_step, stop_at=stop_at, worker=worker,
                       log_path=log_path, started=time.monotonic())

    def start_shard_worker(self, spec_path: Path, cpus: int, gpus: int) -> Worker:
        """sharded-lrtf's worker, forked (its jobs' threads share this machine's cores and GPUs)."""
        return start_process(shard_worker_main, (str(spec_path),), "stratum-sweep-shards")

    def worker_devices(self, devices: list[str]) -> list[str]:
        """This machine's names: the forked worker sees what the sweep sees."""
        return devices

    def close(self) -> None:
        pass
