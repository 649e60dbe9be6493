"""The device model (stratum.ir.work): block times from kernel counts and FLOPs, by hand; the counts
(stratum.profile.work) against closed forms; the burst planner and the cluster simulator reading the model."""

from __future__ import annotations

import random
import tomllib
from dataclasses import replace

import pytest

from stratum.cluster.cluster import Cluster
from stratum.cluster.models import ModelCosts
from stratum.cluster.policies import Elastic
from stratum.cluster.scaling import dp_step
from stratum.cluster.trace import Job
from stratum.errors import StratumError
from stratum.ir.costs import Costs
from stratum.ir.hardware import Device, Hardware, Link, dump_hardware, hardware_from_table
from stratum.ir.work import Work, half_flops, kernels_s, share_s
from stratum.model.gpt import build_gpt
from stratum.plan.burst import Compute, brute_force, plan_burst, price_burst
from stratum.profile.work import count_work

GPU = Device(name="gpu", memory_bytes=10**10, peak_flops=1e12, launch_s=1e-5, half_flops=1e6)


def test_a_block_takes_the_longer_of_its_launches_and_its_work():
    # 100 kernels of 1e9 FLOPs in all: (1e9 + 100 · 1e6) / 1e12 = 1.1 ms > 100 · 10 µs = 1 ms
    assert kernels_s(100, 1e9, GPU) == pytest.approx(1.1e-3)
    # a hundredth of the work: 0.11 ms of arithmetic, but the launches take 1 ms
    assert kernels_s(100, 1e7, GPU) == pytest.approx(1e-3)
    # half_flops left out: peak × launch = 1e7 FLOPs per kernel, so (1e9 + 100 · 1e7) / 1e12 = 2 ms
    default = replace(GPU, half_flops=0.0)
    assert half_flops(default) == pytest.approx(1e7) and kernels_s(100, 1e9, default) == pytest.approx(2e-3)
    # occupancy view: work per kernel w = 1e7 = n½, so the device runs at half its peak
    assert kernels_s(100, 1e9, default) == pytest.approx(1e9 / (1e12 * 0.5))


def test_without_a_peak_the_profiled_time_holds_floored_by_the_launches():
    cpu = Device(name="cpu", memory_bytes=10**9, launch_s=1e-5)
    work = Work(kernels=[100, 2], flops=[0.0, 1e9])
    assert share_s(work, 0, 0.5, cpu, profiled_s=4e-4) == pytest.approx(1e-3)  # 100 launches: 1 ms
    assert share_s(work, 1, 0.5, cpu, profiled_s=4e-4) == pytest.approx(4e-4)
    assert share_s(None, 0, 0.5, cpu, profiled_s=4e-4) == pytest.approx(4e-4)  # no counts: no floor
    assert share_s(work, 1, 8, GPU, profiled_s=123.0) == pytest.approx((8e9 + 2e6) / 1e12)  # the peak rules
    with pytest.raises(StratumError, match="kernel counts are unknown"):
        share_s(None, 0, 1, GPU, profiled_s=1.0)


def test_bad_work_and_device_fields_are_one_line():
    with pytest.raises(StratumError, match="2 kernel counts but 1 FLOP counts"):
        Work(kernels=[1, 2], flops=[1.0])
    with pytest.raises(StratumError, match="must be >= 0"):
        Work(kernels=[-1], flops=[1.0])
    with pytest.raises(StratumError, match="launch_s must be a number >= 0"):
        Device(name="gpu", memory_bytes=1, launch_s=-1.0)
    table = {"host_bytes": 1, "disk_bytes": 1, **{k: {"bandwidth": 1e9, "latency": 0} for k in
                                                     ("host_link", "disk_link", "intra_node", "inter_node")},
             "devices": [{"name": "h100", "memory_bytes": "80GB", "peak_flops": 4e14, "launch_s": "4us"}]}
    hw = hardware_from_table(table)
    assert hw.devices[0].peak_flops == 4e14 and hw.devices[0].launch_s == pytest.approx(4e-6)
    assert hardware_from_table(tomllib.loads(dump_hardware(hw))["hardware"]) == hw
    with pytest.raises(StratumError, match="peak_flops = 'fast' must be a number"):
        hardware_from_table({**table, "devices": [{"name": "x", "memory_bytes": 1, "peak_flops": "fast"}]})


