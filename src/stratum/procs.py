"""Processes: whether one still lives (for files and locks that carry the pid of the process that made them), the
cores this one may run on, and SIGTERM taken as Ctrl-C by a process that stops others."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path


class Terminated(KeyboardInterrupt):
    """SIGTERM reached a process inside :func:`sigterm_as_interrupt`: it stops as on Ctrl-C."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside: SIGTERM raises :class:`Terminated` (a KeyboardInterrupt), so a launcher or a sweep stops its
    processes with a checkpoint each, as on Ctrl-C — ``timeout``, systemd and Slurm stop jobs with SIGTERM. Only
    the main thread receives signals; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie lingers where PID 1 does not reap); another
    user's process counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; all cores where the OS does not say)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
