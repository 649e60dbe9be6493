"""The same sweep file on the Ray backend (a local Ray instance): every job equals its `stratum train`."""

from __future__ import annotations

import pytest

from stratum.sweep.runner import run_sweep

from test_sweep_run import job_losses, rows, standalone_losses, sweep_file

ray = pytest.importorskip("ray", reason="Ray (the ray extra) is not installed")


@pytest.mark.slow
def test_a_small_sweep_on_a_local_ray_instance(tmp_path, corpus_file, cache_dir):
    path = sweep_file(tmp_path, corpus_file, cache_dir, sweep='backend = "ray"',
                      grid='"optim.lr" = [1e-3, 3e-3]', steps=4, extra="eval_interval = 2")
    lines: list[str] = []
    try:
        run_sweep(path, say=lines.append)
    finally:
        ray.shutdown()
    got = rows(tmp_path / "sw")
    assert all(r["status"] == "done" for r in got.values()), (got, lines)
    assert {r["slot"] for r in got.values()} == {0, 1}
    for job_id in got:
        assert job_losses(tmp_path / "sw", job_id) == standalone_losses(path, job_id, tmp_path / job_id)