def test_counts_of_a_gpt_match_the_closed_forms():
    model = build_gpt("tiny", vocab_size=100, seed=0, device="meta")
    t, d, v = 16, 64, 100
    work = count_work(model, seq_len=t)
    # linear layers 12 d² weights: 6 FLOPs per weight and token for forward + backward; attention's two
    # T × T × d products, forward and twice in the backward: 12 T² d; the head 6 V d T; the embedding none
    assert work.flops == (0.0, 72 * d * d * t + 12 * t * t * d, 72 * d * d * t + 12 * t * t * d, 6 * v * d * t)
    assert work.kernels[1] == work.kernels[2] > work.kernels[3] > work.kernels[0] > 0


def _costs(n: int) -> Costs:
    z = [0.0] * n
    return Costs(f=z, b=z, i=z, w=z, act_bytes=z, out_bytes=z, param_bytes=z)


def test_the_planner_keeps_a_launch_bound_block_narrow_and_widens_a_flop_bound_one():
    # block 0: 100 kernels, 1e8 FLOPs a sample; block 1: 10 kernels, 1e10 FLOPs a sample; 8 samples
    compute = Compute(device=GPU, work=Work(kernels=[100, 10], flops=[1e8, 1e10]), samples=8)
    # block 0 at width 1: max(1 ms, (8e8 + 1e8)/1e12 = 0.9 ms) = 1 ms; at width 8: max(1 ms, 0.2 ms) = 1 ms
    # block 1 at width 1: (8e10 + 1e7)/1e12 = 80.01 ms; at width 8: (1e10 + 1e7)/1e12 = 10.01 ms
    plan = plan_burst(_costs(2), devices=8, link=Link(bandwidth=1e9, latency=0.0), amplification=1.5,
                      compute=compute)
    assert plan.widths == (1, 8)
    assert plan.compute_s == pytest.approx((1e-3, 10.01e-3))
    assert plan.step_s == pytest.approx(11.01e-3) and plan.device_s == pytest.approx(1e-3 + 8 * 10.01e-3)
    # data parallelism on 8: the same step, block 0 busy on all 8 for nothing
    dp = price_burst(_costs(2), [8, 8], devices=8, link=Link(bandwidth=1e9, latency=0.0), compute=compute)
    assert dp.step_s == pytest.approx(plan.step_s) and dp.idle_s == pytest.approx(0.0)
    with pytest.raises(StratumError, match="the work counts 2 blocks, the costs 3"):
        plan_burst(_costs(3), devices=8, link=Link(bandwidth=1e9, latency=0.0), amplification=1.5,
                   compute=compute)


