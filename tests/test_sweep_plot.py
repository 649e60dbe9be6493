"""The sweep's loss-curve PNG: a curve per job that logged steps, and a plain PNG without warnings when none did."""

from __future__ import annotations

import json
import warnings

import pytest

from stratum.sweep.plot import loss_png
from stratum.sweep.state import JobRow

pytest.importorskip("matplotlib")
PNG = b"\x89PNG"


def _row(job: str) -> JobRow:
    return JobRow(id=job, idx=int(job[1:]), label=f"lr={job}", status="done", attempts=1, step=3, steps=3, loss=None,
                  eval_loss=None, tokens_per_s=None, slot=None, reason="", run_s=0.0, pid=None)


def test_a_png_of_the_logged_curves_and_one_without_warnings_when_no_job_logged(tmp_path):
    run = tmp_path / "jobs" / "j000"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in (1, 2, 3)))
    assert loss_png(tmp_path, [_row("j000"), _row("j001")]).startswith(PNG)  # j001 logged nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels" would fail here
        assert loss_png(tmp_path, [_row("j001")]).startswith(PNG)
