"""The sweep directory's run lock: one ``stratum sweep`` runs a sweep at a time, and ``stratum sweep status`` can
tell a running sweep from one that was killed (its jobs still recorded as running) without taking the lock."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from stratum.errors import StratumError

LOCK_FILE = ".lock"


def hold(sweep_dir: Path) -> IO[str]:
    """Hold an exclusive lock on the sweep directory until the returned file is closed: two sweeps must not run
    the same jobs."""
    fh = open(sweep_dir / LOCK_FILE, "w")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        raise StratumError(f"another sweep is running in {sweep_dir}; wait for it, or use "
                           "`stratum sweep status DIR` to watch it") from None
    return fh


def held(sweep_dir: Path) -> bool | None:
    """Whether a sweep holds ``sweep_dir``'s lock now; None where this system does not say. Read from
    /proc/locks rather than by trying the lock: a status query must never make a sweep starting at that moment
    find its directory locked."""
    path = sweep_dir / LOCK_FILE
    try:
        st = os.stat(path)
        table = Path("/proc/locks").read_text()
    except FileNotFoundError:
        return False if not path.exists() else None
    except OSError:
        return None
    # each line: "N: FLOCK ADVISORY WRITE pid MAJ:MIN:INODE start end"
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(f" {dev} " in f" {line} " and "FLOCK" in line for line in table.splitlines())
