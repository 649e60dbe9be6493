"""Where training text comes from: a file, a directory of text files, or the built-in default.

The default, ``stdlib``, is the running Python's standard-library sources (about 30 MB of real text on every
machine, nothing to download). Files are taken in sorted path order so every machine sees the same stream.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from stratum.errors import StratumError

STDLIB = "stdlib"
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git", ".hg", ".svn", "node_modules"}
_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class Corpus:
    spec: str
    """What the user wrote (a path or ``stdlib``)."""
    files: tuple[Path, ...]
    """The text files, in the order they are read."""

    @property
    def files_text(self) -> str:
        """How many files, in words ("1 file", "1,203 files")."""
        n = len(self.files)
        return f"{n:,} file" if n == 1 else f"{n:,} files"

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def fingerprint(self) -> str:
        """Changes when any file is added, removed, resized or touched (keys the token cache)."""
        h = hashlib.sha256()
        for f in self.files:
            st = f.stat()
            h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return h.hexdigest()[:16]

    def iter_bytes(self):
        for f in self.files:
            yield f.read_bytes()


def _is_text(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            head = fh.read(_SNIFF_BYTES)
    except OSError:
        return False
    return b"\0" not in head


def _walk(root: Path, suffix: str | None) -> list[Path]:
    """The files under ``root`` in sorted order, following linked directories; each directory is read once (a
    link back into the tree, or two links to one place, add nothing)."""
    out = []
    seen = {os.path.realpath(root)}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        keep = []
        for d in sorted(dirnames):
            real = os.path.realpath(os.path.join(dirpath, d))
            if d in _SKIP_DIRS or d.startswith(".") or real in seen:
                continue
            seen.add(real)
            keep.append(d)
        dirnames[:] = keep
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            p = Path(dirpath) / name
            if (suffix is None or name.endswith(suffix)) and p.is_file():
                out.append(p)
    return out


def resolve_corpus(spec: str) -> Corpus:
    """Turn ``data.corpus`` into a list of readable, non-empty text files, or a one-line error."""
    if spec == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in _walk(root, ".py") if p.stat().st_size > 0]
        if not files:
            raise StratumError(f"the built-in corpus found no Python sources under {root}; "
                               "set data.corpus to a text file or directory")
        return Corpus(spec, tuple(files))
    path = Path(spec).expanduser()
    if not path.exists():
        raise StratumError(f"data.corpus {spec!r} does not exist; give a text file, a directory of text files, "
                           f"or '{STDLIB}' for the built-in corpus")
    if path.is_file():
        if not _is_text(path):
            raise StratumError(f"data.corpus {spec!r} is not a text file (it holds NUL bytes)")
        files = [path]
    else:
        files = [p for p in _walk(path, None) if _is_text(p)]
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise StratumError(f"data.corpus {spec!r} holds no text: give a non-empty text file or directory")
    return Corpus(spec, tuple(files))
