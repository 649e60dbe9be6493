"""sharded-lrtf's calibration: each task's seconds on a slot read from a grant log, a job's step and fixed seconds
from its tasks, each shape's cost from a fake grant log (hand-computed cases), the shapes a calibration measures,
and a cached calibration used without measuring (also by sweep.calibration = "auto" on a resumed sweep)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from stratum.config import config_from_dict
from stratum.errors import StratumError
from stratum.sweep.calibrate import Calibration
from stratum.sweep.plain_calibrate import plain_calibration_key
from stratum.sweep.predict import give_back_s, job_seconds
from stratum.sweep.shape_cost import (
    MAX_SHAPES,
    PLAIN,
    SHARDED,
    ShapeCalibration,
    ShapeCost,
    load_shape_calibration,
    pick_shapes,
    save_shape_calibration,
    shape_key,
)
from stratum.sweep.shard_calibrate import (
    SHAPE_COPIES,
    CalJob,
    calibration_jobs,
    fit_shapes,
    give_back_costs,
    sample_from_tasks,
    shard_cache_path,
    shard_calibration,
    shard_calibration_key,
)
from stratum.sweep.slot_scheduler import task_seconds
from stratum.sweep.spec import SweepSettings, job_threads
from stratum.sweep.sweep_calibration import AUTO_CACHE, auto_calibration


def test_task_seconds_run_from_a_grant_to_the_next_record_of_its_slot(tmp_path):
    log = tmp_path / "shard_tasks.jsonl"
    records = [
        {"t": 0.0, "slot": 0, "job": "a", "task": 0, "remaining": {}},
        {"t": 0.0, "slot": 1, "job": "b", "task": 0, "remaining": {}},
        {"t": 0.5, "job": "c", "stage": 0, "chunks": 2},  # a stage holds no slot
        {"t": 1.0, "slot": 0, "job": "c", "task": 0, "remaining": {}},  # a's task: 0 → 1
        {"t": 1.5, "slot": 1, "job": "a", "task": 1, "remaining": {}},  # b's: 0 → 1.5
        {"t": 3.0, "slot": 0, "job": "c", "end": True},  # c's: 1 → 3
        {"t": 4.0, "slot": 1, "job": "a", "end": True},  # a's second: 1.5 → 4
        {"t": 4.5, "slot": 0, "job": "b", "task": 1, "remaining": {}},  # still running at the log's end: left out
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert task_seconds(log) == {"a": [1.0, 2.5], "b": [1.5], "c": [2.0]}


def test_a_sample_takes_the_median_step_and_leaves_the_rest_as_fixed():
    # 3 steps of 2 tasks: set-up in the first task (step 0 sums 5.0), steps 1 and 2 sum 1.0 and 1.2; the tail 0.8
    s = sample_from_tasks([4.5, 0.5, 0.4, 0.6, 0.7, 0.5, 0.8], per_step=2, steps=3, profiled_step_s=0.5,
                          state_bytes=100)
    assert s.step_s == pytest.approx(1.2)
    assert s.fixed_s == pytest.approx(8.0 - 3 * 1.2)
    with pytest.raises(StratumError, match="fewer than its 6"):
        sample_from_tasks([1.0] * 5, per_step=2, steps=3, profiled_step_s=0.5, state_bytes=100)


def grant_log(path, chains: dict[str, list[float]]) -> None:
    """A fake grant log: each job's tasks back to back on a slot of its own, then its end."""
    records = []
    for slot, (job, tasks) in enumerate(chains.items()):
        t = 0.0
        for i, d in enumerate(tasks):
            records.append({"t": t, "slot": slot, "job": job, "task": i, "remaining": {}})
            t += d
        records.append({"t": t, "slot": slot, "job": job, "end": True})
    path.write_text("".join(json.dumps(r) + "\n" for r in sorted(records, key=lambda r: r["t"])))


