"""Atomic writes (stratum/atomic.py): a regular file is replaced whole; a device or a FIFO named as the output is
written through, never replaced by a regular file; a symbolic link keeps pointing at its (replaced) target; a
refused write is one line and leaves no temp file."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from stratum.atomic import atomic_write_stream, atomic_write_text, check_writable
from stratum.errors import StratumError


def test_a_regular_file_is_replaced_whole(tmp_path):
    out = tmp_path / "a" / "x.json"
    atomic_write_text(out, "one")
    atomic_write_text(out, "two")
    assert out.read_text() == "two" and sorted(p.name for p in out.parent.iterdir()) == ["x.json"]


def test_a_device_is_written_through_not_replaced():
    check_writable("/dev/null", "--json")
    atomic_write_text("/dev/null", "discarded")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    if Path("/dev/full").exists():  # a device that refuses the write: one line, the device left alone
        with pytest.raises(StratumError, match=r"^cannot write --json '/dev/full' \(No space left on device\)"):
            atomic_write_stream("/dev/full", [b"x" * 10], "--json")
        assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_a_fifo_is_written_through_to_its_reader(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    atomic_write_text(fifo, "through the pipe")
    reader.join(timeout=10)
    assert got == ["through the pipe"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_link_keeps_pointing_at_its_replaced_target(tmp_path):
    target = tmp_path / "real.toml"
    target.write_text("old")
    link = tmp_path / "link.toml"
    link.symlink_to(target)
    check_writable(link)
    atomic_write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.toml", "real.toml"]
