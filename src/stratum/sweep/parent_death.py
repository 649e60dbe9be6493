"""A sweep's worker processes die with the sweep: on Linux the kernel kills a worker when its parent dies
(``PR_SET_PDEATHSIG``), so a killed sweep never leaves a job writing to its directory behind the next one."""

from __future__ import annotations

import signal

from stratum.dist.forked import die_with


def die_with_sweep(sweep_pid: int) -> None:
    """Arm the death signal (SIGKILL); exit now if the sweep died before it was armed (nobody waits for us)."""
    die_with(sweep_pid, signal.SIGKILL)
