"""What a sweep leaves for people: a table of jobs (sorted by eval loss), ``results.csv`` and a PNG of every
job's loss curve (with matplotlib, the ``plot`` extra)."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Callable

from stratum.atomic import atomic_write_bytes, atomic_write_text
from stratum.sweep.state import JobRow
from stratum.train.trainer import read_metrics

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
    head = f"{'job':<6} {'status':<8} {'step':>11} {'loss':>8} {'eval':>8} {'tok/s':>9} {'slot':>4}  values"
    lines = [head]
    for r in ranked(rows):
        lines.append(f"{r.id:<6} {r.status:<8} {f'{r.step}/{r.steps}':>11} {_fmt(r.loss, '.4f'):>8} "
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


def loss_png(sweep_dir: Path, rows: list[JobRow]) -> bytes | None:
    """Every job's training loss curve in one PNG; None without matplotlib."""
    try:
        import matplotlib  # optional extra (plot)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        recs = read_metrics(sweep_dir / "jobs" / r.id)
        if recs:
            ax.plot([x["step"] for x in recs], [x["loss"] for x in recs], label=f"{r.id} {r.label}", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=6)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def write_results(sweep_dir: Path, rows: list[JobRow], *, say: Callable[[str], None]) -> None:
    """results.csv, losses.png (with matplotlib) and the table."""
    atomic_write_text(sweep_dir / "results.csv", results_csv(rows))
    png = loss_png(sweep_dir, rows)
    if png is not None:
        atomic_write_bytes(sweep_dir / "losses.png", png)
    say(table(rows))
    say(f"results: {sweep_dir / 'results.csv'}" + (f", loss curves: {sweep_dir / 'losses.png'}" if png else ""))
