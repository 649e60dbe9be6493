"""Partitioner: DP bottleneck = brute force, speeds, memory limits, real profile, costs for the simulator."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from stratum.errors import StratumError
from stratum.plan.partition import Partition, evaluate, inflight_from_schedule, partition, stage_costs
from stratum.profile import BlockProfile, Profile
from stratum.schedule.generators import generate, wave_stage_to_rank
from stratum.sim.pipeline import simulate


def _profile(times, *, state=None, act=None, out=100) -> Profile:
    n = len(times)
    state = state or [0] * n
    act = act or [0] * n
    blocks = [BlockProfile(index=i, name=f"b{i}", kind="X", n_params=0, param_bytes=state[i], grad_bytes=0,
                           optim_bytes=0, act_saved_bytes=act[i], out_bytes=out, fwd_s=t / 3, bwd_s=2 * t / 3,
                           bwd_input_s=t / 3) for i, t in enumerate(times)]
    return Profile(model="synthetic", device="cpu", dtype="float32", precision="fp32", micro_batch=1, seq_len=1,
                   runs=1, blocks=blocks)


def _brute(prof, s2r, speeds=None, limits=None, inflight=None):
    n, S = len(prof.blocks), len(s2r)
    best = None
    for cuts in itertools.combinations(range(1, n), S - 1):
        b = (0,) + cuts + (n,)
        p = evaluate(prof, [range(b[s], b[s + 1]) for s in range(S)], s2r, speeds=speeds, inflight=inflight)
        if limits is not None and any(x > lim * (1 + 1e-12) for x, lim in zip(p.rank_bytes, limits)):
            continue
        if best is None or p.bottleneck_s < best:
            best = p.bottleneck_s
    return best


def test_equal_blocks_split_evenly():
    p = partition(_profile([1.0] * 8), [0, 1, 2, 3])
    assert [len(r) for r in p.stages] == [2, 2, 2, 2]
    assert p.bottleneck_s == pytest.approx(2.0) and p.exact
    assert "bottleneck" in p.table() and "stage" in str(p)


def test_heavy_block_is_isolated():
    p = partition(_profile([1, 1, 1, 9, 1, 1, 1]), [0, 1, 2])
    assert range(3, 4) in p.stages
    assert p.bottleneck_s == pytest.approx(9.0)


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(4, 9)
    times = [rng.choice([0.5, 1, 2, 3, 5]) * rng.random() + 0.1 for _ in range(n)]
    P = rng.choice([1, 2, 3])
    kind = rng.choice(["one", "wave", "interleaved"])
    if kind == "one":
        s2r = list(range(P))
    elif kind == "wave":
        s2r = list(wave_stage_to_rank(P, 1))
    else:
        s2r = [s % P for s in range(2 * P)]
    if len(s2r) > n:
        s2r = list(range(min(P, n)))
    P = max(s2r) + 1
    speeds = [rng.choice([1.0, 1.5, 2.0]) for _ in range(P)]
    prof = _profile(times)
    p = partition(prof, s2r, speeds=speeds)
    assert p.exact
    assert p.bottleneck_s == pytest.approx(_brute(prof, s2r, speeds))


@pytest.mark.parametrize("seed", range(6))
def test_dp_with_memory_limits_equals_brute_force(seed):
    rng = random.Random(100 + seed)
    n = rng.randint(5, 8)
    times = [rng.random() + 0.1 for _ in range(n)]
    state = [rng.randint(1, 10) * 100 for _ in range(n)]
    act = [rng.randint(1, 10) * 10 for _ in range(n)]
    s2r = list(wave_stage_to_rank(2, 1)) if seed % 2 else [0, 1, 2]
    P = max(s2r) + 1
    prof = _profile(times, state=state, act=act)
    free = partition(prof, s2r, inflight=2)
    limits = [max(free.rank_bytes) * 0.8] * P
    want = _brute(prof, s2r, limits=limits, inflight=2)
    if want is None:
        with pytest.raises(StratumError, match="smallest per-rank limit"):
            partition(prof, s2r, mem_limits=limits, inflight=2)
    else:
        p = partition(prof, s2r, mem_limits=limits, inflight=2)
        assert p.bottleneck_s == pytest.approx(want)
        assert all(x <= lim * (1 + 1e-9) for x, lim in zip(p.rank_bytes, limits))


def test_one_stage_per_rank_past_the_beam_falls_back_to_the_heuristic():
    # a small beam gives the exact search up at once; without a heuristic cut this was a TypeError
    prof = _profile([1.0 + 0.01 * i for i in range(40)])
    got = partition(prof, [0, 1], beam=1)
    assert got.bottleneck_s == pytest.approx(_brute(prof, [0, 1]))


def test_faster_rank_gets_proportionally_more_blocks():
    p = partition(_profile([1.0] * 9), [0, 1], speeds=[1.0, 2.0])
    assert [len(r) for r in p.stages] == [3, 6]
    assert p.rank_time_s == pytest.approx((3.0, 3.0))


def test_memory_limits_respected_and_infeasible_names_smallest_limit():
    prof = _profile([1.0] * 4, state=[100, 100, 100, 700], act=[10] * 4)
    free = partition(prof, [0, 1], inflight=[2, 1])
    assert [len(r) for r in free.stages] == [2, 2]          # time-balanced: rank 1 holds 800 + 20 bytes
    p = partition(prof, [0, 1], inflight=[2, 1], mem_limits=[1000, 750])
    assert [len(r) for r in p.stages] == [3, 1]             # block 3 alone fits rank 1's 750 bytes
    assert p.rank_bytes == (360.0, 710.0)
    # the smallest limit any cut meets: blocks 0-2 (300 + 3x10x2 = 360) / block 3 (700 + 10 = 710)
    with pytest.raises(StratumError, match="smallest per-rank limit that fits is 710 bytes"):
        partition(prof, [0, 1], inflight=[2, 1], mem_limits=[700, 700])


def test_bad_inputs():
    prof = _profile([1.0] * 3)
    with pytest.raises(StratumError, match="non-empty stages"):
        partition(prof, [0, 1, 2, 3])
    with pytest.raises(StratumError, match="no stage to rank"):
        partition(prof, [0, 2])
    with pytest.raises(StratumError, match="speeds"):
        partition(prof, [0, 1], speeds=[1.0])
    with pytest.raises(StratumError, match="inflight"):
        partition(prof, [0, 1], inflight=[1, 2, 3])


def test_inflight_from_schedule_matches_1f1b():
    assert inflight_from_schedule(generate("1f1b", ranks=4, microbatches=8)) == [4, 3, 2, 1]
    assert inflight_from_schedule(generate("gpipe", ranks=2, microbatches=3)) == [3, 3]


def test_real_profile_of_tiny_gpt_and_stage_costs():
    from stratum.model.gpt import build_gpt
    from stratum.profile.profiler import profile_blockseq

    seq = build_gpt("tiny", vocab_size=256, seed=0)
    prof = profile_blockseq(seq, micro_batch=2, seq_len=16, device=torch.device("cpu"), runs=1)
    sched = generate("1f1b", ranks=2, microbatches=4)
    p = partition(prof, sched.stage_to_rank, inflight=inflight_from_schedule(sched))
    assert isinstance(p, Partition) and len(p.stages) == 2 and p.exact
    assert sum(len(r) for r in p.stages) == len(prof.blocks)
    assert p.bottleneck_s <= evaluate(prof, [range(0, 2), range(2, 4)], [0, 1]).bottleneck_s + 1e-12
    assert p.bottleneck_s == pytest.approx(_brute(prof, [0, 1]))
    costs = stage_costs(prof, p, latency=1e-4, bandwidth=1e9)
    assert costs.f[0] == pytest.approx(sum(b.fwd_s for b in prof.blocks[p.stages[0].start:p.stages[0].stop]))
    res = simulate(sched, costs)
    assert res.makespan > 0
    fast = stage_costs(prof, partition(prof, [0, 1], speeds=[2.0, 2.0]))
    assert sum(fast.f) == pytest.approx(sum(b.fwd_s for b in prof.blocks) / 2)
    # a rank's speed scales its times only: the bytes a stage keeps, spills and reduces stay the profile's
    assert sum(fast.spill_bytes) == sum(b.spill_bytes for b in prof.blocks) > 0
    assert sum(fast.param_bytes) == sum(b.param_bytes for b in prof.blocks) > 0


def test_cli_simulate_with_balanced_partition(tmp_path, capsys):
    import argparse

    from stratum.schedule import cli

    prof = _profile([1.0, 1.0, 1.0, 1.0, 5.0, 1.0], act=[10] * 6)
    path = tmp_path / "p.json"
    prof.save(path)
    outs = {}
    for how in ("even", "balanced"):
        ap = argparse.ArgumentParser(prog="stratum")
        cli.add_parser(ap.add_subparsers(dest="cmd"))
        args = ap.parse_args(f"schedule simulate --kind 1f1b --ranks 2 --microbatches 4 --profile {path} "
                             f"--partition {how}".split())
        assert cli.run(args) == 0
        outs[how] = capsys.readouterr().out
    assert "partition (dp)" in outs["balanced"] and "partition" not in outs["even"]
    mk = {h: float(o.split("makespan ")[1].split()[0]) for h, o in outs.items()}
    assert mk["balanced"] < mk["even"]
