"""Exports of a simulated run: Chrome trace JSON (chrome://tracing, Perfetto) and a PNG timeline.

Both are labelled SIMULATED. matplotlib is imported only when a PNG is asked for (the ``plot`` extra).
"""

from __future__ import annotations

import io
import os

from stratum.atomic import atomic_write_bytes, atomic_write_json
from stratum.errors import StratumError
from stratum.sim.pipeline import SimResult

_COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}


def chrome_trace(result: SimResult) -> dict:
    """One complete ("X") event per action, ``tid`` = rank, times in microseconds of simulated
    seconds (millionths of a unit under unit costs)."""
    sched = result.schedule
    events = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
               "args": {"name": f"SIMULATED {sched.name}"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
               for r in range(sched.num_ranks)]
    for rec in result.records:
        a = rec.action
        events.append({"name": str(a), "cat": a.kind, "ph": "X", "pid": 0, "tid": rec.rank,
                       "ts": rec.start * 1e6, "dur": (rec.end - rec.start) * 1e6,
                       "args": {"stage": a.stage, "mb": a.mb}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"simulated": True, "schedule": sched.name, "makespan": result.makespan,
                          "time_unit": result.time_unit, "bubble": result.bubble}}


def write_chrome_trace(result: SimResult, path: str | os.PathLike) -> None:
    atomic_write_json(path, chrome_trace(result))


def write_png(result: SimResult, path: str | os.PathLike, *, dpi: int = 110) -> None:
    """Gantt-style timeline: one row per rank, one bar per action coloured by kind, labelled ``stage.mb``."""
    try:
        import matplotlib
    except ImportError:
        raise StratumError("the PNG timeline needs matplotlib: pip install 'stratum[plot]'") from None
    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sched = result.schedule
    P = sched.num_ranks
    fig, ax = plt.subplots(figsize=(min(4 + len(result.records) * 0.12 / max(P, 1), 30), 0.6 * P + 1.4))
    span = result.makespan or 1.0
    for rec in result.records:
        a = rec.action
        ax.barh(rec.rank, rec.end - rec.start, left=rec.start, height=0.8, color=_COLORS[a.kind],
                edgecolor="white", linewidth=0.5)
        if (rec.end - rec.start) / span > 0.012:  # label only bars wide enough to read
            ax.text((rec.start + rec.end) / 2, rec.rank, f"{a.stage}.{a.mb}", ha="center", va="center",
                    fontsize=6, color="white")
    ax.set_yticks(range(P), [f"rank {r}" for r in range(P)])
    ax.invert_yaxis()
    ax.set_xlabel(f"simulated time ({result.time_unit})")
    ax.set_title(f"SIMULATED {sched.name}: makespan {result.makespan:.4g} {result.time_unit}, bubble "
                 f"{result.bubble:.3f}")
    kinds = sorted({rec.action.kind for rec in result.records}, key="FBIW".index)
    ax.legend(handles=[Patch(color=_COLORS[k], label=k) for k in kinds], loc="upper right", fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
