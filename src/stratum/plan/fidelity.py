"""Prediction beside measurement: the plan search's prediction for the tree a run trains, kept in the run's
out_dir (``plan_prediction.json``, written when ``parallel.plan = "auto"`` chooses the tree), and read back into
``summary.json`` next to the measured median step time and peak memory."""

from __future__ import annotations

import json
from pathlib import Path

from stratum.atomic import atomic_write_json
from stratum.plan.predict import Prediction

PREDICTION_FILE = "plan_prediction.json"


def write_prediction(out_dir: Path, p: Prediction, grad_accum: int) -> None:
    """Record ``p`` (SIMULATED figures) for the run in ``out_dir``, which trains it with ``grad_accum``
    micro-batches per replica."""
    atomic_write_json(out_dir / PREDICTION_FILE, {
        "plan": str(p.plan), "grad_accum": grad_accum, "predicted_step_s": p.step_s, "predicted_compute_s": p.compute_s,
        "predicted_reduce_s": p.reduce_s, "predicted_update_s": p.update_s, "predicted_overhead_s": p.overhead_s,
        "predicted_peak_bytes": max(p.peak_bytes),
        "predicted_peak_bytes_per_rank": list(p.peak_bytes), "source": "SIMULATED by stratum.plan.predict"})


def recorded(out_dir: Path) -> dict | None:
    """The prediction recorded in ``out_dir`` (None when there is none, or it cannot be read)."""
    try:
        rec = json.loads((out_dir / PREDICTION_FILE).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("plan"), str) else None


def beside(out_dir: Path, plan: str, measured_step_s: float | None, measured_peak_bytes: int) -> dict | None:
    """The recorded prediction for ``plan`` with the measured figures beside it; None when the run in
    ``out_dir`` has no prediction for this tree (another plan, or not chosen by the search)."""
    rec = recorded(out_dir)
    if rec is None or rec["plan"] != plan:
        return None
    rec["measured_step_s"] = measured_step_s
    rec["measured_peak_bytes"] = measured_peak_bytes
    pred = rec.get("predicted_step_s")
    rec["step_s_error"] = (measured_step_s / pred - 1) if measured_step_s and pred else None
    return rec


def describe(rec: dict) -> str:
    """One line: measured against predicted step time and peak memory."""
    meas, pred, err = rec.get("measured_step_s"), rec["predicted_step_s"], rec.get("step_s_error")
    step = (f"step {meas:.4f} s measured (median) vs {pred:.4f} s predicted ({err * 100:+.1f} %)"
            if meas is not None and err is not None else f"step {pred:.4f} s predicted")
    return (f"plan search: {step}; peak {rec['measured_peak_bytes'] / 2**20:,.0f} MiB measured vs "
            f"{rec['predicted_peak_bytes'] / 2**20:,.1f} MiB predicted (model state + activations)")
