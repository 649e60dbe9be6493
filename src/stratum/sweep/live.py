"""What a person watching a sweep on a terminal sees: the jobs' table redrawn in place (rich), running jobs'
step, loss and tokens/s read from the last line of their metrics; progress lines print above it. Off a terminal
the sweep prints plain lines only."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.text import Text

from stratum.sweep.results import table
from stratum.sweep.state import RUNNING, JobRow

REFRESH_S = 1.0


def tail_records(metrics: Path, nbytes: int = 4096) -> list[dict]:
    """The complete JSON lines of a metrics file's last ``nbytes`` (read from its end: the file grows with every
    step), oldest first."""
    try:
        with open(metrics, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written, or the cut start of the window
    return out


def last_record(metrics: Path) -> dict | None:
    """The last complete JSON line of a metrics file."""
    records = tail_records(metrics)
    return records[-1] if records else None


EVAL_WINDOW = 1 << 16
"""The bytes of a running job's metrics read for its latest eval loss: a few hundred steps' records."""


def with_progress(rows: list[JobRow], sweep_dir: Path) -> list[JobRow]:
    """Running jobs' rows with their latest step, loss and throughput, and their latest eval loss where the
    metrics' tail holds one (a job killed with its sweep was never harvested: its state holds none)."""
    out = []
    for r in rows:
        records = tail_records(sweep_dir / "jobs" / r.id / "metrics.jsonl", EVAL_WINDOW) \
            if r.status == RUNNING else []
        if records:
            rec = records[-1]
            evals = [x["eval_loss"] for x in records if "eval_loss" in x]
            r = dataclasses.replace(r, step=rec["step"], loss=rec["loss"], tokens_per_s=rec["tokens_per_s"],
                                    eval_loss=evals[-1] if evals else r.eval_loss)
        out.append(r)
    return out


def as_interrupted(rows: list[JobRow]) -> list[JobRow]:
    """``rows`` with the jobs recorded as running shown as interrupted: their sweep is no longer running."""
    return [dataclasses.replace(r, status="interrupted") if r.status == RUNNING else r for r in rows]


class LiveTable:
    """The table on a terminal, redrawn at most every REFRESH_S."""

    def __init__(self, console: Console):
        self.console = console
        self.live = Live(console=console, auto_refresh=False, transient=True)
        self.live.start()
        self._last = 0.0

    def say(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False)

    def tick(self, rows: list[JobRow], sweep_dir: Path) -> None:
        if time.monotonic() - self._last >= REFRESH_S:
            self._last = time.monotonic()
            self.live.update(Text(table(with_progress(rows, sweep_dir))), refresh=True)

    def close(self) -> None:
        self.live.stop()
