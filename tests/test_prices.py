"""The cost model's prices: transfers and ring collectives match their closed forms on small groups; a block's
time scales with the device's speed."""

from __future__ import annotations

import pytest

from stratum.errors import StratumError
from stratum.ir.costs import Costs, StepCosts
from stratum.ir.hardware import Device, Link
from stratum.ir.prices import (
    allgather_s,
    allreduce_s,
    block_s,
    broadcast_s,
    bucketed_allreduce_s,
    on_device,
    reduce_scatter_s,
    step_overhead_s,
    transfer_s,
    with_link,
)

LINK = Link(bandwidth=1e9, latency=1e-5)
MB = 10**6


def test_a_transfer_is_latency_plus_bytes_over_bandwidth():
    assert transfer_s(MB, LINK) == pytest.approx(1e-5 + 1e-3)
    assert transfer_s(0, LINK) == 0.0


@pytest.mark.parametrize("n, allreduce, gather, bcast", [
    # n=2: allreduce 2·1/2·1ms + 2·10us; gather 1/2·1ms + 10us; broadcast 1·(10us + 1ms)
    (2, 1e-3 + 2e-5, 0.5e-3 + 1e-5, 1.01e-3),
    # n=3: allreduce 2·2/3 ms + 4·10us; gather 2/3 ms + 2·10us; broadcast ⌈log2 3⌉ = 2 hops
    (3, 4 / 3 * 1e-3 + 4e-5, 2 / 3 * 1e-3 + 2e-5, 2 * 1.01e-3),
    # n=4: allreduce 2·3/4 ms + 6·10us; gather 3/4 ms + 3·10us; broadcast 2 hops
    (4, 1.5e-3 + 6e-5, 0.75e-3 + 3e-5, 2 * 1.01e-3),
])
def test_collectives_match_their_closed_forms(n, allreduce, gather, bcast):
    assert allreduce_s(MB, n, LINK) == pytest.approx(allreduce)
    assert allgather_s(MB, n, LINK) == pytest.approx(gather)
    assert reduce_scatter_s(MB, n, LINK) == pytest.approx(gather)
    assert broadcast_s(MB, n, LINK) == pytest.approx(bcast)
    # an all-reduce is a reduce-scatter then an all-gather
    assert allreduce_s(MB, n, LINK) == pytest.approx(reduce_scatter_s(MB, n, LINK) + allgather_s(MB, n, LINK))


def test_a_group_of_one_and_an_empty_buffer_cost_nothing():
    for price in (allreduce_s, allgather_s, reduce_scatter_s, broadcast_s):
        assert price(MB, 1, LINK) == 0.0 and price(0, 4, LINK) == 0.0
    with pytest.raises(StratumError, match="at least 1 rank"):
        allreduce_s(MB, 0, LINK)
    with pytest.raises(StratumError, match="sizes must be >= 0"):
        transfer_s(-1, LINK)


def test_a_block_on_a_device_scales_with_its_speed():
    costs = Costs(f=[1.0, 2.0], b=[2.0, 4.0], i=[1.0, 2.0], w=[1.0, 2.0], act_bytes=[10, 20], out_bytes=[5, 5])
    fast, slow = Device(name="x", memory_bytes=1, speed=2.0), Device(name="y", memory_bytes=1, speed=0.5)
    assert block_s(costs, 0, fast) == 1.5 and block_s(costs, 1, slow) == 12.0
    scaled = on_device(costs, fast)
    assert scaled.f == (0.5, 1.0) and scaled.w == (0.5, 1.0) and scaled.act_bytes == costs.act_bytes
    linked = with_link(costs, LINK)
    assert linked.message_s(MB) == pytest.approx(transfer_s(MB, LINK))
    with pytest.raises(StratumError, match="outside the costs' 2 units"):
        block_s(costs, 2, fast)


def test_a_bucketed_all_reduce_pays_the_latencies_once_per_bucket():
    # 2.5 MB in 1 MB buckets over 4 ranks: 3 calls; bytes 2·3/4·2.5 ms, latencies 3 calls × 6 × 10 us
    assert bucketed_allreduce_s(2.5 * MB, 4, LINK, MB) == pytest.approx(3.75e-3 + 18 * 1e-5)
    assert bucketed_allreduce_s(MB, 4, LINK, 25 * MB) == pytest.approx(allreduce_s(MB, 4, LINK))  # one bucket
    assert bucketed_allreduce_s(MB, 1, LINK, MB) == 0.0
    with pytest.raises(StratumError, match="bucket"):
        bucketed_allreduce_s(MB, 2, LINK, 0)


def test_a_steps_own_costs_are_fixed_plus_per_micro_batch_over_the_speed():
    step = StepCosts(fixed_s=0.01, per_microbatch_s=0.002)
    assert step_overhead_s(step, 3, Device(name="d", memory_bytes=1)) == pytest.approx(0.016)
    assert step_overhead_s(step, 3, Device(name="d", memory_bytes=1, speed=0.5)) == pytest.approx(0.032)
    assert step_overhead_s(StepCosts(), 4, Device(name="d", memory_bytes=1)) == 0.0
    with pytest.raises(StratumError, match="per_microbatch_s"):
        StepCosts(per_microbatch_s=-1.0)
