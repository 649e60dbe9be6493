"""The same sweep files on the Ray backend (a local Ray instance): every job equals its `stratum train`, a job
the plan gives two slots runs one rank on each slot's actor, and sharded-lrtf's worker runs as one actor."""

from __future__ import annotations

import math

import pytest

from stratum.config import load_config
from stratum.sweep.runner import run_sweep

from test_sweep_run import job_losses, rows, standalone_losses, sweep_file

ray = pytest.importorskip("ray", reason="Ray (the ray extra) is not installed")


@pytest.mark.slow
def test_sweeps_on_a_local_ray_instance(tmp_path, corpus_file, cache_dir):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    (tmp_path / "three").mkdir()
    one = sweep_file(tmp_path / "one", corpus_file, cache_dir, sweep='backend = "ray"',
                     grid='"optim.lr" = [1e-3, 3e-3]', steps=4, extra="eval_interval = 2")
    two = sweep_file(tmp_path / "two", corpus_file, cache_dir,
                     sweep='backend = "ray"\nscheduler = "planned"\nplans = ["replicate(2)"]\ndevices = ["cpu", "cpu"]',
                     grid='"optim.lr" = [3e-3]', steps=2, extra="grad_accum = 2\neval_interval = 2")
    three = sweep_file(tmp_path / "three", corpus_file, cache_dir,
                       sweep='backend = "ray"\nscheduler = "sharded-lrtf"\ndevice_budget = "1.4MB"\nshard_blocks = 2\n'
                             'devices = ["cpu", "cpu"]',
                       grid='"optim.lr" = [1e-3, 3e-3]\n"model.dropout" = [0.1]', steps=2,
                       extra="eval_interval = 2")
    lines: list[str] = []
    try:
        run_sweep(one, say=lines.append)
        run_sweep(two, say=lines.append)
        run_sweep(three, say=lines.append)
    finally:
        ray.shutdown()
    got = rows(tmp_path / "one" / "sw")
    assert all(r["status"] == "done" for r in got.values()), (got, lines)
    assert {r["slot"] for r in got.values()} == {0, 1}
    for job_id in got:
        assert job_losses(tmp_path / "one" / "sw", job_id) == standalone_losses(one, job_id, tmp_path / job_id)
    # replicate(2): a rank on each slot's actor, joined by the torchrun variables; the plain run's losses
    assert rows(tmp_path / "two" / "sw")["j000"]["status"] == "done", lines
    assert any("j000: started on slots 0,1" in ln and "as replicate(2)" in ln for ln in lines), lines
    assert load_config(tmp_path / "two" / "sw" / "jobs" / "j000" / "job.toml").plan.world_size() == 2
    swept, plain = job_losses(tmp_path / "two" / "sw", "j000"), standalone_losses(two, "j000", tmp_path / "plain")
    assert len(swept) == len(plain) == 2 and all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(swept, plain))
    # sharded-lrtf: both jobs' shard tasks interleaved in one actor, each job equal to its offload `stratum train`
    got = rows(tmp_path / "three" / "sw")
    assert all(r["status"] == "done" for r in got.values()), (got, lines)
    assert (tmp_path / "three" / "sw" / "shard_tasks.jsonl").exists()
    for job_id in got:
        assert job_losses(tmp_path / "three" / "sw", job_id) == standalone_losses(
            three, job_id, tmp_path / f"sharded-{job_id}", ["train.engine='offload'", "offload.device_budget='1.4MB'"])
