"""Processes: whether one still lives (for files and locks that carry the pid of the process that made them), and
the cores this one may run on."""

from __future__ import annotations

import os
from pathlib import Path


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
