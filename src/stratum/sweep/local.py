"""The ``local`` backend: each job segment is a worker process that runs the job's training, as ``stratum train
--config jobs/<id>/job.toml --stop-at N`` would.

Workers are forked from a ``forkserver`` that has imported torch and the trainer once, so a segment starts in
milliseconds rather than the seconds an interpreter needs to import torch, and the sweep process's own torch
state (profiling for the planner) never reaches a worker. A worker runs :func:`stratum.train.trainer.train` on
the job's config with its torch threads capped (cores // slots), so the slots share the cores instead of
fighting over them; ``stop_at`` ends a segment at an ASHA rung with a checkpoint and the next segment resumes
from it. On Linux a worker is killed when its parent dies (``PR_SET_PDEATHSIG``; the forkserver exits when the
sweep dies), so a killed sweep never leaves a job writing to its directory behind the next one.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from stratum.config import Config, load_config
from stratum.errors import StratumError
from stratum.train.checkpoint import latest_checkpoint
from stratum.train.trainer import read_metrics, train

_PR_SET_PDEATHSIG = 1
INTERRUPTED_EXIT = 130  # stopped by SIGINT/SIGTERM after a checkpoint, as `stratum train` exits then
LOCK_TIMEOUT_S = 60.0


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    # torch.optim imports torch._dynamo on its first optimizer (≈1.5 s): once in the server, not in every worker
    ctx.set_forkserver_preload(["stratum.sweep.local", "torch._dynamo"])
    return ctx


def warm_up() -> None:
    """Start the forkserver now (its imports take seconds), so it is ready by the first segment."""
    _context()
    multiprocessing.forkserver.ensure_running()


def _sweep_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _lock_job_dir(job_dir: Path, timeout_s: float) -> int:
    """Hold an exclusive lock on the job's directory for this process's life (the kernel drops it when the
    process dies, however it dies): a worker left over from a killed sweep and its successor never train the same
    job at once. Waits up to ``timeout_s`` for a predecessor to go."""
    fd = os.open(job_dir / ".worker.lock", os.O_WRONLY | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise StratumError(f"another worker still trains the job in {job_dir} after {timeout_s:g} s; stop "
                                   "it, then run the sweep again") from None
            time.sleep(0.1)


def worker_main(config_path: str, stop_at: int, device: str | None, threads: int, log_path: str,
                sweep_pid: int) -> None:
    """A segment's process: output to the job's worker.log, then train; exit 0, 2 (bad input, NaN loss, as
    ``stratum train``) or 130 (stopped by a signal after a checkpoint)."""
    _die_with_parent()
    if not _sweep_alive(sweep_pid):  # the sweep died before the death signal was armed: nobody waits for us
        os._exit(1)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    torch.set_num_threads(threads)
    code = 0
    try:
        _lock_job_dir(Path(config_path).parent, LOCK_TIMEOUT_S)
        cfg = load_config(config_path, [f"train.device={device!r}"] if device is not None else [])
        train(cfg, stop_at=stop_at)
    except StratumError as e:
        print(f"stratum: error: {e}", file=sys.stderr)
        code = e.exit_code
    except KeyboardInterrupt:
        code = INTERRUPTED_EXIT
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


@dataclass(kw_only=True)
class Segment:
    """A worker process running one job from its last checkpoint to ``stop_at``."""

    job: str
    """Job id."""
    slot: int
    """The slot it occupies."""
    start_step: int
    """The step of the checkpoint it resumes from (0: none)."""
    stop_at: int
    """The step it stops at (a rung, or the job's train.steps)."""
    proc: multiprocessing.process.BaseProcess
    """The worker process."""
    log_path: Path
    """Its stdout and stderr."""
    started: float
    """time.monotonic() at launch."""

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs."""
        return self.proc.exitcode


def start_segment(*, job: str, slot: int, config_path: Path, start_step: int, stop_at: int, device: str | None,
                  threads: int, log_path: Path) -> Segment:
    """Start a worker that trains the job of ``config_path`` from its last checkpoint to ``stop_at``."""
    proc = _context().Process(target=worker_main, name=f"stratum-sweep-{job}", daemon=False,
                              args=(str(config_path), stop_at, device, threads, str(log_path), os.getpid()))
    proc.start()
    return Segment(job=job, slot=slot, start_step=start_step, stop_at=stop_at, proc=proc, log_path=log_path, started=time.monotonic())


def stop_segment(seg: Segment, *, grace_s: float) -> int | None:
    """SIGTERM (the trainer checkpoints after its current step and exits), then SIGKILL after ``grace_s``."""
    if seg.poll() is None:
        seg.proc.terminate()
        seg.proc.join(grace_s)
        if seg.poll() is None:
            seg.proc.kill()
            seg.proc.join(grace_s)
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


def segment_records(cfg: Config) -> list[dict]:
    """The job's metrics records so far (one consistent run: the trainer drops records past a checkpoint)."""
    return read_metrics(Path(cfg.train.out_dir))
