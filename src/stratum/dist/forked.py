"""Processes forked from a warm ``forkserver`` that die with the process that started them.

Importing torch, ``torch._dynamo`` (which the first optimizer step imports) and Stratum takes seconds of CPU; a
forkserver (stdlib ``multiprocessing``) pays that once, in a server process started by exec, and forks each new
process from it in milliseconds. The server is a process-wide singleton: every caller's preload joins one list, and
a server already running serves later calls as it is (a module it did not preload is imported by the child).

A forked child's parent is the server, not its client, so the child's death signal (``PR_SET_PDEATHSIG``) fires
when the server exits; the server exits when its client dies (the end of its "alive" pipe closes), provided no
child keeps that pipe open — so each child closes its copy first thing (:func:`_forked_main`).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from stratum.procs import pid_alive

_PR_SET_PDEATHSIG = 1
_PRELOAD: list[str] = []
"""Every caller's preload, in the order asked for: the server that starts next imports them all."""


def usable() -> bool:
    """The forkserver and the death signal exist here (Linux)."""
    return sys.platform.startswith("linux") and "forkserver" in multiprocessing.get_all_start_methods()


def die_with_parent(sig: signal.Signals) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))


def die_with(pid: int, sig: signal.Signals) -> None:
    """Arm the death signal; exit now if ``pid`` (who started us) died before it was armed (nobody waits for
    us)."""
    die_with_parent(sig)
    if not pid_alive(pid):
        os._exit(1)


def context(preload: Sequence[str]) -> multiprocessing.context.ForkServerContext:
    """The forkserver context, ``preload`` added to the modules its server imports when it starts."""
    ctx = multiprocessing.get_context("forkserver")
    _PRELOAD.extend(m for m in preload if m not in _PRELOAD)
    ctx.set_forkserver_preload(["stratum.dist.server_start", *_PRELOAD, "stratum.dist.server_exit"])
    return ctx


def warm_up(preload: Sequence[str]) -> None:
    """Start the server now (its imports take seconds), so it is ready when the first process is forked."""
    context(preload)
    multiprocessing.forkserver.ensure_running()


def start_forked(target: Callable[..., object], args: tuple, *, name: str, preload: Sequence[str],
                 death_signal: signal.Signals) -> multiprocessing.process.BaseProcess:
    """Fork ``target(*args)`` from the warm server; it gets ``death_signal`` when this process dies."""
    proc = context(preload).Process(target=_forked_main, name=name, daemon=False,
                                    args=(target, args, os.getpid(), death_signal))
    proc.start()
    return proc


def _forked_main(target: Callable[..., object], args: tuple, client_pid: int, death_signal: signal.Signals) -> None:
    """A forked child's first steps: stop holding the server alive, die with it, then run ``target``."""
    server: Any = multiprocessing.forkserver._forkserver
    if server._forkserver_alive_fd is not None:  # the stdlib hands every child the client's end of the pipe
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    die_with(client_pid, death_signal)
    target(*args)


class PassedFd:
    """A file descriptor that travels to a forked child: pickled while the child starts, it arrives there as a
    descriptor of the child's own (the server passes it over its socket)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _arrived, (multiprocessing.reduction.DupFd(self.fd),)


def _arrived(dup) -> PassedFd:
    return PassedFd(dup.detach())
