"""A sweep's worker processes die with the sweep: on Linux the kernel kills a worker when its parent dies
(``PR_SET_PDEATHSIG``), so a killed sweep never leaves a job writing to its directory behind the next one."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from stratum.procs import pid_alive

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def die_with_sweep(sweep_pid: int) -> None:
    """Arm the death signal; exit now if the sweep died before it was armed (nobody waits for us)."""
    _die_with_parent()
    if not pid_alive(sweep_pid):
        os._exit(1)
