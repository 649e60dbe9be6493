"""Atomic file writes: write a temp file beside the target, fsync, then rename over it (a device or FIFO given as
the target is written through, not replaced; a symbolic link's target is replaced, the link kept).

A reader (or a resumed run after a kill) sees either the old file or the new one, never half of one. A write that
the filesystem refuses (full, read-only, the target a directory, a parent a file) is a one-line
:class:`~stratum.errors.StratumError` naming the file, and leaves no temp file behind.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from stratum.errors import StratumError

# What to do about each way a write fails; anything else gets the generic advice.
_ADVICE = {
    errno.ENOSPC: "the filesystem is full: free space there or write elsewhere",
    errno.EDQUOT: "the disk quota is used up: free space there or write elsewhere",
    errno.EROFS: "the filesystem is read-only: write to a writable location",
    errno.EISDIR: "it is a directory: give a file path",
    errno.ENOTDIR: "a parent of it is a file, not a directory: choose another path",
    errno.EEXIST: "a parent of it is a file, not a directory: choose another path",
    errno.EACCES: "permission denied: choose a location you can write to",
    errno.EPERM: "permission denied: choose a location you can write to",
}


class WriteError(StratumError):
    """A file could not be written; ``reason`` is the operating system's word for why."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def write_error(path: str | os.PathLike, err: OSError, what: str = "") -> WriteError:
    """The one-line error for ``err`` raised while writing ``path`` (``what`` names the file's role)."""
    # mkdir reports a parent that is a file as EEXIST ("File exists"), which reads as the opposite
    reason = "Not a directory" if err.errno == errno.EEXIST else err.strerror or str(err)
    advice = _ADVICE.get(err.errno or 0, "check the path and the space left")
    return WriteError(f"cannot write {what + ' ' if what else ''}{os.fsdecode(path)!r} ({reason}); {advice}",
                      reason)


def _umask() -> int:
    """This process's umask, read where Linux shows it: setting it to read it back would change it for every
    thread for that moment."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The permissions ``open`` gives a new file: 0o666 less the umask. Files written through a temp file (0o600)
    get them, so that a run's results are not hidden from the rest of a team."""
    return 0o666 & ~_umask()


def default_modes(root: Path) -> None:
    """Give ``root`` and everything under it the permissions ``open`` and ``mkdir`` give (0o666 / 0o777 less the
    umask), where a library wrote them owner-only (``tempfile.mkdtemp``'s 0o700, safetensors' 0o600)."""
    mask = _umask()
    files, dirs = 0o666 & ~mask, 0o777 & ~mask
    root.chmod(dirs)
    for p in root.rglob("*"):
        p.chmod(dirs if p.is_dir() else files)


def _mode_for(path: Path) -> int:
    """The permissions of the file ``path`` replaces, or a new file's."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return new_file_mode()


def _destination(path: Path) -> Path:
    """Where a write of ``path`` lands: a symbolic link's target (so the link keeps pointing at the new file,
    not replaced by it), else ``path``."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _special(path: Path) -> bool:
    """``path`` exists and is neither a regular file nor a directory: a device, a FIFO, a socket. Renaming a
    temp file over it would put a regular file in its place (``/dev/null``, ``/dev/stdout``' target): such a
    file is written through instead."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def check_writable(path: str | os.PathLike, what: str = "", suffix: str = "") -> None:
    """Refuse, before any work that ends in writing it, a ``path`` that cannot be written: empty, a directory,
    in a directory that cannot take a file (one-line :class:`WriteError`, as the write itself would give), or
    not ending in ``suffix`` where one is asked for (a chart written as PNG data under another name)."""
    if not str(path).strip():
        raise WriteError(f"no file given for {what or 'the output'}: name one", "empty path")
    path = Path(path)
    if path.is_dir():
        raise write_error(path, OSError(errno.EISDIR, "Is a directory"), what)
    if suffix and path.suffix.lower() != suffix:
        raise WriteError(f"{what} {str(path)!r} must end in {suffix} (it is written as that format)", "suffix")
    path = _destination(path)
    if _special(path):
        if not os.access(path, os.W_OK):
            raise write_error(path, OSError(errno.EACCES, "Permission denied"), what)
        return
    fd, tmp = _temp_beside(path, what)
    os.close(fd)
    os.unlink(tmp)


def _temp_beside(path: Path, what: str = "") -> tuple[int, str]:
    """A new temp file in ``path``'s directory (created as needed): (its descriptor, its name); where the
    directory cannot take it, the one-line error a write of ``path`` gives."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise write_error(path, e, what) from None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (same-directory temp file + ``os.replace``); a refused write is a
    :class:`StratumError` naming ``path``."""
    atomic_write_stream(path, [data])


def atomic_write_stream(path: str | os.PathLike, pieces: Iterable[bytes], what: str = "") -> None:
    """Replace ``path`` with the concatenation of ``pieces``, written as they come (a file too large to build in
    memory first), atomically as :func:`atomic_write_bytes`; ``what`` names the file's role in an error. A device
    or FIFO is written through (:func:`_special`), a link's target replaced."""
    path = _destination(Path(path))
    if _special(path):
        _write_through(path, pieces, what)
        return
    fd, tmp = _temp_beside(path, what)
    try:
        os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "wb") as f:
            for piece in pieces:
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise write_error(path, e, what) from None
        raise


def _write_through(path: Path, pieces: Iterable[bytes], what: str) -> None:
    try:
        with open(path, "wb") as f:
            for piece in pieces:
                f.write(piece)
    except OSError as e:
        raise write_error(path, e, what) from None


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


def file_digest(path: str | os.PathLike) -> dict:
    """Size and SHA-256 of a file, as checkpoints and the token cache record them to detect corruption."""
    with open(path, "rb") as f:
        return {"bytes": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def digest_mismatch(path: str | os.PathLike, want: dict) -> str | None:
    """Why ``path`` is not the file ``want`` (a :func:`file_digest`) describes; None when it is."""
    size = os.stat(path).st_size
    if size != want.get("bytes"):
        written = want.get("bytes")
        return f"{size:,} bytes where {f'{written:,}' if isinstance(written, int) else repr(written)} were written"
    if file_digest(path)["sha256"] != want.get("sha256"):
        return "its SHA-256 differs from the one recorded when it was written"
    return None


def unwritable_dir(key: str, path: Path, err: OSError) -> StratumError:
    """The one-line refusal of a directory setting ``key`` whose ``path`` could not be created or written: a file
    where the directory (or one above it) should be is named as such."""
    if path.is_file() or err.errno == errno.ENOTDIR:
        where = str(path) if path.is_file() else next((str(p) for p in path.parents if p.is_file()), str(path))
        return StratumError(f"{key} {str(path)!r}: {where} is a file, not a directory; choose a directory (or "
                            "move the file away)")
    return StratumError(f"{key} {str(path)!r} is not writable ({err.strerror}); choose a directory you can write to")


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its ancestors that do not exist yet, outermost first."""
    out = []
    p = path.absolute()
    while not p.exists() and p != p.parent:
        out.append(p)
        p = p.parent
    return out[::-1]


def remove_empty_dirs(created: list[Path]) -> None:
    """Remove the directories in ``created`` (made by the failed run) that hold nothing but empty directories;
    anything with a file in it stays."""
    if not created:
        return
    top = created[0]
    if top.is_dir():
        for root, dirs, _ in os.walk(top, topdown=False):
            for d in dirs:
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(root, d))
    for made in reversed(created):
        with contextlib.suppress(OSError):
            os.rmdir(made)
