"""A PNG of every job's training loss curve (with matplotlib, the ``plot`` extra)."""

from __future__ import annotations

import io
from pathlib import Path

from stratum.sweep.state import JobRow
from stratum.train.trainer import read_metrics


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
