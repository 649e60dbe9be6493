"""Stratum's messages go through Python's ``logging``: one ``stratum`` logger, a child per module
(``logging.getLogger(__name__)``), so a user's script, a Ray worker or torchrun routes them like any library's.

The library configures nothing by itself. The ``stratum`` command (and :func:`stratum.train.trainer.train` when
no handler is configured anywhere) puts a console on top while it runs (:func:`console`): information as plain
lines on standard output, warnings as ``stratum: warning: …`` on standard error. In a process that is not rank 0 of a
multi-process run (``RANK`` > 0) the console shows warnings only, so N processes print one run's lines once.

To route the messages elsewhere, configure logging before Stratum runs, e.g.
``logging.getLogger("stratum").addHandler(handler)`` plus ``setLevel(logging.INFO)``, or ``logging.basicConfig(
level=logging.INFO)``; the console is then not added.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

LOGGER = "stratum"


class ConsoleHandler(logging.Handler):
    """Information to standard output as is, warnings and errors to standard error with a ``stratum:`` prefix.

    The streams are looked up at each message, not held: a progress bar that redirects ``sys.stdout`` to print
    above itself (rich) and a test's captured streams both receive the lines."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            if record.levelno >= logging.WARNING:
                sys.stderr.write(f"stratum: {record.levelname.lower()}: {text}\n")
                sys.stderr.flush()
            else:
                sys.stdout.write(text + "\n")
                sys.stdout.flush()
        except Exception:  # logging's contract: a failing handler reports through handleError, never raises
            self.handleError(record)


def console_level() -> int:
    """INFO on rank 0 (or a single process), WARNING on the other ranks of a multi-process run."""
    try:
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        rank = 0
    return logging.INFO if rank == 0 else logging.WARNING


@contextlib.contextmanager
def console() -> Iterator[logging.Handler]:
    """The console under the ``stratum`` logger while the body runs (the ``stratum`` command's whole run);
    the logger's handlers, level and propagation are as before afterwards. Inside, messages stop at the console
    rather than also reaching the root logger's handlers, which would print them twice. Nested uses share the
    outer console."""
    logger = logging.getLogger(LOGGER)
    present = [h for h in logger.handlers if isinstance(h, ConsoleHandler)]
    if present:
        yield present[0]
        return
    saved = logger.level, logger.propagate
    handler = ConsoleHandler()
    logger.addHandler(handler)
    logger.setLevel(console_level())
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


@contextlib.contextmanager
def console_unless_configured() -> Iterator[None]:
    """:func:`console` around the body when no handler would receive Stratum's messages (logging left
    unconfigured): the Python API then prints what the command prints, and configured logging is left alone."""
    if logging.getLogger(LOGGER).hasHandlers():
        yield
    else:
        with console():
            yield
