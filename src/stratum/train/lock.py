"""One run per ``out_dir``: an exclusive ``flock`` on the directory itself, which the kernel drops when the
holder exits, however it exits — so a killed run never leaves a stale lock, and the lock leaves no file behind.

A launcher that spawns a plan's ranks holds the lock for them and names the directory in ``INHERITED_ENV``; its
rank 0 then runs without taking the lock again (a second ``flock`` from another process would be refused).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from stratum.errors import StratumError

INHERITED_ENV = "STRATUM_OUT_DIR_LOCKED"
# flock on a directory fails this way on file systems without locks (some network file systems): run unlocked
_NO_LOCKS_HERE = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF, errno.EINVAL)


@contextlib.contextmanager
def hold_out_dir(out_dir: Path) -> Iterator[None]:
    """Hold ``out_dir`` (which exists) for this run; another live run holding it is a :class:`StratumError`."""
    key = str(out_dir.resolve())
    if os.environ.get(INHERITED_ENV) == key:  # the launcher that started this rank holds it
        yield
        return
    fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StratumError(f"train.out_dir {str(out_dir)!r} is in use by another stratum run that is still "
                               "running; wait for it to end, or choose another train.out_dir") from None
        except OSError as e:
            if e.errno not in _NO_LOCKS_HERE:
                raise
        yield
    finally:
        os.close(fd)  # releases the lock


def inherited_lock_env(out_dir: Path) -> dict[str, str]:
    """The environment that tells the ranks a launcher spawns that it holds ``out_dir`` for them."""
    return {INHERITED_ENV: str(out_dir.resolve())}
