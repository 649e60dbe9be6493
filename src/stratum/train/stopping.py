"""When the training loop checkpoints and stops early: SIGINT/SIGTERM, the time since the last checkpoint, and a
failed run's empty output directory.

A signal sets a flag; the loop finishes the step in progress, saves a checkpoint and stops, so an interrupted run
resumes where it stopped. Every rank of a multi-process run decides together (:func:`agree`): the checkpoint is a
collective, and a rank that saved alone would wait forever on the others.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from stratum.atomic import missing_dirs, remove_empty_dirs
from stratum.dist.roles import is_worker

if TYPE_CHECKING:
    from stratum.dist.world import World

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_local = threading.local()


def set_stop_check(check: Callable[[], str | None] | None) -> None:
    """What the training loop of the calling thread asks after every step beside the signals — the reason to stop
    after it, or None: a multi-job worker's stop, since its jobs' threads get no signals (None: no check)."""
    _local.check = check


class Interrupted(KeyboardInterrupt):
    """The run stopped at a signal, after a checkpoint (``stratum`` exits with code 130, as after Ctrl-C)."""


class StopSignals:
    """While installed, SIGINT and SIGTERM ask the loop to stop after the current step (``received``) instead of
    ending the process. In a single process a second signal acts as usual (Ctrl-C twice stops at once; the
    checkpoint being written is a temporary directory until renamed, so nothing is corrupted). A pipeline worker
    ignores repeats: Ctrl-C reaches it both from the terminal and from the launcher that forwards it, and the
    launcher kills workers that outlast its grace period anyway."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._escalate = not is_worker()
        # every rank stops at the same step (they agree), so one line says it for all: rank 0's
        self._speaks = os.environ.get("RANK", "0") == "0"
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def requested(self) -> str | None:
        """Why the loop should stop after this step: a signal's name, or the calling thread's stop check's
        reason (:func:`set_stop_check`); None to go on."""
        if self.received is None and (check := getattr(_local, "check", None)) is not None:
            self.received = check()
        return self.received

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # Python handles signals there only
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            # (on a terminal the line starts below a progress bar; a pipe — a rank's, to its launcher — gets no
            # empty line)
            if self._speaks:
                print(f"{chr(10) if sys.stderr.isatty() else ''}stratum: {self.received}: stopping after this step "
                      "with a checkpoint" + (" (again to stop at once)" if self._escalate else ""), file=sys.stderr,
                      flush=True)
            if self._escalate:
                self.restore()


class CheckpointClock:
    """Time since the last checkpoint against ``train.ckpt_minutes`` (0 = never due by time)."""

    def __init__(self, minutes: float) -> None:
        self.seconds = minutes * 60.0
        self.last = time.monotonic()

    def due(self) -> bool:
        return self.seconds > 0 and time.monotonic() - self.last >= self.seconds

    def saved(self) -> None:
        self.last = time.monotonic()


def agree(flags: list[bool], world: World) -> list[bool]:
    """Each flag true on every rank if it is true on any (the identity without a multi-process group).

    Waited on within the world's timeout, as every collective is: a peer that died or hung between steps
    becomes a PeerError here, not a bare gloo error (or, with NCCL, a wait without end)."""
    import torch.distributed as dist
    if world.backend == "none" or dist.get_world_size() == 1:
        return flags
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=world.device)
    world.wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True), "agreeing on a checkpoint or stop")
    return [bool(x) for x in t.tolist()]


def removes_new_empty_out_dir(fn):
    """Decorate ``fn(cfg, ...)`` (a run writing to ``cfg.train.out_dir``): if it fails, the directories it created
    for its output and left empty are removed — a run refused for bad input leaves nothing behind. A directory
    that existed before, or that holds a file, is never touched."""
    @functools.wraps(fn)
    def wrapper(cfg, *args, **kwargs):
        created = missing_dirs(Path(cfg.train.out_dir).expanduser())
        try:
            return fn(cfg, *args, **kwargs)
        except BaseException:
            remove_empty_dirs(created)
            raise
    return wrapper
