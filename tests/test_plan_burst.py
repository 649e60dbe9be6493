"""Burst planner (stratum.plan.burst): DeepPool's programme against brute force and hand-computed prices."""

from __future__ import annotations

import random

import pytest

from stratum.errors import StratumError
from stratum.ir.costs import Costs
from stratum.ir.hardware import Link
from stratum.plan.burst import (
    brute_force,
    default_widths,
    overlaps,
    plan_burst,
    price_burst,
    reshard_s,
    spans,
)

LINK = Link(bandwidth=1e6, latency=0.0)


def costs(f, b, out_bytes, param_bytes) -> Costs:
    n = len(f)
    return Costs(f=f, b=b, i=[0] * n, w=[0] * n, act_bytes=[0] * n, out_bytes=out_bytes, param_bytes=param_bytes)


def test_shares_and_the_messages_between_them():
    assert spans(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert spans(4, 1) == [(0, 4)]
    # 2 shares into 4: each rank keeps the first half of its share and sends the second half on
    assert overlaps(spans(8, 2), spans(8, 4)) == [(0, 0, 0, 2), (0, 1, 2, 4), (1, 2, 4, 6), (1, 3, 6, 8)]
    assert overlaps(spans(4, 4), spans(4, 1)) == [(0, 0, 0, 1), (1, 0, 1, 2), (2, 0, 2, 3), (3, 0, 3, 4)]
    # one way, the busiest rank's messages: widening 1 -> 4 sends 3/4 of the bytes from rank 0; 2 -> 4 keeps
    # shares contiguous, so rank 1 sends both quarters it held to ranks 2 and 3 (rank 0 one quarter to rank 1)
    assert reshard_s(4e6, 1, 4, LINK) == pytest.approx(3.0)
    assert reshard_s(4e6, 2, 4, LINK) == pytest.approx(2.0)
    assert reshard_s(4e6, 4, 1, LINK) == pytest.approx(3.0)  # gathering: rank 0 receives 3/4
    assert reshard_s(4e6, 2, 2, LINK) == 0.0
    assert default_widths(8) == (1, 2, 4, 8) and default_widths(6) == (1, 2, 4, 6)


def test_a_hand_computed_plan_as_a_table():
    # block 0: 3 s of compute, no parameters; block 1: 3 s and a 4 MB gradient (a 4 s all-reduce on 2 ranks,
    # 5.5 s at width 2 = 11 device-s > 2 × 3: over the amplification limit, so it stays at width 1); on the
    # profiled device without kernel counts a block's time halves with its share
    c = costs([1.0, 1.0], [2.0, 2.0], [1e6, 0], [0, 4e6])
    plan = plan_burst(c, devices=2, link=LINK, amplification=2.0)
    assert plan.table() == "\n".join([
        "block  width   compute s  allreduce s     move s    device-s",
        "------------------------------------------------------------",
        "    0      2         1.5            0          0           3",
        "    1      1           3            0          1           5",
        "a step of one micro-batch 5.5 s on 2 devices; busy 8 device-s, idle 3 device-s (27 %)"])
    # without the limit block 1 would take both devices for 1.5 + 4 s instead of 1 + 3 s: still slower
    free = plan_burst(c, devices=2, link=LINK, amplification=10.0)
    assert free.widths == (2, 1) and free.step_s == pytest.approx(plan.step_s)
    dp = price_burst(c, [2, 2], devices=2, link=LINK)
    assert dp.step_s == pytest.approx(1.5 + 5.5) and dp.idle_s == pytest.approx(0.0)


def test_a_block_that_scales_well_gets_more_devices_than_one_that_does_not():
    # block 0: heavy compute, few parameters (a convolution); block 1: light compute, a large gradient (a
    # fully connected layer) — DeepPool's motivating shape
    c = costs([4.0, 0.2], [8.0, 0.4], [1e5, 1e4], [1e4, 8e6])
    plan = plan_burst(c, devices=8, link=Link(bandwidth=1e7, latency=1e-5), amplification=3.0)
    assert plan.widths[0] > plan.widths[1]
    assert plan.widths == (8, 1)


@pytest.mark.parametrize("seed", range(12))
def test_the_programme_equals_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    devices = rng.choice([3, 4, 8])
    c = costs([rng.uniform(0.01, 2.0) for _ in range(n)], [rng.uniform(0.02, 4.0) for _ in range(n)],
              [rng.choice([0, 1e4, 1e6, 5e6]) for _ in range(n)], [rng.choice([0, 1e3, 1e6, 1e7]) for _ in range(n)])
    link = Link(bandwidth=rng.choice([1e6, 1e7, 1e9]), latency=rng.choice([0.0, 1e-4, 1e-2]))
    amp = rng.choice([1.0, 1.5, 2.0, 4.0])
    dp = plan_burst(c, devices=devices, link=link, amplification=amp)
    bf = brute_force(c, devices=devices, link=link, amplification=amp)
    assert (dp.step_s, dp.device_s) == pytest.approx((bf.step_s, bf.device_s), rel=1e-12)
    for i, k in enumerate(dp.widths):  # the amplification limit holds block by block
        t1 = c.f[i] + c.b[i]
        assert k * (dp.compute_s[i] + dp.allreduce_s[i]) <= amp * t1 * (1 + 1e-9)
    assert dp.idle_s >= -1e-9


def test_bad_planner_input_is_one_line():
    c = costs([1.0], [2.0], [0], [1e6])  # at width 4: 0.75 s of compute and a 1.5 s all-reduce, 9 device-s > 3
    for kw, msg in [(dict(devices=0), "at least 1 device"), (dict(amplification=0.5), "amplification must be >= 1"),
                    (dict(widths=[2, 8]), "must be in 1..4"),
                    (dict(widths=[4], amplification=1.0), "block 0 fits no width of [4]")]:
        args = dict(devices=4, link=LINK, amplification=2.0) | kw
        with pytest.raises(StratumError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            plan_burst(c, **args)
    with pytest.raises(StratumError, match="one width in 1..4 per block"):
        price_burst(c, [1, 1], devices=4, link=LINK)


def test_the_burst_node_parses_renders_and_says_who_runs_what():
    from stratum.ir.plan import parse_plan

    plan = parse_plan("burst(4, widths=4:2:1:1, amplification=1.5)")
    assert str(plan) == "burst(4, widths=4:2:1:1, amplification=1.5)" and str(parse_plan(str(plan))) == str(plan)
    assert plan.world_size() == 4 and plan.mesh_shape == (4, 1, 1) and plan.replicas == 1  # micro-batches split
    assert plan.burst.width_list() == (4, 2, 1, 1)
    rows = [line.split() for line in plan.table(lambda r: [0, 1, 2, 3]).splitlines()[2:]]
    assert [row[4] for row in rows] == ["0-3", "0-1", "0", "0"]  # rank r keeps the blocks wider than r
    assert all(" ".join(row[5:]) == "its share of each micro-batch's samples in these blocks (widths 4:2:1:1)"
               for row in rows)
    assert str(parse_plan("burst(2)")) == "burst(2)"
    for text, msg in [("burst(4, widths=5:1)", "every width must be in 1..4"),
                      ("burst(2, widths=a:b)", "must be whole numbers separated by ':'"),
                      ("burst(2, amplification=0.5)", "must be >= 1"),
                      ("replicate(2, burst(2))", "replicate cannot hold burst"),
                      ("burst(2, pipeline(2))", "burst cannot hold pipeline")]:
        with pytest.raises(StratumError, match=msg):
            parse_plan(text)


def test_a_width_talks_over_the_link_of_its_ranks():
    # ranks 0-1 share a node (1 GB/s), wider groups cross to another (100 kB/s); a 1 MB gradient
    fast, slow = Link(bandwidth=1e9, latency=0.0), Link(bandwidth=1e5, latency=0.0)
    c = costs([1.0], [2.0], [0], [1e6])
    two_nodes = plan_burst(c, devices=4, link=lambda k: fast if k <= 2 else slow, amplification=10.0)
    # width 2: 1.5 s + 2·(1/2)·1e6/1e9 = 1.501 s; width 4: 0.75 s + 2·(3/4)·1e6/1e5 = 15.75 s
    assert two_nodes.widths == (2,) and two_nodes.step_s == pytest.approx(1.501)
    one_node = plan_burst(c, devices=4, link=fast, amplification=10.0)
    assert one_node.widths == (4,) and one_node.step_s == pytest.approx(0.75 + 1.5e-3)
