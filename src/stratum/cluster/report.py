"""What a simulated replay reports: throughput, average and tail job completion time, utilisation over time —
as a dict (the JSON), a table, and a PNG; every one labelled SIMULATED."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence

import numpy as np

from stratum.atomic import atomic_write_bytes, atomic_write_json
from stratum.cluster.simulate import SimResult
from stratum.errors import StratumError

LABEL = "SIMULATED"


def summary(res: SimResult) -> dict:
    """The headline figures of a replay (times in seconds)."""
    done = res.completed
    jct = np.array([j.jct_s for j in done], dtype=float)
    hours = res.end_s / 3600 if res.end_s else 0.0
    return {
        "label": LABEL, "policy": res.policy, "devices": res.devices, "jobs": len(res.jobs),
        "completed": len(done), "end_s": res.end_s, "makespan_s": res.makespan_s,
        "avg_jct_s": float(jct.mean()) if len(jct) else None,
        "p95_jct_s": float(np.percentile(jct, 95)) if len(jct) else None,
        "jobs_per_hour": len(done) / hours if hours else 0.0,
        "work_rate": res.work_s / res.end_s if res.end_s else 0.0,
        "utilisation": res.utilisation,
    }


def to_json(res: SimResult) -> dict:
    """The summary, every job's times and the utilisation timeline."""
    return {"summary": summary(res),
            "jobs": [{"id": j.id, "arrival_s": j.arrival_s, "start_s": j.start_s, "end_s": j.end_s,
                      "jct_s": j.jct_s, "done": j.done} for j in res.jobs],
            "timeline": [{"start_s": s.start_s, "end_s": s.end_s, "busy": s.busy, "held": s.held, "runs": s.runs}
                         for s in res.segments],
            "notes": "SIMULATED: predictions of Stratum's cost model (profiled block times over device speeds, ring "
                     "all-reduce prices), not measurements; work_rate is seconds of one profiled device's training "
                     "done per second"}


def write_json(path: str | os.PathLike, results: Sequence[SimResult]) -> None:
    atomic_write_json(path, {"label": LABEL, "policies": [to_json(r) for r in results]})


def table(results: Sequence[SimResult]) -> str:
    """One row per replay."""
    head = (f"{'policy':<16} {'done':>9} {'avg JCT s':>10} {'p95 JCT s':>10} {'jobs/h':>8} {'work rate':>10} "
            f"{'util':>6}")
    rows = [f"{LABEL} (cost-model predictions, not measurements)", head, "-" * len(head)]
    for r in results:
        s = summary(r)
        avg = f"{s['avg_jct_s']:.4g}" if s["avg_jct_s"] is not None else "-"
        p95 = f"{s['p95_jct_s']:.4g}" if s["p95_jct_s"] is not None else "-"
        rows.append(f"{r.policy:<16} {s['completed']:>4}/{s['jobs']:<4} {avg:>10} {p95:>10} "
                    f"{s['jobs_per_hour']:>8.4g} {s['work_rate']:>10.4g} {100 * s['utilisation']:>5.1f}%")
    return "\n".join(rows)


def write_png(path: str | os.PathLike, results: Sequence[SimResult], *, title: str = "") -> None:
    """Busy devices over time, one line per replay, titled SIMULATED."""
    try:
        import matplotlib
    except ImportError:
        raise StratumError("the utilisation PNG needs matplotlib: pip install 'stratum[plot]'") from None
    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    for r in results:
        xs, ys = [], []
        for s in r.segments:
            xs += [s.start_s / 3600, s.end_s / 3600]
            ys += [100 * s.busy / r.devices] * 2
        ax.plot(xs, ys, label=r.policy, linewidth=1.2)
    ax.set_xlabel("hours")
    ax.set_ylabel("busy devices, %")
    ax.set_ylim(0, 105)
    # beside the axes, not over them: the lines' tails (where policies end) are what the plot is read for
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    ax.set_title(f"{LABEL}: {title or 'cluster utilisation over time'}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