def test_each_shape_s_cost_is_the_mean_of_its_jobs_read_from_a_grant_log(tmp_path):
    # 3 steps of 2 tasks, then the tail task. Shape A run twice: a0's steps sum 3.0 (its set-up in its first
    # task), 1.2, 1.1 → median 1.2, fixed 5.8 - 3·1.2 = 2.2; a1's 1.3 each → fixed 4.4 - 3.9 = 0.5. Shape B once:
    # 4.0, 3.0, 3.0 → 3.0, fixed 10.2 - 9.0 = 1.2
    chains = {"a0": [2.5, 0.5, 0.6, 0.6, 0.5, 0.6, 0.5], "a1": [0.6, 0.7, 0.6, 0.7, 0.6, 0.7, 0.5],
              "b0": [2.5, 1.5, 1.5, 1.5, 1.5, 1.5, 0.2]}
    grant_log(tmp_path / "shard_tasks.jsonl", chains)
    tasks = task_seconds(tmp_path / "shard_tasks.jsonl")
    assert {j: pytest.approx(ts) for j, ts in chains.items()} == tasks
    runs = [CalJob(id="a0", shape="A", label="a", per_step=2, predicted_step_s=0.5, state_bytes=100),
            CalJob(id="a1", shape="A", label="a", per_step=2, predicted_step_s=0.5, state_bytes=100),
            CalJob(id="b0", shape="B", label="b", per_step=2, predicted_step_s=1.5, state_bytes=300)]
    cal = fit_shapes(tasks, runs, steps=3)
    assert list(cal.shapes) == ["A", "B"]
    assert [(c.label, c.fixed_s, c.step_s) for c in cal.shapes.values()] == [
        ("a", pytest.approx((2.2 + 0.5) / 2), pytest.approx((1.2 + 1.3) / 2)),
        ("b", pytest.approx(1.2), pytest.approx(3.0))]
    # the line for other shapes through the three samples' steps (0.5, 1.2), (0.5, 1.3), (1.5, 3.0): means
    # (5/6, 11/6), Sxx 2/3, Sxy 7/6 → slope 1.75, intercept 11/6 - 1.75·5/6 = 0.375
    assert (cal.line.step_scale, cal.line.step_overhead_s, cal.line.contention) == pytest.approx((1.75, 0.375, 1.0))
    assert "a: 1.35 s + steps × 1250 ms" in cal.describe()


def test_a_give_back_costs_the_difference_of_the_two_runs_steps_over_a_step_s_tasks():
    # 3 steps of 2 tasks (set-up in the first, then the tail). Kept: a0's median step 1.0, a1's 1.2, b0's 2.0.
    # Giving back at every task: a0's 1.4 (+0.4 over 2 tasks: 0.2 a give-back), a1's 1.4 (+0.2: 0.1), b0's 1.9
    # (faster than kept, by noise: 0, not negative)
    def chain(task: float) -> list[float]:
        return [3.0, *[task] * 5, 0.1]
    kept = {"a0": chain(0.5), "a1": chain(0.6), "b0": chain(1.0)}
    gave = {"a0": chain(0.7), "a1": chain(0.7), "b0": [3.0, 0.9, 1.0, 0.9, 1.0, 0.9, 0.1]}
    runs = [CalJob(id=j, shape=j[0], label=j[0], per_step=2, predicted_step_s=0.5, state_bytes=100)
            for j in kept]
    assert give_back_costs(kept, gave, runs, steps=3) == {"a": pytest.approx(0.15), "b": 0.0}


def test_a_job_s_give_back_is_its_shape_s_else_priced_by_its_state():
    cfg, other = config_from_dict({"data": {"seq_len": 32}}), config_from_dict({"data": {"seq_len": 16}})
    cal = ShapeCalibration(kind=SHARDED, line=Calibration(fixed_s=0.0, fixed_s_per_byte=0.0, step_scale=1.0,
                                                          step_overhead_s=0.0, contention=1.0),
                           shapes={shape_key(cfg): ShapeCost(label="x", fixed_s=2.0, step_s=0.25)},
                           give_back={shape_key(cfg): 0.01}, give_back_per_byte=1e-9)
    assert give_back_s(SimpleNamespace(), cfg, cal) == 0.01  # type: ignore[arg-type]
    assert give_back_s(SimpleNamespace(train_state_bytes=2_000_000), other, cal) == pytest.approx(  # type: ignore
        0.002)
    assert "a give-back: x 10.0 ms" in cal.describe()


def test_at_most_max_shapes_are_measured_spread_over_their_step_times():
    configs = [config_from_dict({"data": {"seq_len": 8 * (i + 1)}}) for i in range(9)] + [
        config_from_dict({"data": {"seq_len": 8}, "optim": {"lr": 1e-4}})]  # j0's shape again
    profiles = [SimpleNamespace(step_s=float(c.data.seq_len)) for c in configs]
    picked = pick_shapes(configs, profiles)  # type: ignore[arg-type]
    seqs = [c.data.seq_len for c, _ in picked]
    assert len(seqs) == MAX_SHAPES == len(set(seqs)) and seqs[0] == 8 and seqs[-1] == 72
    assert [c.data.seq_len for c, _ in pick_shapes(configs[:3] + configs[-1:], profiles[:3] + profiles[-1:])] == [
        8, 16, 24]  # fewer than MAX_SHAPES: every distinct shape once


