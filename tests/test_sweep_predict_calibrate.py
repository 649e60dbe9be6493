"""The sweep's calibrated job-time prediction: the fit's arithmetic on hand-computed cases, and a cache that is
corrupt, foreign or incomplete is ignored (None), never a traceback. No real jobs run here."""

from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from stratum.config import Config
from stratum.sweep.calibrate import (
    Calibration,
    Sample,
    calibration,
    calibration_key,
    fit_line,
    from_samples,
    load_calibration,
    save_calibration,
)
from stratum.sweep.predict import calibrated_seconds

ALONE = [Sample(profiled_step_s=0.1, state_bytes=1_000_000, step_s=0.3, fixed_s=1.0),
         Sample(profiled_step_s=0.3, state_bytes=3_000_000, step_s=0.7, fixed_s=2.0)]
TOGETHER = [Sample(profiled_step_s=0.1, state_bytes=1_000_000, step_s=0.45, fixed_s=1.2),
            Sample(profiled_step_s=0.3, state_bytes=3_000_000, step_s=1.15, fixed_s=2.5)]


def test_fit_line_by_hand():
    assert fit_line([1.0, 3.0], [5.0, 9.0]) == pytest.approx((2.0, 3.0))
    # least squares through three points: means (1, 5/3), slope (5/3 + 4/3) / 2 = 1.5, intercept 5/3 - 1.5
    assert fit_line([0.0, 1.0, 2.0], [0.0, 2.0, 3.0]) == pytest.approx((1.5, 1 / 6))
    assert fit_line([2.0, 2.0], [1.0, 3.0]) == (0.0, 2.0)  # one distinct x: flat through the mean


def test_from_samples_by_hand():
    cal = from_samples(ALONE, TOGETHER)
    # steps: 0.3 = a·0.1 + b, 0.7 = a·0.3 + b → a = 2, b = 0.1; fixed: 1.0 = s0 + s1·1e6, 2.0 = s0 + s1·3e6
    # → s1 = 5e-7, s0 = 0.5; contention = (0.45 + 1.15) / (0.3 + 0.7) = 1.6
    assert asdict(cal) == pytest.approx({"fixed_s": 0.5, "fixed_s_per_byte": 5e-7, "step_scale": 2.0,
                                         "step_overhead_s": 0.1, "contention": 1.6})
    # (0.5 + 5e-7·2e6 + 10·(2·0.2 + 0.1)) · 1.6 = (1.5 + 5) · 1.6
    assert cal.job_seconds(profiled_step_s=0.2, state_bytes=2_000_000, steps=10) == pytest.approx(10.4)


def test_contention_never_below_one_and_time_never_negative():
    cal = from_samples(ALONE, ALONE[::-1])  # "together" faster than alone for one job: noise, not a speed-up
    assert cal.contention == pytest.approx(1.0)
    odd = Calibration(fixed_s=-5.0, fixed_s_per_byte=0.0, step_scale=1.0, step_overhead_s=0.0, contention=1.0)
    assert odd.job_seconds(profiled_step_s=0.1, state_bytes=0, steps=1) == 0.0


def test_calibrated_seconds_uses_the_profile_per_optimizer_step():
    cfg = Config()
    cal = from_samples(ALONE, TOGETHER)
    prof = SimpleNamespace(step_s=0.2 / cfg.micro_batches_per_step, train_state_bytes=2_000_000)
    assert calibrated_seconds(prof, cfg, 10, cal) == pytest.approx(10.4)


def test_cache_round_trip_and_bad_caches_are_ignored(tmp_path):
    cal = from_samples(ALONE, TOGETHER)
    path = tmp_path / "sub" / "cal.json"
    assert load_calibration(path, "k") is None  # none yet
    save_calibration(path, "k", cal)
    assert load_calibration(path, "k") == cal
    assert load_calibration(path, "another machine") is None
    good = json.loads(path.read_text())
    bad = {"garbage": "{not json", "not a dict": "[1, 2]", "no calibration": json.dumps({"key": "k"}),
           "missing field": json.dumps({"key": "k", "calibration": {"fixed_s": 1.0}}),
           "wrong type": json.dumps({"key": "k", "calibration": {**good["calibration"], "contention": "fast"}}),
           "calibration not a dict": json.dumps({"key": "k", "calibration": [1, 2]}),
           "binary": b"\xff\xfe\x00".decode("latin-1")}
    for what, text in bad.items():
        path.write_text(text)
        assert load_calibration(path, "k") is None, what
    path.unlink()
    path.mkdir()  # a directory where the file should be
    assert load_calibration(path, "k") is None


def test_a_cached_calibration_is_used_without_measuring(tmp_path):
    base, cal = Config(), from_samples(ALONE, TOGETHER)
    path = tmp_path / "cal.json"
    save_calibration(path, calibration_key(base, threads=1, slots=2), cal)
    # work_dir does not exist: measuring would have to create it; a hit never touches it
    assert calibration(base, threads=1, slots=2, work_dir=tmp_path / "none", cache=path) == cal
    assert not (tmp_path / "none").exists()
