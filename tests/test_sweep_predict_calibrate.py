"""The sweep's calibrated job-time prediction: the line's arithmetic on hand-computed cases; the plain (fifo, lrtf,
planned) calibration per job shape — each job's figures read from a fake run directory, the shapes' costs alone
and with every slot busy fitted from them, what a job of a measured or an unmeasured shape is predicted, the key
following the shapes — and a cache that is corrupt, foreign or of the other kind is ignored (None), never a
traceback. No real jobs run here."""

from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from stratum.config import Config, config_from_dict
from stratum.sweep.calibrate import Calibration, Sample, fit_line, from_samples
from stratum.sweep.plain_calibrate import job_measured, plain_calibration, plain_calibration_key
from stratum.sweep.predict import alone_share, job_seconds
from stratum.sweep.shape_cost import (
    PLAIN,
    SHARDED,
    ShapeCalibration,
    ShapeCost,
    fit,
    load_shape_calibration,
    save_shape_calibration,
    shape_key,
)

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


def run_dir(path, steps: list[float]):
    """A fake calibration job's run directory: its metrics, one record per step."""
    path.mkdir(parents=True)
    path.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "step_s": s}) + "\n"
                                                      for i, s in enumerate(steps)))
    return path


MINI = config_from_dict({"model": {"preset": "mini"}, "data": {"seq_len": 32}})
SMALL = config_from_dict({"model": {"preset": "small"}, "data": {"seq_len": 64}})
PROF = {"mini": SimpleNamespace(step_s=0.1, train_state_bytes=1_000_000),
        "small": SimpleNamespace(step_s=0.3, train_state_bytes=3_000_000)}


def test_each_shape_s_cost_alone_and_busy_is_fitted_from_its_jobs_runs(tmp_path):
    # 4 steps each: the first (warm-up) is left out of the median. mini alone: steps 0.9, 0.3, 0.2, 0.25 → 0.25,
    # wall 2.0 → fixed 2.0 - 4·0.25 = 1.0; busy, two copies: median 0.4 (wall 3.0 → fixed 1.4) and 0.5 (wall 3.2
    # → fixed 1.2) → 0.45, 1.3. small alone: 0.7 → wall 4.0, fixed 1.2; busy 1.1 and 1.3, walls 6.0 and 6.6 →
    # fixed 1.6 and 1.4 → 1.2, 1.5
    def m(name, cfg, steps, wall):
        return job_measured(run_dir(tmp_path / name, steps), wall, cfg, PROF[cfg.model.preset])  # type: ignore[arg-type]
    alone = [m("a0", MINI, [0.9, 0.3, 0.2, 0.25], 2.0), m("a1", SMALL, [2.0, 0.7, 0.7, 0.6], 4.0)]
    busy = [m("b0", MINI, [1.0, 0.4, 0.4, 0.5], 3.0), m("b1", MINI, [1.0, 0.5, 0.5, 0.6], 3.2),
            m("b2", SMALL, [2.0, 1.1, 1.0, 1.2], 6.0), m("b3", SMALL, [2.0, 1.3, 1.3, 1.2], 6.6)]
    assert alone[0].sample == Sample(profiled_step_s=0.1, state_bytes=1_000_000, step_s=0.25, fixed_s=1.0)
    cal = fit(PLAIN, busy, alone)
    got = {c.label: (c.fixed_s, c.step_s) for c in cal.shapes.values()}
    assert got == {"mini seq 32 batch 16": pytest.approx((1.3, 0.45)), "small seq 64 batch 16": pytest.approx((1.5, 1.2))}
    assert {c.label: (c.fixed_s, c.step_s) for c in cal.alone.values()} == {
        "mini seq 32 batch 16": pytest.approx((1.0, 0.25)), "small seq 64 batch 16": pytest.approx((1.2, 0.7))}
    # the line for other shapes: through the alone steps (0.1, 0.25), (0.3, 0.7) → slope 2.25, intercept 0.025;
    # contention the busy shapes' steps over the alone ones: (0.45 + 1.2) / (0.25 + 0.7)
    assert (cal.line.step_scale, cal.line.step_overhead_s, cal.line.contention) == pytest.approx(
        (2.25, 0.025, 1.65 / 0.95))
    # a job of a measured shape: its busy cost; 20 steps of small: 1.5 + 20·1.2 = 25.5 s, alone 1.2 + 14 = 15.2 s
    assert job_seconds(PROF["small"], SMALL, 20, cal) == pytest.approx(25.5)  # type: ignore[arg-type]
    assert alone_share(PROF["small"], SMALL, 20, cal) == pytest.approx(15.2 / 25.5)  # type: ignore[arg-type]
    # another shape (seq 16): the line, per optimizer step of its profile, and its contention
    other = config_from_dict({"model": {"preset": "mini"}, "data": {"seq_len": 16}})
    prof = SimpleNamespace(step_s=0.2 / other.micro_batches_per_step, train_state_bytes=2_000_000)
    expect = cal.line.job_seconds(profiled_step_s=0.2, state_bytes=2_000_000, steps=10)
    assert job_seconds(prof, other, 10, cal) == pytest.approx(expect)  # type: ignore[arg-type]
    assert alone_share(prof, other, 10, cal) == pytest.approx(0.95 / 1.65)  # type: ignore[arg-type]
    assert alone_share(prof, other, 10, None) == 1.0  # type: ignore[arg-type]
    assert "mini seq 32 batch 16: 1.30 s + steps × 450 ms (alone 1.00 s + 250 ms)" in cal.describe()


