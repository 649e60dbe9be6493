"""Atomic file writes: write a temp file beside the target, fsync, then rename over it.

A reader (or a resumed run after a kill) sees either the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (same-directory temp file + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_replace_dir(tmp_dir: str | os.PathLike, final_dir: str | os.PathLike) -> None:
    """Move a fully written ``tmp_dir`` to ``final_dir``; an existing ``final_dir`` is replaced.

    The old directory is renamed aside first and removed only after the new one is in place, so a kill at
    any point leaves either the old or the new directory under ``final_dir`` (plus, at worst, a stale aside copy).
    """
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    aside = final_dir.with_name(f".{final_dir.name}.old")
    if aside.exists():
        shutil.rmtree(aside)
    if final_dir.exists():
        os.replace(final_dir, aside)
    os.replace(tmp_dir, final_dir)
    if aside.exists():
        shutil.rmtree(aside, ignore_errors=True)
