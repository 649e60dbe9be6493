"""The process probe: real spawned gloo processes report a rate each and an all-reduce time per size."""

from __future__ import annotations

import pytest

from stratum.errors import StratumError
from stratum.plan.process_probe import probe_processes


def test_two_processes_report_their_rates_and_all_reduce_times():
    res = probe_processes(2, threads=1, sizes=(1 << 16, 4), timeout_s=90)
    assert len(res.rates) == 2 and all(r > 0 for r in res.rates)
    assert len(res.allreduce_s) == 2 and all(0 < t < 90 for t in res.allreduce_s)
    with pytest.raises(StratumError, match="at least 2 processes"):
        probe_processes(1, threads=1, sizes=(4,), timeout_s=5)
