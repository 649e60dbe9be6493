"""What a sweep leaves for people: a table of jobs (sorted by eval loss), ``results.csv`` and the makespan line
(from ``makespan.json``). Light on imports: ``stratum sweep status`` uses it without torch."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from stratum.sweep.state import JobRow

COLUMNS = ("id", "status", "step", "steps", "loss", "eval_loss", "tokens_per_s", "slot", "attempts", "run_s",
           "label", "reason")


def ranked(rows: list[JobRow]) -> list[JobRow]:
    """Best eval loss first; jobs without one (stopped early, failed, unfinished) after, by training loss."""
    def key(r: JobRow):
        return (r.eval_loss is None, _finite(r.eval_loss), r.loss is None, _finite(r.loss), r.idx)
    return sorted(rows, key=key)


def _finite(v: float | None) -> float:
    return v if v is not None and math.isfinite(v) else math.inf


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[JobRow]) -> str:
    """The jobs as a plain-text table, best first."""
    head = f"{'job':<6} {'status':<11} {'step':>11} {'loss':>8} {'eval':>8} {'tok/s':>9} {'slot':>4}  values"
    lines = [head]
    for r in ranked(rows):
        lines.append(f"{r.id:<6} {r.status:<11} {f'{r.step}/{r.steps}':>11} {_fmt(r.loss, '.4f'):>8} "
                     f"{_fmt(r.eval_loss, '.4f'):>8} {_fmt(r.tokens_per_s, ',.0f'):>9} {_fmt(r.slot, 'd'):>4}  "
                     f"{r.label}" + (f"  ({_clip(r.reason, 90)})" if r.reason else ""))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines.append(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return "\n".join(lines)


def results_csv(rows: list[JobRow]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(COLUMNS)
    for r in ranked(rows):
        w.writerow([getattr(r, c) if getattr(r, c) is not None else "" for c in COLUMNS])
    return buf.getvalue()


MAKESPAN_FILE = "makespan.json"
"""In the sweep directory: the scheduler, its predicted makespan (SIMULATED, written before the first job) and the
measured one (written at the end)."""


def read_makespan(sweep_dir: Path) -> dict | None:
    """``makespan.json``'s document (None: not written, or not readable as one)."""
    try:
        doc = json.loads((sweep_dir / MAKESPAN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def makespan_line(doc: dict) -> str:
    """The measured makespan beside the predicted one, as far as either is known."""
    measured, predicted = doc.get("measured_s"), doc.get("predicted_s")
    if measured is None:
        line = "makespan: not measured yet (the sweep has not ended)"
    else:
        line = f"makespan: {measured:.1f} s measured"
    if predicted:
        line += f", {predicted:.1f} s predicted (SIMULATED)"
        if measured is not None:
            line += f": measured / predicted {measured / predicted:.2f}"
    return line
