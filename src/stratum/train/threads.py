"""torch's intra-op threads for a run: ``train.threads``, or (0 = auto) the cores this process may use shared
among the plan's processes on this machine.

torch starts one OpenMP thread per physical core whatever the process may use; on a busy 2-core machine two
threads per process ran 10-14× slower than one, because threads of several processes (or of one process
restricted by ``taskset``/a cpuset) then wait on each other's cores.
"""

from __future__ import annotations

import os

import torch

from stratum.procs import usable_cores


def local_processes() -> int:
    """Processes of this run on this machine (the launcher's or torchrun's ``LOCAL_WORLD_SIZE``; 1 alone)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def auto_threads() -> int:
    """Threads that keep this process on its share of the usable cores, and never more than torch has now (a
    caller that already lowered them, such as a sweep's worker, keeps its choice)."""
    return threads_among(local_processes())


def threads_among(processes: int) -> int:
    """Threads :func:`auto_threads` gives each of ``processes`` local processes of one run."""
    return max(1, min(torch.get_num_threads(), usable_cores() // processes))


def apply_threads(requested: int) -> str:
    """Set torch's intra-op threads to ``requested`` (0 = :func:`auto_threads`); the line the run prints."""
    n = requested or auto_threads()
    torch.set_num_threads(n)
    why = "train.threads" if requested else (f"auto: {usable_cores()} usable core(s) / {local_processes()} "
                                            "process(es) here; set train.threads to choose")
    return f"threads: {n} intra-op ({why})"
