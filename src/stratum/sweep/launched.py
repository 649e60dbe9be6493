"""A job that holds several slots: one ordinary multi-process ``stratum train`` run of its plan (``replicate(k)``,
``pipeline(k)``: k gloo processes, each with the job's threads), as a person runs ``stratum train --config
jobs/<id>/job.toml``.

The launcher (``python -m stratum train``) spawns the ranks and waits for them with the plan's time limits: a
rank that dies or hangs stops the others (``stratum.dist.launch.spawn_local``), so a dead rank ends the run with
an error line, never a hung sweep. The launcher leads a process group of its own (its ranks are in it), so the
sweep can kill a whole run at once; it dies with the sweep (``PR_SET_PDEATHSIG``), and its ranks then stop with a
checkpoint (their own death signal, SIGTERM).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import weakref
from pathlib import Path

from stratum.errors import StratumError
from stratum.sweep.parent_death import die_with_sweep

LAUNCH_ENV_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "STRATUM_WORKER")
"""A sweep started inside a launched job must not hand its rank to the runs it launches."""


class LaunchedWorker:
    """A ``stratum train`` launcher and its ranks (the runner's :class:`~stratum.sweep.segment.Worker`)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.pid: int | None = proc.pid
        self.sentinel = _pidfd(proc.pid)
        if self.sentinel is not None:
            weakref.finalize(self, os.close, self.sentinel)

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        """SIGTERM to the launcher: it asks every rank to stop after its step with a checkpoint, then exits
        130."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the launcher and its ranks (its process group)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def join(self, timeout_s: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)


def _pidfd(pid: int) -> int | None:
    """A descriptor of child ``pid`` that becomes readable when it exits (Linux ≥ 5.3); None where there is none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def train_command(config_path: Path | str, stop_at: int, sets: list[str] | None = None) -> list[str]:
    """``stratum train --config config_path --stop-at stop_at [--set …]`` as this interpreter runs it."""
    return [sys.executable, "-m", "stratum", "train", "--config", str(config_path), "--stop-at", str(stop_at),
            *[a for kv in sets or [] for a in ("--set", kv)]]


def device_kind(devices: tuple[str, ...]) -> list[str]:
    """The ``--set`` that names the kind of a job's slots' ``devices`` (a job's ranks run on one kind)."""
    if all(d == "cpu" for d in devices):
        return ["train.device='cpu'"]
    if not all(d.startswith("cuda") for d in devices):
        raise StratumError(f"a job over slots on {', '.join(devices)} mixes device kinds; give sweep.devices of "
                           "one kind (all cuda:N or all cpu)")
    return ["train.device='cuda'"]


def rank_devices(devices: tuple[str, ...], visible: str | None) -> tuple[list[str], dict[str, str]]:
    """A job over slots on ``devices`` (one per rank, in rank order), its ranks started on this machine: the
    ``--set`` that names their kind and the environment that gives rank r the r-th — its CUDA devices made
    visible in rank order (through ``visible``, the sweep's own CUDA_VISIBLE_DEVICES, where set), so that a
    rank's cuda:LOCAL_RANK is its slot's GPU."""
    sets = device_kind(devices)
    if devices[0] == "cpu":
        return sets, {}
    index = [int(d[5:]) if d.startswith("cuda:") else 0 for d in devices]
    names = visible.split(",") if visible else [str(i) for i in range(max(index) + 1)]
    return sets, {"CUDA_VISIBLE_DEVICES": ",".join(names[i] for i in index)}


def job_env(threads: int) -> dict[str, str]:
    """This process's environment for a job's run: no rank of its own (:data:`LAUNCH_ENV_DROP`), ``threads``
    torch threads per process."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV_DROP}
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def launch_train(config_path: Path, stop_at: int, threads: int, log_path: Path,
                 devices: tuple[str, ...] | None = None) -> LaunchedWorker:
    """Start ``stratum train --config config_path --stop-at stop_at`` with ``threads`` torch threads per rank
    (rank r on ``devices[r]`` where given), its output appended to ``log_path``."""
    sweep_pid = os.getpid()
    sets, env = rank_devices(devices, os.environ.get("CUDA_VISIBLE_DEVICES")) if devices else ([], {})
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            train_command(config_path, stop_at, sets), stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, env=dict(job_env(threads), **env), start_new_session=True,
            preexec_fn=lambda: die_with_sweep(sweep_pid))
    return LaunchedWorker(proc)


def group_alive(pid: int) -> bool:
    """A process of the group ``pid`` leads (a launcher's ranks) still runs."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
