"""A burst plan's step with all-reduces beside the backward (stratum.plan.burst_overlap): hand-computed timelines,
and the local search against its starting points and brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from stratum.ir.costs import Costs
from stratum.ir.hardware import Link
from stratum.plan.burst import default_widths, plan_burst, price_burst
from stratum.plan.burst_overlap import overlapped, plan_burst_overlapped, union_s

LINK = Link(bandwidth=1e6, latency=0.0)


def costs(f, b, out_bytes, param_bytes) -> Costs:
    n = len(f)
    return Costs(f=f, b=b, i=[0] * n, w=[0] * n, act_bytes=[0] * n, out_bytes=out_bytes, param_bytes=param_bytes)


def test_union_of_intervals():
    assert union_s([(0, 1), (0.5, 2), (3, 4), (3.5, 3.6)]) == pytest.approx(3.0)
    assert union_s([]) == 0.0


def test_an_all_reduce_hides_behind_the_earlier_blocks_backward():
    # two blocks of 1 + 2 s; block 1 has a 2 MB gradient: 2 s of ring all-reduce over 2 ranks. Data parallel:
    # forward 0.5 + 0.5, block 1's backward 1 s (t = 2), its all-reduce 2 → 4 beside block 0's backward 2 → 3
    c = costs([1.0, 1.0], [2.0, 2.0], [0, 0], [0, 2e6])
    dp = overlapped(price_burst(c, [2, 2], devices=2, link=LINK), c)
    assert dp.plan.step_s == pytest.approx(5.0)  # one after another: 1.5 + 1.5 + 2
    assert (dp.step_s, dp.device_s, dp.exposed_s) == pytest.approx((4.0, 8.0, 1.0))
    # the programme prices the all-reduce exposed, so it keeps block 1 narrow (1.5 + 3 = 4.5 s) ...
    assert plan_burst(c, devices=2, link=LINK, amplification=3.0).widths == (2, 1)
    # ... which the overlap makes slower than data parallelism; the search finds the data-parallel plan
    got = plan_burst_overlapped(c, devices=2, link=LINK, amplification=3.0)
    assert got.plan.widths == (2, 2) and got.step_s == pytest.approx(4.0)
    # under amplification 2 block 1 may not take 2 devices (2 · (1.5 + 2) = 7 > 2 · 3): (2, 1) it is
    narrow = plan_burst_overlapped(c, devices=2, link=LINK, amplification=2.0)
    assert narrow.plan.widths == (2, 1) and narrow.step_s == pytest.approx(4.5)
    # block 1's rank 1 idles while block 1 runs narrow: 1.5 s busy of its 4.5 on rank 1, 4.5 on rank 0
    assert narrow.device_s == pytest.approx(6.0) and narrow.idle_s == pytest.approx(3.0)


def test_moves_are_counted_once_in_each_direction():
    # block 0 at width 2, block 1 at width 1: its 1 MB input gathers to rank 0 (0.5 s) and the gradient goes back
    c = costs([1.0, 1.0], [2.0, 2.0], [1e6, 0], [0, 0])
    s = overlapped(price_burst(c, [2, 1], devices=2, link=LINK), c)
    assert s.step_s == pytest.approx(0.5 + 0.5 + 1 + 2 + 0.5 + 1)  # the programme's 5.5 s: nothing to overlap
    assert s.step_s == pytest.approx(s.plan.step_s) and s.device_s == pytest.approx(s.plan.device_s)


def test_the_search_beats_its_starting_points_and_mostly_matches_brute_force():
    exact, worst = 0, 1.0
    for seed in range(60):
        rng = random.Random(seed)
        n, devices = rng.randint(2, 4), rng.choice([2, 4])
        c = costs([rng.uniform(0.01, 2.0) for _ in range(n)], [rng.uniform(0.02, 4.0) for _ in range(n)],
                  [rng.choice([0, 1e4, 1e6]) for _ in range(n)], [rng.choice([0, 1e5, 1e6, 4e6]) for _ in range(n)])
        got = plan_burst_overlapped(c, devices=devices, link=LINK, amplification=100.0)
        for start in (plan_burst(c, devices=devices, link=LINK, amplification=100.0),
                      price_burst(c, [devices] * n, devices=devices, link=LINK)):
            assert got.step_s <= overlapped(start, c).step_s * (1 + 1e-12)
        best = min(overlapped(price_burst(c, w, devices=devices, link=LINK), c).step_s
                   for w in itertools.product(default_widths(devices), repeat=n))
        exact += got.step_s <= best * (1 + 1e-9)
        worst = max(worst, got.step_s / best)
    assert exact >= 54 and worst <= 1.2  # a local search, not the optimum (see the module docstring)
