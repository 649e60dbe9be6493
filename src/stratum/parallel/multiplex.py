"""Multiplexing (DeepPool): a background job runs on the time a foreground job leaves idle.

A burst plan leaves ranks idle through its narrow blocks, a pipeline through its bubbles. A job started with
``train.priority = "background"`` runs under Linux's ``SCHED_IDLE`` policy: the kernel gives it a core only when
no normal-priority thread wants that core, so the foreground keeps its speed and the background takes what is
left. Where ``SCHED_IDLE`` is refused, the fallback is ``nice`` 19 (the weakest ordinary priority: the
background still gets a small share under contention).

GPU kernels do not follow OS priorities; CUDA stream priorities are their counterpart. A stream's priority is a
hint the GPU's block scheduler follows when it picks the next thread block: it does not preempt running blocks.
Every stream torch makes, its default stream included, has priority 0, the *lowest* CUDA has, so a background
job's kernels already sit at the bottom; ``train.priority = "foreground"`` runs the job's kernels on a stream of
the device's highest priority (:func:`priority_stream`), ahead of every other stream's. Priorities order the
streams of one CUDA context — the threads of one process, or the processes sharing one GPU through MPS (the
multi-process service; without it the GPU time-slices between processes and no priority crosses them).

Linux keeps scheduling policy and nice value per thread: :func:`apply_priority` sets every thread the process
has now, and threads started afterwards inherit it from the thread that starts them.
"""

from __future__ import annotations

import contextlib
import os

import torch

from stratum.config import PRIORITIES
from stratum.errors import StratumError

HIGHEST_STREAM_PRIORITY = -1_000
"""Below any device's range: CUDA clamps a stream's priority into [greatest, least], so this asks for the
greatest the device has (-5 on recent GPUs) without a CUDA call before the stream is made."""


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


def apply_priority(priority: str, device: torch.device) -> str:
    """Give this process (every thread) the OS priority ``priority`` names; the line the run prints ("" for
    normal, which is left as it is). The stream a foreground run's kernels take is :func:`priority_stream`'s."""
    if priority not in PRIORITIES:
        raise StratumError(f"train.priority = {priority!r} is not one of: {', '.join(PRIORITIES)}")
    if priority == "normal":
        return ""
    if priority == "foreground":
        if device.type == "cuda":
            return "priority: foreground (CUDA kernels on a stream of the highest priority; normal OS priority)"
        return "priority: foreground (normal OS priority; on a GPU its kernels would take the highest stream priority)"
    tids = _threads()
    if all(_idle(t) for t in tids):
        return "priority: background (SCHED_IDLE: runs only on CPU time other jobs leave idle)"
    for t in tids:
        _nice(t)
    return "priority: background (nice 19; this OS refused SCHED_IDLE)"


def priority_stream(priority: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Where a run's kernels go: for a foreground run on a GPU, a stream of the device's highest priority, made
    current for the calling thread (entered before the model is built, so every tensor of the run is made and
    used on it, and the caching allocator never hands a block across streams); otherwise the thread's current
    stream, unchanged."""
    if priority != "foreground" or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device, priority=HIGHEST_STREAM_PRIORITY))