def test_a_shape_the_sweep_runs_several_jobs_of_is_calibrated_as_two():
    # seq 16 × 3 jobs, seq 8 × 1, seq 24 × 2 (learning rates differ: one shape): shapes in profiled-step order
    seqs = [16, 8, 16, 24, 16, 24]
    configs = [config_from_dict({"data": {"seq_len": n}, "optim": {"lr": 1e-4 * (i + 1)}}) for i, n in enumerate(seqs)]
    profiles = [SimpleNamespace(step_s=float(c.data.seq_len)) for c in configs]
    picked = calibration_jobs(configs, profiles)  # type: ignore[arg-type]
    assert SHAPE_COPIES == 2 and [c.data.seq_len for c, _ in picked] == [8, 16, 16, 24, 24]


def test_a_job_s_sharded_seconds_are_its_shape_s_cost():
    cfg = config_from_dict({"data": {"seq_len": 32}})
    cal = ShapeCalibration(kind=SHARDED, line=Calibration(fixed_s=0.0, fixed_s_per_byte=0.0, step_scale=1.0,
                                                          step_overhead_s=0.0, contention=1.0),
                           shapes={shape_key(cfg): ShapeCost(label="x", fixed_s=2.0, step_s=0.25)})
    assert job_seconds(SimpleNamespace(), cfg, 8, cal) == pytest.approx(4.0)  # type: ignore[arg-type]


def test_a_cached_sharded_calibration_is_used_without_measuring(tmp_path):
    configs = [config_from_dict({})]
    cache = tmp_path / "cal.json"
    cal = ShapeCalibration(kind=SHARDED, line=Calibration(fixed_s=1.0, fixed_s_per_byte=0.0, step_scale=2.0,
                                                          step_overhead_s=0.01, contention=1.0),
                           shapes={shape_key(configs[0]): ShapeCost(label="mini", fixed_s=1.0, step_s=0.5)},
                           give_back={shape_key(configs[0]): 0.004}, give_back_per_byte=2e-10)
    key = shard_calibration_key(configs, threads=1, slots=2, shard_blocks=1)
    save_shape_calibration(shard_cache_path(cache), key, cal)
    assert shard_cache_path(cache) == tmp_path / "cal.sharded.json"
    assert load_shape_calibration(cache, key, SHARDED) is None  # the plain calibration's file is another
    got = shard_calibration(configs, [], threads=1, slots=2, shard_blocks=1, work_dir=tmp_path / "none",
                            cache=cache)
    assert got == cal and not (tmp_path / "none").exists()
    # another shape set is another key: it would be measured
    other = [config_from_dict({"data": {"seq_len": 16}})]
    assert load_shape_calibration(shard_cache_path(cache),
                                  shard_calibration_key(other, threads=1, slots=2, shard_blocks=1), SHARDED) is None


def test_auto_reuses_the_calibration_kept_in_the_sweep_directory(tmp_path):
    """sweep.calibration = "auto" on a resumed sweep: the calibration its first run kept is read, not measured."""
    configs = {"j000": config_from_dict({"train": {"engine": "offload"}})}
    settings = SweepSettings(scheduler="lrtf", slots=2, segment_steps=1, calibration="auto")
    cal = ShapeCalibration(kind=PLAIN, line=Calibration(fixed_s=3.0, fixed_s_per_byte=0.0, step_scale=1.0,
                                                        step_overhead_s=0.0, contention=1.5),
                           shapes={shape_key(configs["j000"]): ShapeCost(label="x", fixed_s=2.0, step_s=0.5)})
    save_shape_calibration(tmp_path / AUTO_CACHE,
                           plain_calibration_key(list(configs.values()), threads=job_threads(settings), slots=2), cal)
    lines: list[str] = []
    profiles = {"j000": SimpleNamespace()}  # a cached calibration reads no profile
    assert auto_calibration(settings, tmp_path, configs, profiles, lines.append) == cal  # type: ignore[arg-type]
    assert lines[-1] == f"calibration: as cached: {cal.describe()}" and not (tmp_path / "calibration").exists()