def test_the_key_follows_the_shapes_not_the_other_settings():
    def key(*cfgs: Config) -> str:
        return plain_calibration_key(list(cfgs), threads=1, slots=2)
    lr = config_from_dict({"model": {"preset": "mini"}, "data": {"seq_len": 32}, "optim": {"lr": 1e-2}})
    planned = config_from_dict({"model": {"preset": "mini"}, "data": {"seq_len": 32},
                                "parallel": {"plan": "replicate(2)"}, "train": {"threads": 1}})
    assert key(MINI, SMALL) == key(SMALL, MINI, lr) == key(MINI, SMALL, planned)  # same shapes
    assert key(MINI, SMALL) != key(MINI)
    assert key(MINI) != key(config_from_dict({"model": {"preset": "mini"}, "data": {"seq_len": 64}}))
    assert key(MINI) != key(config_from_dict({"model": {"preset": "mini"}, "data": {"seq_len": 32},
                                              "train": {"micro_batch_size": 2}}))
    assert key(MINI) != plain_calibration_key([MINI], threads=1, slots=3)


LINE = Calibration(fixed_s=0.5, fixed_s_per_byte=5e-7, step_scale=2.0, step_overhead_s=0.1, contention=1.6)
CAL = ShapeCalibration(kind=PLAIN, line=LINE, shapes={shape_key(MINI): ShapeCost(label="mini", fixed_s=1.0,
                                                                                    step_s=0.5)},
                       alone={shape_key(MINI): ShapeCost(label="mini", fixed_s=0.8, step_s=0.3)},
                       restart={shape_key(MINI): 0.6})


def test_cache_round_trip_and_bad_caches_are_ignored(tmp_path):
    path = tmp_path / "sub" / "cal.json"
    assert load_shape_calibration(path, "k", PLAIN) is None  # none yet
    save_shape_calibration(path, "k", CAL)
    assert load_shape_calibration(path, "k", PLAIN) == CAL
    assert load_shape_calibration(path, "another machine", PLAIN) is None
    assert load_shape_calibration(path, "k", SHARDED) is None  # sharded-lrtf reads its own kind only
    good = json.loads(path.read_text())
    bad = {"garbage": "{not json", "not a dict": "[1, 2]", "no calibration": json.dumps({"key": "k"}),
           "missing field": json.dumps({**good, "calibration": {"fixed_s": 1.0}}),
           "wrong type": json.dumps({**good, "calibration": {**good["calibration"], "contention": "fast"}}),
           "calibration not a dict": json.dumps({**good, "calibration": [1, 2]}),
           "no kind": json.dumps({k: v for k, v in good.items() if k != "kind"}),
           "no shapes": json.dumps({k: v for k, v in good.items() if k != "shapes"}),
           "bad shape": json.dumps({**good, "shapes": {"s": {"label": "x", "fixed_s": "1"}}}),
           "bad restart": json.dumps({**good, "restart": {"s": -1.0}}),
           "binary": b"\xff\xfe\x00".decode("latin-1")}
    for what, text in bad.items():
        path.write_text(text)
        assert load_shape_calibration(path, "k", PLAIN) is None, what
    path.unlink()
    path.mkdir()  # a directory where the file should be
    assert load_shape_calibration(path, "k", PLAIN) is None


def test_a_cached_calibration_is_used_without_measuring(tmp_path):
    path = tmp_path / "cal.json"
    save_shape_calibration(path, plain_calibration_key([MINI], threads=1, slots=2), CAL)
    # work_dir does not exist: measuring would have to create it; a hit never touches it
    got = plain_calibration([MINI], [PROF["mini"]], threads=1, slots=2, work_dir=tmp_path / "none",  # type: ignore[list-item]
                            cache=path)
    assert got == CAL and not (tmp_path / "none").exists()
