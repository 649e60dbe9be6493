"""``stratum <args>`` run by the command line's ``main`` in the test process, which is then the launcher of any
ranks the plan needs: they are real gloo processes, forked from the one warm forkserver this test process keeps,
rather than a fresh interpreter and forkserver for every run (seconds of imports each). Tests of what a fresh
process does (exit codes of killed or hung runs, signals, tracebacks) run ``python -m stratum`` instead."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from unittest import mock

from stratum.cli import main


def run_main(args: list[str]) -> tuple[int, str]:
    """The exit code of ``stratum <args>`` and what it and its ranks printed (stdout and stderr together), with
    one intra-op thread per process as ``make test`` runs."""
    with printed() as out:
        code = main(args)
    return code, out[0]


@contextlib.contextmanager
def printed() -> Iterator[list[str]]:
    """Collects what is written inside the block to sys.stdout, sys.stderr and file descriptors 1 and 2 (where
    forked ranks write); the yielded list holds the text once the block ends."""
    text: list[str] = []
    with tempfile.TemporaryFile("w+") as f, mock.patch.dict(os.environ, OMP_NUM_THREADS="1"):
        with _descriptors_to(f.fileno()), contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            yield text
        f.seek(0)
        text.append(f.read())


@contextlib.contextmanager
def _descriptors_to(fd: int) -> Iterator[None]:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        for target, copy in enumerate(saved, start=1):
            os.dup2(copy, target)
            os.close(copy)
