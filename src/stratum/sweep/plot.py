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
    curves = 0
    for r in rows:
        recs = read_metrics(sweep_dir / "jobs" / r.id)
        if recs:
            ax.plot([x["step"] for x in recs], [x["loss"] for x in recs], label=f"{r.id} {r.label}", lw=1)
            curves += 1
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    if curves:  # (no job logged a step, e.g. every one failed at start: no legend to draw)
        ax.legend(fontsize=6)
    else:
        ax.text(0.5, 0.5, "no job logged a step", ha="center", va="center", transform=ax.transAxes)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


LABEL_WIDTH = 0.04
"""A bar is named on the chart when it spans at least this share of its panel's time axis."""


def gantt_png(runs: dict[str, list[tuple[float, int, str, float]]], slots: int) -> bytes | None:
    """SIMULATED schedules as Gantt charts, one panel per scheduler (segments as bars per slot); None without
    matplotlib."""
    try:
        import matplotlib  # optional extra (plot)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return None
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 1.2 + 0.6 * slots * len(runs)), squeeze=False)
    jobs = sorted({job for segs in runs.values() for _, _, job, _ in segs})
    colours = {j: plt.cm.tab20(i % 20) for i, j in enumerate(jobs)}
    for ax, (name, segs) in zip(axes[:, 0], runs.items()):
        span = max((end for *_, end in segs), default=0.0)
        for start, slot, job, end in segs:
            ax.barh(slot, end - start, left=start, color=colours[job], edgecolor="black", linewidth=0.3)
            if end - start >= LABEL_WIDTH * span:  # (shard tasks are too short to name: the legend does)
                ax.text((start + end) / 2, slot, job, ha="center", va="center", fontsize=6)
        ax.set_yticks(range(slots))
        ax.set_ylabel("slot")
        ax.set_title(f"{name} (SIMULATED)", fontsize=9)
    axes[-1, 0].set_xlabel("seconds")
    handles = [Patch(facecolor=colours[j], edgecolor="black", linewidth=0.3, label=j) for j in jobs]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(jobs), 10), fontsize=6, frameon=False)
    fig.tight_layout(rect=(0, 0.04 * (1 + (len(jobs) - 1) // 10), 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
