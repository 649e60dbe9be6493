"""One segment of a job — its training from its last checkpoint to ``stop_at`` — and what every backend's worker
shares: the body that runs it (:func:`run_segment`), the handle the runner polls (:class:`Segment`), and how an
ended segment is read (exit code, log, metrics, checkpoint).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from stratum.config import Config, load_config
from stratum.errors import StratumError
from stratum.train.checkpoint import latest_checkpoint
from stratum.train.trainer import read_metrics, train

INTERRUPTED_EXIT = 130  # stopped by SIGINT/SIGTERM after a checkpoint, as `stratum train` exits then
LOCK_TIMEOUT_S = 60.0
POLL_S = 0.2
"""Seconds between a sweep loop's looks at its workers."""
STOP_GRACE_S = 60.0
"""Seconds a worker asked to stop has to checkpoint and exit before it is killed."""


def _lock_job_dir(job_dir: Path, timeout_s: float) -> int:
    """Take an exclusive lock on the job's directory (the kernel drops it when its holder dies, however it dies):
    a worker left over from a killed sweep and its successor never train the same job at once. Waits up to
    ``timeout_s`` for a predecessor to go."""
    fd = os.open(job_dir / ".worker.lock", os.O_WRONLY | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise StratumError(f"another worker still trains the job in {job_dir} after {timeout_s:g} s; stop "
                                   "it, then run the sweep again") from None
            time.sleep(0.1)


PAUSE_FLAG = ".pause-at-slice-end"
"""In a job's directory while the sweep wants its worker (slice_by = pause) to stop at its next slice end."""


class SliceGate:
    """After each step of a segment under slice_by = pause: at the end of each slice of ``slice_steps`` steps,
    counted from the segment's first step, the worker stops itself (SIGSTOP) where the sweep asks for it
    (:data:`PAUSE_FLAG`) — so a slice is exactly ``slice_steps`` steps, where a stop sent when the sweep's poll
    sees the step would land a step or more later. Not at the segment's end: the job is done there."""

    def __init__(self, job_dir: Path, slice_steps: int, stop_at: int):
        self.flag, self.slice_steps, self.stop_at = job_dir / PAUSE_FLAG, slice_steps, stop_at
        self.first: int | None = None

    def __call__(self, done: int) -> None:
        if self.first is None:
            self.first = done - 1
        if done < self.stop_at and (done - self.first) % self.slice_steps == 0 and self.flag.exists():
            os.kill(os.getpid(), signal.SIGSTOP)


def run_segment(config_path: str, stop_at: int, device: str | None, threads: int, log_path: str,
                slice_steps: int = 0) -> int:
    """Train the job of ``config_path`` from its last checkpoint to ``stop_at``, as ``stratum train --config
    config_path --stop-at stop_at`` does, with output to ``log_path`` and ``threads`` torch threads; with
    ``slice_steps``, ready to stop itself at the end of each slice of that many steps (:class:`SliceGate`).
    Returns the exit code ``stratum train`` would have: 0, 2 (bad input, NaN loss) or 130 (stopped by a signal
    after a checkpoint). Leaves the process as it found it (output, threads, lock), so a long-lived worker can
    run another segment next."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    lock = None
    code = 0
    try:
        lock = _lock_job_dir(Path(config_path).parent, LOCK_TIMEOUT_S)
        cfg = load_config(config_path, [f"train.device={device!r}"] if device is not None else [])
        gate = SliceGate(Path(config_path).parent, slice_steps, stop_at) if slice_steps else None
        train(cfg, stop_at=stop_at, after_step=gate)
    except StratumError as e:
        print(f"stratum: error: {e}", file=sys.stderr)
        code = e.exit_code
    except KeyboardInterrupt:
        code = INTERRUPTED_EXIT
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if lock is not None:
            os.close(lock)
        for target, fd_saved in zip((1, 2), saved):
            os.dup2(fd_saved, target)
            os.close(fd_saved)
        torch.set_num_threads(threads_before)
    return code


class Worker(Protocol):
    """What the runner needs of a backend's running segment."""

    pid: int | None
    """Its process id on this machine (None on another machine)."""
    sentinel: int | None
    """A file descriptor that becomes readable when it ends, which the runner waits on so that a freed slot is
    refilled at once (None: the runner finds its end by polling)."""

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs."""

    def terminate(self) -> None:
        """Ask it to stop after its current step, with a checkpoint."""

    def kill(self) -> None:
        """Stop it now."""

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for it to end."""


@dataclass(kw_only=True)
class Segment:
    """A worker running one job from its last checkpoint to ``stop_at``."""

    job: str
    """Job id."""
    slot: int
    """The slot it occupies."""
    start_step: int
    """The step of the checkpoint it resumes from (0: none)."""
    stop_at: int
    """The step it stops at (a rung, a time slice's end, or the job's train.steps)."""
    worker: Worker
    """The backend's handle on it."""
    log_path: Path
    """Its stdout and stderr."""
    started: float
    """time.monotonic() at launch."""
    slice_from: int = 0
    """The step its current time slice started at (slice_by = pause)."""
    paused_at: float | None = None
    """time.monotonic() when it was paused (slice_by = pause), None while it runs."""
    paused_s: float = 0.0
    """Seconds it spent paused, left out of its running time."""
    progress_step: int = -1
    """The last step its metrics showed (stall detection)."""
    progress_run_s: float = 0.0
    """Its running seconds when that step was first seen."""

    def poll(self) -> int | None:
        return self.worker.poll()

    def run_s(self) -> float:
        """Seconds it has been running (not paused) since launch."""
        now = self.paused_at if self.paused_at is not None else time.monotonic()
        return now - self.started - self.paused_s


class Backend(Protocol):
    """Where segments run: local worker processes or Ray actors."""

    def warm_up(self) -> None:
        """Get workers ready (imports, actors) before the first segment."""

    def start(self, *, job: str, slots: tuple[int, ...], config_path: Path, start_step: int, stop_at: int,
              devices: tuple[str, ...] | None, threads: int, log_path: Path, slice_steps: int) -> Segment:
        """Start a segment of ``job`` on ``slots`` (on ``devices``, one per slot; None: the job's own
        train.device): one process, or for a plan over several slots one rank on each (``threads`` threads
        each); the segment sits on the first. ``slice_steps`` (slice_by = pause; 0: none): the worker stops
        itself at each slice end the sweep asks for (:class:`SliceGate`)."""

    def start_shard_worker(self, spec_path: Path, cpus: int, gpus: int) -> Worker:
        """Start sharded-lrtf's one worker (:func:`stratum.sweep.shard_worker.run_shard_worker` over
        ``spec_path``), with ``cpus`` CPUs and ``gpus`` GPUs for all its slots."""

    def worker_devices(self, devices: list[str]) -> list[str]:
        """The names sharded-lrtf's worker knows the slots' ``devices`` by where it runs."""

    def close(self) -> None:
        """Release the workers."""


def stop_segment(seg: Segment, *, grace_s: float) -> int | None:
    """Ask it to stop (the trainer checkpoints after its current step and exits), then kill it after
    ``grace_s``."""
    if seg.poll() is None:
        seg.worker.terminate()
    return await_stop(seg, grace_s=grace_s)


def await_stop(seg: Segment, *, grace_s: float) -> int | None:
    """Wait up to ``grace_s`` for a segment already asked to stop, then kill it. It is not asked again: a second
    SIGTERM tells the trainer to stop at once, without the checkpoint the first one asked for."""
    seg.worker.join(grace_s)
    if seg.poll() is None:
        seg.worker.kill()
        seg.worker.join(grace_s)
    return seg.poll()


def failure_reason(returncode: int, log_path: Path) -> str:
    """Why a worker ended badly, in one line: its signal, or the error line it printed."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"worker died ({name})"
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    errors = [ln.removeprefix("stratum: error:") for ln in lines if ln.startswith("stratum: error:")]
    last = errors[-1] if errors else (lines[-1] if lines else "")
    if not last.strip():
        return f"exit code {returncode}: the worker printed nothing (it failed before training; see {log_path})"
    return f"exit code {returncode}: {last.strip()[:200]}"


def diverged(records: list[dict]) -> str | None:
    """The first non-finite training loss of a run's records, as a reason, or None."""
    for r in records:
        if not (abs(r["loss"]) < float("inf")):
            return f"loss became {r['loss']} at step {r['step']}"
    return None


def checkpoint_step(out_dir: Path) -> int:
    """The step of the job's latest checkpoint (where its next segment resumes), 0 without one."""
    ckpt = latest_checkpoint(out_dir)
    return json.loads((ckpt / "meta.json").read_text())["step"] if ckpt is not None else 0


def checkpointed_values(out_dir: Path, records: list[dict]) -> dict:
    """The step, loss and eval loss of the job's latest checkpoint — where it resumes, what a stopped or failed
    job has reached (step 0 without one)."""
    step = checkpoint_step(out_dir)
    upto = [r for r in records if r["step"] <= step]
    evals = [r["eval_loss"] for r in upto if "eval_loss" in r]
    return dict(step=step, loss=upto[-1]["loss"] if upto else None, eval_loss=evals[-1] if evals else None)


def segment_records(cfg: Config) -> list[dict]:
    """The job's metrics records so far (one consistent run: the trainer drops records past a checkpoint)."""
    return read_metrics(Path(cfg.train.out_dir))


def result_values(records: list[dict], start: int) -> dict:
    """What the state records of a job whose last segment began at step ``start`` and ended well: its last step,
    loss and eval loss, and its median throughput over that segment."""
    last = records[-1]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    tps = sorted(r["tokens_per_s"] for r in records if r["step"] > start) or [last["tokens_per_s"]]
    return dict(step=last["step"], loss=last["loss"], eval_loss=evals[-1] if evals else None,
                tokens_per_s=tps[len(tps) // 2], reason="")
