"""The process probe: real gloo processes report a rate each and an all-reduce time per size; the runner reports
what its processes put, or fails in one line — also after this process has computed on several threads."""

from __future__ import annotations

import time

import pytest
import torch

from stratum.errors import StratumError
from stratum.plan.process_probe import probe_processes, run_forked


def test_two_processes_report_their_rates_and_all_reduce_times():
    res = probe_processes(2, threads=1, sizes=(1 << 16, 4), timeout_s=90)
    assert len(res.rates) == 2 and all(r > 0 for r in res.rates)
    assert len(res.allreduce_s) == 2 and all(0 < t < 90 for t in res.allreduce_s)
    with pytest.raises(StratumError, match="at least 2 processes"):
        probe_processes(1, threads=1, sizes=(4,), timeout_s=5)


def _fails(rank: int, out) -> None:
    raise ValueError(f"rank {rank} cannot go on")


def _hangs(rank: int, out) -> None:
    time.sleep(60)


def _reports(rank: int, value: int, out) -> None:
    out.put((rank, value))


def test_forked_processes_report_or_fail_in_one_line_and_never_outlive_the_timeout():
    assert sorted(run_forked(_reports, 3, (7,), timeout_s=60, what="the test")) == [(0, 7), (1, 7), (2, 7)]
    with pytest.raises(StratumError, match=r"^the test failed: ValueError: rank \d cannot go on$"):
        run_forked(_fails, 2, (), timeout_s=60, what="the test")
    t0 = time.monotonic()
    with pytest.raises(StratumError, match="the test did not finish within 1 s"):
        run_forked(_hangs, 2, (), timeout_s=1, what="the test")
    assert time.monotonic() - t0 < 10


def _computes(rank: int, out) -> None:
    torch.set_num_threads(2)
    a = torch.randn(256, 256)
    out.put(("done", rank, float((a @ a).sum() != 0)))


@pytest.mark.timeout(120)
def test_processes_compute_on_several_threads_after_this_one_has():
    """OpenMP's threads started here (a profile, the step probe): a child forked from this process hangs in its
    first multi-threaded product; the runner's come from the forkserver, which never computed."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        a = torch.randn(256, 256)
        assert (a @ a).shape == (256, 256)
        got = run_forked(_computes, 2, (), timeout_s=60, what="the test")
    finally:
        torch.set_num_threads(before)
    assert sorted(got) == [("done", 0, 1.0), ("done", 1, 1.0)]
