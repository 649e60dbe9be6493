"""The joint plan over strategies that span several slots: the MILP equals a brute force on small cases, a
time-limited solve still returns a feasible plan, and the plan is a table; the cluster simulation by hand."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from stratum.errors import StratumError
from stratum.ir.hardware import Hardware, Link
from stratum.profile.profile import BlockProfile, Profile
from stratum.sweep.cluster_sim import ClusterJob, simulate_cluster
from stratum.sweep.gang import greedy_gang, plan_gang
from stratum.sweep.gang_plan import GangPlan, Option, gang_table, list_schedule
from stratum.sweep.strategies import job_options

pytest.importorskip("pulp")


def brute_force(options: dict[str, dict[str, Option]], free_at: list[float]) -> float:
    """Every option per job, every start order and every set of slots per job, each job started as early as its
    slots allow: any feasible schedule, sorted by start, is matched or beaten by one of these."""
    jobs = sorted(options)
    n = len(free_at)
    best = float("inf")
    for names in itertools.product(*(sorted(options[j]) for j in jobs)):
        picks = {j: (nm, options[j][nm]) for j, nm in zip(jobs, names)}
        if any(o.devices > n for _, o in picks.values()):
            continue
        subsets = [list(itertools.combinations(range(n), picks[j][1].devices)) for j in jobs]
        for slots in itertools.product(*subsets):
            fixed = dict(zip(jobs, slots))
            for order in itertools.permutations(jobs):
                placed = list_schedule(list(order), picks, free_at, fixed)
                best = min(best, max(p.end for p in placed.values()))
    return best


def check_feasible(plan: GangPlan, options: dict[str, dict[str, Option]], free_at: list[float]) -> None:
    assert sorted(plan.placed) == sorted(options)
    for job, p in plan.placed.items():
        opt = options[job][p.strategy]
        assert len(set(p.slots)) == opt.devices and p.end == pytest.approx(p.start + opt.seconds)
        assert all(p.start >= free_at[s] - 1e-9 for s in p.slots)
    for a, b in itertools.combinations(plan.placed.values(), 2):
        if set(a.slots) & set(b.slots):
            assert a.end <= b.start + 1e-9 or b.end <= a.start + 1e-9
    assert plan.makespan == pytest.approx(max(p.end for p in plan.placed.values()))


def random_case(rng: random.Random, jobs: int, slots: int) -> dict[str, dict[str, Option]]:
    out = {}
    for j in range(jobs):
        t = rng.uniform(1, 10)
        opts = {"plain": Option(seconds=round(t, 2))}
        for k in range(2, slots + 1):  # k slots: faster, but not k times (communication, bubbles)
            if rng.random() < 0.7:
                opts[f"replicate({k})"] = Option(seconds=round(t / k * rng.uniform(1.0, 1.4), 2), devices=k)
        out[f"j{j}"] = opts
    return out


@pytest.mark.parametrize("seed", range(6))
def test_milp_makespan_equals_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    slots = 2 + seed % 2
    options = random_case(rng, 3 + seed % 2 if slots == 2 else 3, slots)
    free_at = [0.0] + [round(rng.uniform(0, 3), 2) for _ in range(slots - 1)]
    plan = plan_gang(options, free_at, time_limit_s=20)
    check_feasible(plan, options, free_at)
    assert plan.makespan == pytest.approx(brute_force(options, free_at), abs=1e-6), gang_table(plan)


def test_a_job_over_both_slots_as_a_table():
    # a: 8 s on one slot or 4.2 s over both; b, c: 3 s each. b | c, then a over both, ends at 7.2 (as a first
    # does, but b and c end sooner); a on one slot beside b then c ends at 8.
    options = {"a": {"plain": Option(seconds=8), "replicate(2)": Option(seconds=4.2, devices=2)},
               "b": {"plain": Option(seconds=3)}, "c": {"plain": Option(seconds=3)}}
    plan = plan_gang(options, [0.0, 0.0], time_limit_s=10)
    assert gang_table(plan) == "\n".join([
        "   start      end  slots      job strategy",
        "       0        3  1          b plain",
        "       0        3  0          c plain",
        "       3      7.2  0,1        a replicate(2)"])
    assert plan.method == "milp" and plan.optimal


def test_a_solver_stopped_by_its_time_limit_still_returns_a_feasible_plan():
    options = random_case(random.Random(7), 14, 4)
    free_at = [0.0, 1.0, 0.5, 2.0]
    t0 = time.perf_counter()
    plan = plan_gang(options, free_at, time_limit_s=1.0)
    assert time.perf_counter() - t0 < 15  # the limit plus CBC's start and the model build
    check_feasible(plan, options, free_at)
    assert plan.makespan <= greedy_gang(options, free_at).makespan + 1e-9
    assert not plan.optimal


def _profile(fwd_s: float, param_bytes: int, act_bytes: int, blocks: int = 2) -> Profile:
    """A made-up profile: ``blocks`` identical blocks (backward twice the forward; AdamW: 2 more copies)."""
    return Profile(model="made-up", device="cpu", dtype="float32", precision="fp32", micro_batch=1, seq_len=8,
                   runs=1, blocks=[BlockProfile(index=i, name=f"b{i}", kind="Layer", n_params=param_bytes // 4,
                                                param_bytes=param_bytes, grad_bytes=param_bytes,
                                                optim_bytes=2 * param_bytes, act_saved_bytes=act_bytes,
                                                out_bytes=64, fwd_s=fwd_s, bwd_s=2 * fwd_s, bwd_input_s=fwd_s)
                                   for i in range(blocks)])


def test_a_cluster_simulation_by_hand_and_a_job_no_device_holds():
    # two devices of 10 kB; a job step = 2 blocks x (1 + 2) x fwd_s; 10 steps of one micro-batch
    hw = Hardware.uniform(2, memory_bytes=10_000, host_link=Link(bandwidth=1e12, latency=0.0))
    jobs = {"short": ClusterJob(profile=_profile(0.25, 400, 100), microbatches=1, steps=10),    # 15 s
            "short2": ClusterJob(profile=_profile(0.25, 400, 100), microbatches=1, steps=10),   # 15 s
            "long": ClusterJob(profile=_profile(0.5, 400, 100), microbatches=1, steps=10)}      # 30 s
    sim = simulate_cluster(jobs, hw, shard_blocks=1, time_limit_s=5)
    # fifo: short | short2, then long: 45 s; streaming costs nothing on this link: sharded-lrtf and planned
    # start the long job first and pack 60 device-seconds onto 2 devices: 30 s, the long job's own length
    assert sim.results["fifo"].makespan == pytest.approx(45.0)
    assert sim.results["sharded-lrtf"].makespan == pytest.approx(30.0)
    assert sim.results["planned"].makespan == pytest.approx(30.0)
    assert sim.options["long"]["local"].seconds == pytest.approx(30.0)
    # 8 kB of state per block: both blocks (16 kB) fit no device, even streamed 2 at a time; one per device does
    big = {"big": ClusterJob(profile=_profile(0.5, 2_000, 1_000), microbatches=1, steps=1)}
    with pytest.raises(StratumError, match=r"big: fits no single device.*only as pipeline\(2\)"):
        simulate_cluster(big, hw, shard_blocks=2, time_limit_s=5)


def test_a_big_cluster_offers_a_job_only_the_plans_it_can_use_and_a_streamed_job_must_fit_the_host():
    # 1,000 devices: replicas up to the step's 4 micro-batches, stages up to the 3 blocks — not 2 × 999 plans
    hw = Hardware.uniform(1000, memory_bytes=10_000, host_link=Link(bandwidth=1e12, latency=0.0))
    opts = job_options(_profile(0.25, 400, 100, blocks=3), microbatches=4, steps=10, hw=hw, max_devices=1000)
    assert set(opts) <= {"local", "replicate(2)", "replicate(3)", "replicate(4)", "pipeline(2)", "pipeline(3)",
                         "offload"}
    assert {"local", "replicate(4)", "pipeline(3)", "offload"} <= set(opts)
    # streamed (offload, sharded-lrtf), a job keeps 2 × (400 + 400 + 800) B of state on the host: 3,200 > 3,000
    small = Hardware.uniform(2, memory_bytes=10_000, host_bytes=3_000)
    with pytest.raises(StratumError, match=r"made-up: streamed from the host it keeps 3.12 KiB of training state "
                                           r"there, and the hardware's host holds 2.93 KiB"):
        simulate_cluster({"j": ClusterJob(profile=_profile(0.25, 400, 100), microbatches=1, steps=1)}, small,
                         shard_blocks=1, time_limit_s=5)


def test_a_gap_stops_the_solver_once_its_plan_is_proved_close_enough():
    # 24 jobs on 2 slots: proving the plan optimal runs to the limit; within 1 % of the optimum is proved at once
    options = random_case(random.Random(1), 24, 2)
    area = sum(min(o.seconds * o.devices for o in opts.values()) for opts in options.values()) / 2  # a lower bound
    t0 = time.perf_counter()
    plan = plan_gang(options, [0.0, 0.0], time_limit_s=60, gap=0.01)
    assert time.perf_counter() - t0 < 20 and plan.optimal  # (CBC's start included; the limit is 60 s)
    check_feasible(plan, options, [0.0, 0.0])
    assert plan.makespan <= area / (1 - 0.01)
