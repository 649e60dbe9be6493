"""sharded-lrtf's calibration: each task's seconds on a slot read from a grant log, a job's step and fixed seconds
from its tasks (hand-computed cases), and a cached calibration used without measuring."""

from __future__ import annotations

import json

import pytest

from stratum.config import config_from_dict
from stratum.errors import StratumError
from stratum.sweep.calibrate import Calibration, load_calibration, save_calibration
from stratum.sweep.shard_calibrate import (
    sample_from_tasks,
    shard_cache_path,
    shard_calibration,
    shard_calibration_key,
)
from stratum.sweep.shard_worker import task_seconds


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


def test_a_cached_sharded_calibration_is_used_without_measuring(tmp_path):
    base = config_from_dict({})
    cache = tmp_path / "cal.json"
    cal = Calibration(fixed_s=1.0, fixed_s_per_byte=0.0, step_scale=2.0, step_overhead_s=0.01, contention=1.0)
    key = shard_calibration_key(base, threads=1, slots=2, budget="32MB", shard_blocks=1)
    save_calibration(shard_cache_path(cache), key, cal)
    assert shard_cache_path(cache) == tmp_path / "cal.sharded.json"
    assert load_calibration(cache, key) is None  # the plain calibration's file is another
    got = shard_calibration(base, threads=1, slots=2, budget="32MB", shard_blocks=1, work_dir=tmp_path / "none",
                            cache=cache)
    assert got == cal
