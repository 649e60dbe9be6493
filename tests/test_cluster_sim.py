"""The cluster simulator (SIMULATED): a two-job trace whose completion times are computed by hand for every
policy, the elastic programme against brute force, reports."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from stratum.cluster.cluster import Cluster
from stratum.cluster.models import ModelCosts
from stratum.cluster.policies import Elastic
from stratum.cluster.replay import PolicyConfig, replay
from stratum.cluster.report import table, write_json
from stratum.cluster.trace import Job, parse_trace
from stratum.errors import StratumError
from stratum.ir.costs import Costs
from stratum.ir.hardware import Hardware, Link

AMP, INTERFERENCE, STARTUP = 1.1, 0.1, 3.0
# two blocks of 1 + 2 s (forward + backward) per sequence; the first has 1 GB of gradients, which a 1 GB/s
# ring all-reduce over 2 devices moves in 2·(1/2)·1 s = 1 s, after the last backward: nothing left to hide it
MODEL = ModelCosts(costs=Costs(f=[1.0, 1.0], b=[2.0, 2.0], i=[1.0, 1.0], w=[1.0, 1.0], act_bytes=[0, 0],
                               out_bytes=[0, 0], param_bytes=[10**9, 0]), state_bytes=0)
HW = Hardware.uniform(2, memory_bytes=10**9, intra=Link(bandwidth=1e9, latency=0.0))
TRACE = ("job,arrival_s,model,batch,steps,devices,priority\n"
         "F,0,m,4,1,2,foreground\n"
         "G,0,m,1,2,1,background\n")


def ends(policy: str, interference: float = INTERFERENCE, model: ModelCosts = MODEL) -> dict[str, float]:
    jobs = parse_trace(TRACE, models=["m"], devices=2)
    (res,) = replay(HW, jobs, {("m", 1024): model}, [policy],
                    config=PolicyConfig(amplification=AMP, interference=interference, startup_s=STARTUP))
    return {j.id: j.end_s for j in res.jobs}


def c(k: int) -> float:
    """A block's forward + backward of F's 4 sequences (12 s on one device) on k devices: the profiled device,
    no kernel counts, so the time falls with the share."""
    return 12 / k


def test_static_dp_runs_requested_devices_first_come_first_served():
    f_end = c(2) + c(2) + 1.0  # both blocks at width 2, then the 1 s all-reduce
    assert ends("static-dp") == pytest.approx({"F": f_end, "G": f_end + 2 * 6.0})  # G waits, then 2 × 6 s
    # the gradient on the second block instead: its all-reduce runs beside the first block's 4 s backward
    late = ModelCosts(costs=replace(MODEL.costs, param_bytes=[0, 10**9]), state_bytes=0)
    assert ends("static-dp", model=late) == pytest.approx({"F": c(2) + c(2), "G": c(2) + c(2) + 2 * 6.0})


def test_burst_keeps_the_badly_scaling_block_narrow():
    # block 0 at width 2 would use 2·(c(2) + 1) = 14 device-s > 1.1 × 12: the limit keeps it at width 1
    assert 2 * (c(2) + 1) > AMP * 12 >= 2 * c(2)
    f_end = c(2) + 12.0
    assert ends("burst") == pytest.approx({"F": f_end, "G": f_end + 12.0})


def test_burst_multiplex_runs_the_background_job_in_the_idle_time():
    step = c(2) + 12.0                                       # F's burst plan: block 0 on rank 0, block 1 on both
    idle = 1 - c(2) / step                                   # rank 1 runs only block 1: 6 of every 18 s
    g_step = 6.0 / (idle * (1 - INTERFERENCE))               # G on rank 1's idle time
    f_end = step * (1 + INTERFERENCE)                        # F slowed while G shares rank 1
    g_left = 2 - f_end / g_step                              # G's steps left (of 2) when F ends
    assert ends("burst+multiplex") == pytest.approx({"F": f_end, "G": f_end + g_left * 6.0})
    assert ends("burst+multiplex")["G"] < ends("burst")["G"]


def test_a_guest_on_a_device_the_host_leaves_unused_runs_at_its_own_speed():
    # F over 3 devices: block 1 gets a 0.5 GB gradient, so width 3 (3 · (4 + 2·(2/3)·0.5) = 14 device-s) is over
    # the limit and width 2 (2 · (6 + 0.5) = 13 ≤ 13.2) is not: rank 2 is never used; its all-reduce (ranks 0
    # and 1) runs beside block 0's 8 s backward, so F's step is 4 + 2 + 4 + 8 = 18 s, as without it
    model = ModelCosts(costs=replace(MODEL.costs, param_bytes=[10**9, 5 * 10**8]), state_bytes=0)
    hw = Hardware.uniform(3, memory_bytes=10**9, intra=Link(bandwidth=1e9, latency=0.0))
    jobs = parse_trace(TRACE.replace("F,0,m,4,1,2,", "F,0,m,4,1,3,"), models=["m"], devices=3)
    (res,) = replay(hw, jobs, {("m", 1024): model}, ["burst+multiplex"],
                    config=PolicyConfig(amplification=AMP, interference=INTERFERENCE, startup_s=STARTUP))
    assert {j.id: j.start_s for j in res.jobs} == {"F": 0.0, "G": 0.0}
    assert {j.id: j.end_s for j in res.jobs} == pytest.approx({"F": 18.0, "G": 12.0})


def test_multiplexing_that_costs_the_host_more_than_it_gains_is_not_done():
    step, idle = c(2) + 12.0, 1 - (2 * c(2) + 12.0) / (2 * (c(2) + 12.0))
    gain = (1 / 6.0) * idle * (1 - 0.6) * 6.0                # G's work gained: sequences/s × 6 s per sequence
    loss = (4 / step) * 6.0 * 0.6 / 1.6                      # F's work lost to a 1.6× slower step
    assert gain < loss
    assert ends("burst+multiplex", interference=0.6) == pytest.approx(ends("burst"))


def test_elastic_shares_the_devices_then_grows_the_survivor():
    # speed-ups: F on 2 devices 24 / (2 c(2) + 1) < 2 = F and G on one each; G (batch 1) cannot use two
    assert 24 / (2 * c(2) + 1) < 2
    g_end = 12.0                                             # G: 2 sequences × 6 s on its own device
    # F did 2 of 4 sequences, then restarts on 2 devices (no state to move: the start-up alone) for the rest
    f_end = g_end + STARTUP + 2 / (4 / (2 * c(2) + 1))
    assert ends("elastic") == pytest.approx({"F": f_end, "G": g_end})


def test_elastic_devices_keeps_the_batch_where_elastic_grows_it():
    # one job of 2 sequences (batch 1, max_batch 2) on 2 devices. At batch 1 it fits one device: 2 × (3 + 3) s.
    # At batch 2 over both: each block 3 s a device, then block 0's 1 GB all-reduce (1 s) with nothing to hide it
    jobs = [Job(id="a", arrival_s=0, model="m", batch=1, steps=2, devices=1, max_batch=2)]
    got = {p: r for p, r in zip(("elastic", "elastic-devices"), replay(
        HW, jobs, {("m", 1024): MODEL}, ["elastic", "elastic-devices"], config=PolicyConfig(startup_s=STARTUP)))}
    assert got["elastic"].jobs[0].end_s == pytest.approx(3.0 + 3.0 + 1.0)
    assert got["elastic-devices"].jobs[0].end_s == pytest.approx(2 * 6.0)


def test_elastic_programme_equals_brute_force():
    hw = Hardware.uniform(5, memory_bytes=10**9, intra=Link(bandwidth=2e9, latency=1e-3))
    models = {("m", 1024): MODEL, ("n", 1024): ModelCosts(costs=Costs(
        f=[2.0], b=[4.0], i=[2.0], w=[2.0], act_bytes=[0], out_bytes=[0], param_bytes=[3 * 10**9]), state_bytes=0)}
    jobs = [Job(id="a", arrival_s=0, model="m", batch=4, steps=1, devices=1, max_batch=8),
            Job(id="b", arrival_s=0, model="n", batch=2, steps=1, devices=1),
            Job(id="c", arrival_s=0, model="m", batch=3, steps=1, devices=1)]
    el = Elastic(Cluster.of(hw, jobs, models), startup_s=STARTUP)
    curves = [el.curve(j) for j in jobs]

    def value(counts):
        return sum(cv[n][0] / cv[1][0] for cv, n in zip(curves, counts) if n)
    best = max((ns for ns in itertools.product(*[range(len(cv)) for cv in curves]) if sum(ns) <= 5), key=value)
    assert value(el.counts(jobs)) == pytest.approx(value(best), rel=1e-9)
    assert sum(el.counts(jobs)) <= 5


def test_reports_are_labelled_and_written(tmp_path):  # the PNG: test_cluster_trace's CLI run
    jobs = parse_trace(TRACE, models=["m"], devices=2)
    results = replay(HW, jobs, {("m", 1024): MODEL}, ["static-dp", "burst", "burst+multiplex", "elastic"],
                     config=PolicyConfig(amplification=AMP, interference=INTERFERENCE, startup_s=STARTUP))
    # static-dp by hand: JCTs 13 and 25 s (mean 19, p95 13 + 0.95·12 = 24.4), 2 jobs in 25 s = 288 an hour,
    # 36 s of one-device work over 25 s = 1.44, busy 2 × 13 + 12 device-s over 2 × 25 = 76 %
    assert table(results) == """\