@pytest.mark.parametrize("seed", range(8))
def test_the_programme_equals_brute_force_on_the_device_model(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    z = [0.0] * n
    costs = Costs(f=z, b=z, i=z, w=z, act_bytes=z, out_bytes=[rng.choice([0, 1e4, 1e6]) for _ in range(n)],
                  param_bytes=[rng.choice([0, 1e3, 1e6, 1e7]) for _ in range(n)])
    compute = Compute(device=GPU, work=Work(kernels=[rng.randint(1, 200) for _ in range(n)],
                                            flops=[rng.choice([0.0, 1e7, 1e9, 1e11]) for _ in range(n)]),
                      samples=rng.choice([1, 4, 16]))
    link = Link(bandwidth=rng.choice([1e8, 1e10]), latency=rng.choice([0.0, 1e-5]))
    args = dict(devices=rng.choice([3, 4, 8]), link=link, amplification=rng.choice([1.0, 2.0, 4.0]), compute=compute)
    dp, bf = plan_burst(costs, **args), brute_force(costs, **args)
    assert (dp.step_s, dp.device_s) == pytest.approx((bf.step_s, bf.device_s), rel=1e-12)


def test_the_simulator_prices_a_step_on_the_device_model():
    hw = Hardware.uniform(2, memory_bytes=10**10, intra=Link(bandwidth=1e9, latency=0.0))
    hw = replace(hw, devices=(GPU, replace(GPU, node=0)))
    costs = Costs(f=[9.0, 9.0], b=[9.0, 9.0], i=[0, 0], w=[0, 0], act_bytes=[0, 0], out_bytes=[0, 0],
                  param_bytes=[0, 10**9])
    mc = ModelCosts(costs=costs, state_bytes=5 * 10**9, work=Work(kernels=[100, 10], flops=[1e8, 1e10]))
    # batch 4 on 2 devices, 2 samples each: block 0 max(1 ms, (2e8 + 1e8)/1e12) = 1 ms, block 1
    # (2e10 + 1e7)/1e12 = 20.01 ms (the profiled 9 s times play no part but their split: half is backward).
    # Block 1's 1 GB gradient's ring all-reduce, 2 · 1/2 · 1 s = 1 s, starts after its backward, beside block
    # 0's 0.5 ms backward, and ends the step; both devices busy throughout
    step = dp_step(mc, batch=4, ranks=[0, 1], hw=hw)
    assert step.step_s == pytest.approx(0.5e-3 + 20.01e-3 + 1.0)
    assert step.rank_busy_s == pytest.approx((step.step_s, step.step_s))
    # a resize moves the 5 GB state over the host link twice (25 GB/s + 10 µs) and starts up again
    job = Job(id="j", arrival_s=0, model="m", batch=4, steps=1, devices=1)
    el = Elastic(Cluster.of(hw, [job], {("m", 1024): mc}), startup_s=30.0)
    assert el.restart_s(job) == pytest.approx(2 * (1e-5 + 5e9 / 25e9) + 30.0)


def test_a_model_no_profile_measured_is_counted_from_shapes():
    import torch
    import torch.nn.functional as F
    from torch import nn

    from stratum.cluster.models import counted_costs
    from stratum.model.blockseq import BlockSeq, ModelInfo

    with torch.device("meta"):
        model = BlockSeq([nn.Linear(8, 16), nn.Linear(16, 4)], F.cross_entropy, ModelInfo(name="mlp"))
    x, y = torch.empty(1, 8, device="meta"), torch.zeros(1, dtype=torch.long, device="meta")
    mc = counted_costs(model, x, y, reference_flops=1e3)
    # block 0's input needs no gradient: forward and weight gradient, 2 · 2 · 8 · 16; block 1 also passes the
    # gradient back: 3 · 2 · 16 · 4
    assert mc.work.flops == (512.0, 384.0)
    assert mc.costs.f == pytest.approx((512 / 3e3, 384 / 3e3)) and mc.seq_s == pytest.approx(0.896)
    assert mc.costs.param_bytes == ((8 * 16 + 16) * 4, (16 * 4 + 4) * 4) and mc.costs.out_bytes == (16 * 4, 0)
    assert mc.state_bytes == 4 * 4 * (8 * 16 + 16 + 16 * 4 + 4)  # parameters, gradients, two AdamW moments


def test_a_tied_gradient_is_charged_to_its_last_user():
    from stratum.cluster.models import tied_to_last_user

    model = build_gpt("tiny", vocab_size=100, seed=0, device="meta")
    costs = Costs(f=[0.0] * 4, b=[0.0] * 4, i=[0.0] * 4, w=[0.0] * 4, act_bytes=[0] * 4, out_bytes=[0] * 4,
                  param_bytes=[1_000_000, 7, 7, 5])
    moved = tied_to_last_user(costs, model)
    assert moved.param_bytes == (1_000_000 - 100 * 64 * 4, 7, 7, 5 + 100 * 64 * 4)  # the 100 × 64 embedding
