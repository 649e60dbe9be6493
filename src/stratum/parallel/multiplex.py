"""Multiplexing (DeepPool): a background job runs on the CPU time a foreground job leaves idle.

A burst plan leaves ranks idle through its narrow blocks, a pipeline through its bubbles. A job started with
``train.priority = "background"`` runs under Linux's ``SCHED_IDLE`` policy: the kernel gives it a core only when
no normal-priority thread wants that core, so the foreground keeps its speed and the background takes what is
left. Where ``SCHED_IDLE`` is refused, the fallback is ``nice`` 19 (the weakest ordinary priority: the
background still gets a small share under contention). With CUDA, GPU kernels do not follow these priorities;
low-priority CUDA streams would be the counterpart there and are not used here.

Linux keeps scheduling policy and nice value per thread: :func:`apply_priority` sets every thread the process
has now, and threads started afterwards inherit it from the thread that starts them.
"""

from __future__ import annotations

import os

from stratum.config import PRIORITIES
from stratum.errors import StratumError


def _threads() -> list[int]:
    """Ids of this process's threads (the process id alone where /proc is missing)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")]
    except OSError:
        return [os.getpid()]


def _idle(tid: int) -> bool:
    """Put thread ``tid`` under SCHED_IDLE; False where the OS refuses or lacks it."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return False
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    except OSError:
        return False
    return True


def _nice(tid: int, value: int = 19) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, tid, value)
    except OSError:
        pass  # a thread that ended meanwhile


def apply_priority(priority: str) -> str:
    """Give this process (every thread) the OS priority ``priority`` names; the line the run prints ("" for
    normal, which is left as it is)."""
    if priority not in PRIORITIES:
        raise StratumError(f"train.priority = {priority!r} is not one of: {', '.join(PRIORITIES)}")
    if priority == "normal":
        return ""
    tids = _threads()
    if all(_idle(t) for t in tids):
        return "priority: background (SCHED_IDLE: runs only on CPU time other jobs leave idle)"
    for t in tids:
        _nice(t)
    return "priority: background (nice 19; this OS refused SCHED_IDLE)"