SIMULATED (cost-model predictions, not measurements)
policy                done  avg JCT s  p95 JCT s   jobs/h  work rate   util
---------------------------------------------------------------------------
static-dp           2/2            19       24.4      288       1.44  76.0%
burst               2/2            24       29.4      240        1.2  60.0%
burst+multiplex     2/2         19.86      19.91    361.4      1.807  90.4%
elastic             2/2         16.75      21.02    334.9      1.674  86.0%"""
    # elastic: F's 3 s restart holds both devices idle: busy 2 × 12 + 2 × 6.5 device-s over 2 × 21.5 = 86 %
    write_json(tmp_path / "s.json", results)
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["label"] == "SIMULATED"
    assert [p["summary"]["completed"] for p in doc["policies"]] == [2, 2, 2, 2]
    assert doc["policies"][0]["jobs"][1] == {"id": "G", "arrival_s": 0.0, "start_s": pytest.approx(13.0),
                                             "end_s": pytest.approx(25.0), "jct_s": pytest.approx(25.0),
                                             "done": 1.0}


def test_a_host_takes_guests_when_together_they_gain_more_than_it_loses():
    # F over 3 devices: block 0 on rank 0 (12 s), block 1 on all three (4 s): ranks 1 and 2 idle 12 of 16 s.
    # interference 0.5: one guest gains (1/6)·0.75·(1 − 0.5)·6 = 0.375 profiled-s/s, F loses (4/16)·6·0.5/1.5 =
    # 0.5; two guests (two such devices, two jobs waiting) gain 0.75 > 0.5
    idle, step = 1 - c(3) / (12.0 + c(3)), 12.0 + c(3)
    gain, loss = (1 / 6.0) * idle * 0.5 * 6.0, (4 / step) * 6.0 * 0.5 / 1.5
    assert gain < loss < 2 * gain
    hw = Hardware.uniform(3, memory_bytes=10**9, intra=Link(bandwidth=1e9, latency=0.0))
    config = PolicyConfig(amplification=AMP, interference=0.5, startup_s=STARTUP)
    starts = {}
    for trace in (TRACE, TRACE + "H,0,m,1,2,1,background\n"):
        jobs = parse_trace(trace.replace("F,0,m,4,1,2,", "F,0,m,4,1,3,"), models=["m"], devices=3)
        (res,) = replay(hw, jobs, {("m", 1024): MODEL}, ["burst+multiplex"], config=config)
        starts[len(jobs)] = {j.id: j.start_s for j in res.jobs}
    assert starts[2]["G"] == pytest.approx(step)  # alone, G waits for F to end
    assert starts[3] == {"F": 0.0, "G": 0.0, "H": 0.0}


# ---- devices of mixed memory: a job runs only on devices that hold it ----------------------------------------------
BIG = ModelCosts(costs=MODEL.costs, state_bytes=3 * 10**9 // 2)  # 1.5 GB: only the 2 GB device holds it
MIXED = replace(HW, devices=(replace(HW.devices[0], memory_bytes=2 * 10**9), HW.devices[1]))  # rank 0: 2 GB, 1: 1 GB
PAIR = ("job,arrival_s,model,batch,steps,devices,priority\n"
        "S,0,m,1,2,1,background\n"  # first in the queue, held by both devices: it takes the smaller
        "B,0,big,1,2,1,background\n")


@pytest.mark.parametrize("policy", ["static-dp", "burst", "burst+multiplex", "elastic", "elastic-devices"])
def test_a_job_takes_the_smallest_device_that_holds_it_and_leaves_the_larger_to_the_job_that_needs_it(policy):
    # each job trains its 2 sequences at 6 s each on a device of its own, both from the start; given rank 0
    # first (the smallest rank), S would have left B only the 1 GB device, and B would have waited 12 s for it
    jobs = parse_trace(PAIR, models=["m", "big"], devices=2)
    (res,) = replay(MIXED, jobs, {("m", 1024): MODEL, ("big", 1024): BIG}, [policy],
                    config=PolicyConfig(amplification=AMP, interference=INTERFERENCE, startup_s=STARTUP))
    assert {j.id: (j.start_s, j.end_s) for j in res.jobs} == {"S": (0.0, 12.0), "B": (0.0, 12.0)}


def test_elastic_gives_a_job_only_devices_that_hold_it_and_resizes_it_when_they_free():
    # B (held by rank 0 alone) may use one device; S (batch 2) could use both, but sharing them is worth more
    jobs = parse_trace(PAIR.replace("S,0,m,1,2,1,", "S,0,m,2,1,1,"), models=["m", "big"], devices=2)
    cluster = Cluster.of(MIXED, jobs, {("m", 1024): MODEL, ("big", 1024): BIG})
    assert cluster.holders == {"S": (1, 0), "B": (0,)}
    el = Elastic(cluster, startup_s=STARTUP)
    assert len(el.curve(jobs[1])) == 2  # B: none or rank 0
    runs = el.allocate(0.0, jobs, {})
    assert {k: r.ranks for k, r in runs.items()} == {"B": (0,), "S": (1,)}
    # B ends: S is resized onto both (a checkpoint-restart), and a job kept where it was pays none
    again = el.allocate(12.0, jobs[:1], runs)
    assert again["S"].ranks == (0, 1) and again["S"].restart_s == STARTUP
    assert el.allocate(13.0, jobs[:1], again) == again


def test_a_guest_shares_a_device_only_where_its_memory_holds_both_jobs():
    # each job alone fits a 1 GB device, both together do not: the background job waits as under burst
    half = ModelCosts(costs=MODEL.costs, state_bytes=6 * 10**8)
    jobs = parse_trace(TRACE, models=["m"], devices=2)
    (res,) = replay(HW, jobs, {("m", 1024): half}, ["burst+multiplex"],
                    config=PolicyConfig(amplification=AMP, interference=INTERFERENCE, startup_s=STARTUP))
    assert {j.id: j.end_s for j in res.jobs} == pytest.approx(ends("burst"))


@pytest.mark.parametrize(("trace", "message"), [
    ("B,0,big,2,1,2,background\n", r"job 'B' \(big, seq_len 1024\) needs 1\.4 GiB per device .*, which 1 of the "
                                   r"devices hold, but it asks for 2; ask for at most 1"),
    ("H,0,huge,1,1,1,background\n", r"job 'H' \(huge, seq_len 1024\) needs 4\.7 GiB per device .* but the largest "
                                    r"device, 'device', holds 1\.9 GiB"),
])
def test_a_job_too_large_for_the_devices_it_asks_for_is_one_line(trace, message):
    huge = ModelCosts(costs=MODEL.costs, state_bytes=5 * 10**9)
    jobs = parse_trace("job,arrival_s,model,batch,steps,devices,priority\n" + trace, models=["big", "huge"],
                       devices=2)
    with pytest.raises(StratumError, match=message):
        Cluster.of(MIXED, jobs, {("big", 1024): BIG, ("huge", 1024): huge})
