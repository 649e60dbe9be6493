"""A local rank forked from the warm forkserver, behaving as the ``python <argv>`` process it replaces.

The child takes the launcher's environment plus its rank's variables (set before anything reads them; torch is
already imported, so its thread count is set from ``OMP_NUM_THREADS`` here), the launcher's stdin and stdout, a
pipe for stderr, and runs ``-m module …`` or ``script …`` as ``__main__`` with the same ``sys.argv``. It exits
as an interpreter does: a ``SystemExit`` code, 1 and a traceback for an uncaught exception, death by SIGINT for
an uncaught ``KeyboardInterrupt``, after non-daemon threads, atexit handlers and stream flushes (the stdlib's
forked-child bootstrap would skip atexit and exit 1 on Ctrl-C). Interpreter-wide state set at start-up (hash seed,
``-X`` flags, ``PYTHON*`` variables read only then) is the server's.

:class:`ForkedRank` gives the launcher the part of ``subprocess.Popen`` it uses.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import runpy
import signal
import subprocess
import sys
import threading
from typing import NoReturn

import torch

from stratum.dist.forked import PassedFd, start_forked
from stratum.dist.roles import RANK_PRELOAD


class ForkedRank:
    """A forked rank as the launcher sees it: ``pid``, ``stderr`` (text lines), ``poll``, ``wait``,
    ``send_signal``, ``kill`` and ``returncode`` as ``subprocess.Popen`` has them."""

    def __init__(self, argv: list[str], env: dict[str, str], name: str):
        read, write = os.pipe()
        stdio = (_passed(0), _passed(1), PassedFd(write))
        try:
            self.proc = start_forked(rank_main, (list(argv), dict(env), stdio), name=name, preload=RANK_PRELOAD,
                                     death_signal=signal.SIGTERM)
        finally:
            os.close(write)
        self.pid = self.proc.pid
        self.stderr = open(read, errors="replace")  # noqa: SIM115 - read to its end by the launcher's pump

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(["rank", str(self.pid)], timeout or 0.0)
        return self.proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self.proc.exitcode is None and self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _passed(fd: int) -> PassedFd | None:
    """``fd`` for the child, None where this process has it closed."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    return PassedFd(fd)


Stdio = tuple[PassedFd | None, PassedFd | None, PassedFd]
"""stdin, stdout (None where the launcher has it closed), the stderr pipe."""


def rank_main(argv: list[str], env: dict[str, str], stdio: Stdio) -> NoReturn:
    """The forked rank: adopt ``env`` and the passed streams (stdin, stdout where the launcher has them; the
    stderr pipe), run ``python <argv>``'s program and exit as that interpreter would."""
    os.environ.clear()
    os.environ.update(env)
    _adopt_streams(stdio)
    if "OMP_NUM_THREADS" in env:  # what torch would have read at its start
        with contextlib.suppress(ValueError, RuntimeError):
            torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
    code, interrupted = _run_program(argv)
    _exit_as_interpreter(code, interrupted)


def _adopt_streams(stdio: Stdio) -> None:
    for target, passed in enumerate(stdio):
        if passed is not None:
            os.dup2(passed.fd, target)
            os.close(passed.fd)
    if stdio[0] is not None:
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's stdin, as an interpreter opens it
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream, line_buffering in ((sys.stdout, os.isatty(1)), (sys.stderr, True)):
        if isinstance(stream, io.TextIOWrapper):  # buffered as the interpreter buffers them for these files
            stream.reconfigure(line_buffering=line_buffering, write_through=unbuffered)


def _run_program(argv: list[str]) -> tuple[int, bool]:
    """Run ``argv`` as ``python`` would; (exit code, whether a ``KeyboardInterrupt`` ended it)."""
    try:
        if argv[0] == "-m":
            sys.argv = ["-m", *argv[2:]]  # runpy puts the module's path first
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        return _system_exit_code(e), False
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        return 1, True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1, False
    return 0, False


def _system_exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    sys.stderr.write(f"{e.code}\n")
    return 1


def _exit_as_interpreter(code: int, interrupted: bool) -> NoReturn:
    """The end of an interpreter's run: wait for non-daemon threads, run atexit handlers, flush the streams; an
    uncaught ``KeyboardInterrupt`` ends in death by SIGINT, as ``python`` does."""
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()
    atexit._run_exitfuncs()  # the stdlib's forked child skips them
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)  # as the OS reduces sys.exit(n)
