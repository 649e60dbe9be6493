"""Auto plan search: the cost model's step time and peak memory of small trees match hand-computed values, the
search ranks every tree and returns the brute-force best, and infeasible trees are listed with the reason."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import pytest

from stratum.errors import StratumError
from stratum.ir.costs import StepCosts
from stratum.ir.hardware import Device, Hardware, Link
from stratum.ir.plan import Offload, parse_plan
from stratum.ir.prices import allreduce_s
from stratum.plan.predict import Workload, predict
from stratum.plan.search import SCHEDULES, search
from stratum.profile.profile import BlockProfile, Profile

LINK = Link(bandwidth=1e8, latency=1e-4)
MiB = 2**20


def _block(i: int, f: float, params: int, act: int, out: int) -> BlockProfile:
    return BlockProfile(index=i, name=f"b{i}", kind="Toy", n_params=params, param_bytes=4 * params,
                        grad_bytes=4 * params, optim_bytes=8 * params, act_saved_bytes=act, out_bytes=out,
                        fwd_s=f, bwd_s=2 * f, bwd_input_s=f)


def _profile(fs=(0.001, 0.004, 0.004, 0.002), params=(1000, 100_000, 100_000, 1000)) -> Profile:
    blocks = [_block(i, f, p, act=1000 * (i + 1), out=4000) for i, (f, p) in enumerate(zip(fs, params))]
    return Profile(model="toy", device="cpu", dtype="float32", precision="fp32", micro_batch=1, seq_len=8, runs=1,
                   blocks=blocks)


def _work(microbatches=4, **kw) -> Workload:
    return Workload(profile=_profile(**kw), microbatches=microbatches, splittable=(1, 2), split_sizes=(2, 4),
                    profile_path="toy.json")


def _hw(n=4, memory=64 * MiB) -> Hardware:
    return Hardware.uniform(n, memory_bytes=memory, intra=LINK)


def test_replicate_is_its_share_of_micro_batches_plus_a_ring_all_reduce():
    prof = _profile()
    pred = predict(parse_plan("replicate(2)"), _work(), _hw(2))
    compute = 2 * sum(3 * b.fwd_s for b in prof.blocks)  # 4 micro-batches over 2 replicas, f + b = 3f
    scalar = allreduce_s(8, 2, LINK)  # one float64: 2(n-1) latencies and 8 bytes
    reduce = allreduce_s(sum(b.param_bytes for b in prof.blocks), 2, LINK) + scalar  # gradients (one bucket), loss
    assert pred.compute_s == pytest.approx(compute) and pred.reduce_s == pytest.approx(reduce)
    assert pred.step_s == pytest.approx(compute + reduce) and pred.bubble == 0
    assert pred.peak_bytes == (prof.train_state_bytes + prof.act_saved_bytes,) * 2
    sharded = predict(parse_plan("replicate(2, shard=true)"), _work(), _hw(2))
    assert sharded.step_s == pytest.approx(pred.step_s + scalar)  # and the gradient norm's all-reduce
    # the update: every parameter on each replica, half of them under shard=true, at 1 us per parameter
    timed = replace(_work(), update_s_per_param=1e-6)
    assert predict(parse_plan("replicate(2)"), timed, _hw(2)).update_s == pytest.approx(prof.n_params * 1e-6)
    half = predict(parse_plan("replicate(2, shard=true)"), timed, _hw(2))
    assert half.update_s == pytest.approx(prof.n_params * 1e-6 / 2)
    assert half.step_s == pytest.approx(sharded.step_s + half.update_s)
    assert sharded.peak_bytes[0] == 4 * prof.n_params + 12 * prof.n_params // 2 + prof.act_saved_bytes


def test_split_divides_layers_and_adds_two_reductions_each_way():
    prof = _profile()
    pred = predict(parse_plan("split(2)"), _work(), _hw(2))
    f = [b.fwd_s for b in prof.blocks]
    comm = 2 * allreduce_s(4000, 2, LINK)  # per split block, per direction
    per_mb = 3 * f[0] + 3 * f[3] + sum(3 * f[k] / 2 + 2 * comm for k in (1, 2))
    assert pred.step_s == pytest.approx(4 * per_mb + allreduce_s(8, 2, LINK))  # and the norm's all-reduce
    # DTensor's dispatch: 3 ms per split block (2 of them) and micro-batch (4), 10 ms a step
    dt = predict(parse_plan("split(2)"), replace(_work(), step=StepCosts(split_block_s=0.003, split_fixed_s=0.01)),
                 _hw(2))
    assert dt.step_s == pytest.approx(pred.step_s + 4 * 2 * 0.003 + 0.01)
    assert dt.overhead_s == pytest.approx(0.01)
    # the blocks at twice the profile's pace when the step costs were measured: every block takes twice as long
    slow = predict(parse_plan("split(2)"), replace(_work(), step=StepCosts(block_scale=2.0)), _hw(2))
    assert slow.step_s == pytest.approx(4 * (per_mb + 3 * f[0] + 3 * f[3] + sum(3 * f[k] / 2 for k in (1, 2)))
                                        + allreduce_s(8, 2, LINK))
    state = [16 * b.n_params for b in prof.blocks]
    act = [b.act_saved_bytes for b in prof.blocks]
    assert pred.peak_bytes[0] == state[0] + state[3] + (state[1] + state[2]) // 2 + act[0] + act[3] + \
        (act[1] + act[2]) // 2


def test_every_rank_pays_the_steps_own_costs_for_its_micro_batches_at_its_speed():
    work = replace(_work(), step=StepCosts(fixed_s=0.01, per_microbatch_s=0.002))
    base = predict(parse_plan("replicate(2)"), _work(), _hw(2))
    pred = predict(parse_plan("replicate(2)"), work, _hw(2))
    assert pred.overhead_s == pytest.approx(0.01 + 2 * 0.002)  # 4 micro-batches over 2 replicas: 2 each
    assert pred.step_s == pytest.approx(base.step_s + pred.overhead_s)
    slow = replace(_hw(2), devices=(Device(name="a", memory_bytes=64 * MiB),
                                    Device(name="b", memory_bytes=64 * MiB, speed=0.5)))
    assert predict(parse_plan("replicate(2)"), work, slow).overhead_s == pytest.approx(2 * 0.014)
    # a pipeline rank pays the fixed part, and its loss and norm all-reduce over the pipeline
    pipe = predict(parse_plan("pipeline(2, schedule=gpipe, partition=even)"), work, _hw(2))
    assert pipe.overhead_s == pytest.approx(0.01)
    assert pipe.reduce_s == pytest.approx(2 * allreduce_s(8, 2, LINK))


def test_a_pipeline_rank_pays_the_runtimes_cost_per_action_inside_the_schedule():
    work = _work(fs=(0.002,) * 4, params=(1000,) * 4)
    fast = Hardware.uniform(2, memory_bytes=64 * MiB, intra=Link(bandwidth=float("inf"), latency=0.0))
    gpipe = parse_plan("pipeline(2, schedule=gpipe, partition=even)")
    base = predict(gpipe, work, fast)
    costed = predict(gpipe, replace(work, step=StepCosts(per_microbatch_s=0.002, per_action_s=0.001)), fast)
    # GPipe's m + P - 1 slots of a forward and a backward, each action 1 ms longer; no per-micro-batch part
    assert costed.compute_s == pytest.approx(base.compute_s + (4 + 2 - 1) * 2 * 0.001)
    assert costed.overhead_s == 0 and costed.step_s == pytest.approx(base.step_s + 5 * 2 * 0.001)
    # on one rank (no bubble) every action adds its 1 ms: 1f1b's F and B per micro-batch, zero-bubble's F, I and W
    one = Hardware.uniform(1, memory_bytes=64 * MiB, intra=LINK)
    for kind, actions in (("1f1b", 2), ("zb-1f1b", 3)):
        tree = parse_plan(f"pipeline(1, schedule={kind}, partition=even)")
        plain = predict(tree, work, one).compute_s
        assert plain == pytest.approx(4 * 3 * 4 * 0.002)  # 4 micro-batches of 4 blocks, f + b = 3f
        assert predict(tree, replace(work, step=StepCosts(per_action_s=0.001)), one).compute_s == \
            pytest.approx(plain + 4 * actions * 0.001)
    # a rank at half speed pays its actions at its pace
    slow = replace(fast, devices=(Device(name="a", memory_bytes=64 * MiB), Device(name="b", memory_bytes=64 * MiB,
                                                                                     speed=0.5)))
    assert predict(gpipe, replace(work, step=StepCosts(per_action_s=0.001)), slow).compute_s > costed.compute_s


def test_a_gpipe_pipeline_of_equal_stages_takes_m_plus_p_minus_one_slots():
    work = _work(fs=(0.002,) * 4, params=(1000,) * 4)
    fast = Hardware.uniform(2, memory_bytes=64 * MiB, intra=Link(bandwidth=float("inf"), latency=0.0))
    pred = predict(parse_plan("pipeline(2, schedule=gpipe, partition=even)"), work, fast)
    assert pred.compute_s == pytest.approx((4 + 2 - 1) * 2 * 0.006)  # (m + P - 1) (F + B), 2 blocks a stage
    assert pred.bubble == pytest.approx(1 - 4 / 5) and pred.stages == ((0, 2), (2, 4))
    # GPipe holds all 4 micro-batches' activations on rank 0 (blocks 0, 1: 1000 + 2000 bytes each)
    assert pred.peak_bytes[0] == 2 * 16 * 1000 + 4 * 3000


def _brute_force(work, hw, n):
    best = None
    for r, p in itertools.product(range(1, n + 1), repeat=2):
        if n % (r * p):
            continue
        s = n // (r * p)
        inner = f"split({s})" if s > 1 else ""
        mids = [inner or "local"] if p == 1 else [
            f"pipeline({p}, schedule={k}, partition={part}{', ' + inner if inner else ''})"
            for k in SCHEDULES for part in ("even", "balanced", "toy.json")]
        for mid, shard in itertools.product(mids, ("false", "true")):
            text = mid if r == 1 else f"replicate({r}, shard={shard}, {mid})"
            try:
                pred = predict(parse_plan(text), work, hw)
            except StratumError:
                continue
            if pred.fits and (best is None or pred.step_s < best.step_s - 1e-12):
                best = pred
    return best


@pytest.mark.parametrize("n, memory", [(2, 64 * MiB), (4, 64 * MiB), (4, 2 * MiB)])
def test_the_search_returns_the_brute_force_best(n, memory):
    work, hw = _work(), _hw(4, memory)
    res = search(work, hw, n)
    assert res.complete and res.ranked
    assert res.best.step_s == pytest.approx(_brute_force(work, hw, n).step_s)
    assert [p.step_s for p in res.ranked] == sorted(p.step_s for p in res.ranked)


def test_infeasible_trees_are_listed_with_what_does_not_fit():
    res = search(_work(microbatches=2), _hw(4, memory=2 * MiB), 4)
    table = res.table()
    assert re.search(r"replicate\(2, pipeline\(2, schedule=wave, .*does not fit: rank 1 needs 3.06 MiB of its "
                     r"2.00 MiB \(2 of 4 ranks over\)", table)
    assert "cannot run: 2 micro-batches per step do not split evenly over 4 replicas" in table
    assert "cannot run: 8 stages but the model has 4 blocks" in table
    assert table.splitlines()[0].endswith("(SIMULATED: cost-model predictions)")
    assert all(max(p.peak_bytes) <= 2 * MiB for p in res.ranked)
    with pytest.raises(StratumError, match="no plan for 4 devices fits"):
        _ = search(_work(), _hw(4, memory=10_000), 4).best
    with pytest.raises(StratumError, match=r"8 devices asked for \(--devices or parallel.devices\) but the "
                                           r"hardware spec has 4;"):
        search(_work(), _hw(4), 8)


def test_where_nothing_fits_in_memory_the_offload_leaf_is_priced_by_its_planner():
    asked = []

    def offload(ask):
        asked.append((ask.microbatches, ask.device_budget, ask.host_budget, ask.splits, ask.blocks))
        if ask.device_budget < 5000:
            raise StratumError("no placement fits")
        return 0.5 * ask.microbatches, ask.device_budget - 1
    work = Workload(profile=_profile(), microbatches=4, offload=offload)
    hw = Hardware.uniform(2, memory_bytes=10_000, intra=LINK, host_bytes=10**9)
    res = search(work, hw, 2)
    best = res.best
    assert str(best.plan) == "replicate(2, offload(device_budget=10000, host_budget=500000000))"
    assert asked[0] == (2, 10_000, 500_000_000, 1, ()) and best.compute_s == 1.0 and best.peak_bytes == (9999, 9999)
    assert best.reduce_s == pytest.approx(allreduce_s(_profile().param_bytes, 2, LINK) + allreduce_s(8, 2, LINK))
    assert res.too_big and "does not fit" in res.table()
    tiny = search(work, Hardware.uniform(1, memory_bytes=1000, host_bytes=10**9), 1)
    assert not tiny.ranked and "offload(device_budget=1000, host_budget=1000000000)" in tiny.table()
    assert "cannot run: no placement fits" in tiny.table()


def _streaming_planner(asked):
    """A memory engine's planner in miniature: its micro-batches' block times, plus the state beyond the device
    budget read and written once per step at 100 MB/s; device peak min(budget, state + the saved activations of
    one micro-batch, or under a pipeline of the micro-batches in flight, kept)."""
    def price(ask):
        asked[ask.splits] = ask.profile
        asked["inflight"] = ask.inflight
        asked.setdefault("tensor_grads", []).append(ask.tensor_grads)
        prof = ask.profile
        n = ask.inflight or (1,) * len(prof.blocks)
        state, act = prof.train_state_bytes, sum(b.act_saved_bytes * k for b, k in zip(prof.blocks, n))
        step = ask.microbatches * sum(b.fwd_s + b.bwd_s for b in prof.blocks)
        return step + 2 * max(0, state + act - ask.device_budget) / 1e8, min(ask.device_budget, state + act)
    return price


def test_where_nothing_fits_split_over_offload_plans_each_ranks_shards():
    asked: dict = {}
    work = replace(_work(), offload=_streaming_planner(asked))
    prof = work.profile
    whole = prof.train_state_bytes
    hw = Hardware.uniform(2, memory_bytes=whole // 3, intra=LINK, host_bytes=10**9)  # not even half fits
    res = search(work, hw, 2)
    assert res.complete and all(isinstance(p.plan.leaf, Offload) for p in res.ranked)
    shown = {str(p.plan) for p in res.ranked}
    leaf = f"offload(device_budget={whole // 3}, host_budget=500000000)"
    assert {f"split(2, {leaf})", f"replicate(2, {leaf})", f"pipeline(2, schedule=gpipe, partition=even, {leaf})"} <= shown
    assert not any("zb-" in x for x in shown)  # the offload leaf does not run a split backward
    # the brute-force best over the trees it lists, each priced again
    listed = [p.plan for p in (*res.ranked, *res.too_big)]
    again = [predict(plan, work, hw) for plan in listed]
    assert res.best.step_s == pytest.approx(min(p.step_s for p in again if p.fits))
    split = next(p for p in res.ranked if p.plan.splits == 2)
    assert max(split.peak_bytes) <= hw.devices[0].memory_bytes < whole
    # each split rank plans 1/2 of the split blocks' (1, 2) state and saved activations, the others whole, and
    # its blocks' times hold half their work plus the group's two all-reduces of the output each way
    shard = asked[2]
    st = [b.param_bytes + b.grad_bytes + b.optim_bytes for b in prof.blocks]
    assert shard.train_state_bytes == st[0] + st[3] + (st[1] + st[2]) // 2 < whole
    assert shard.act_saved_bytes == prof.blocks[0].act_saved_bytes + prof.blocks[3].act_saved_bytes + sum(
        prof.blocks[k].act_saved_bytes // 2 for k in (1, 2))
    comm = 2 * allreduce_s(4000, 2, LINK)
    assert shard.blocks[1].fwd_s == pytest.approx(prof.blocks[1].fwd_s / 2 + comm)
    assert shard.blocks[1].bwd_s == pytest.approx(prof.blocks[1].bwd_s / 2 + comm)
    assert shard.blocks[0].fwd_s == prof.blocks[0].fwd_s
    # its step: the planner's for all 4 micro-batches of its shards, and the gradient norm over the split group
    planned = 4 * sum(b.fwd_s + b.bwd_s for b in shard.blocks) + 2 * (shard.train_state_bytes +
                                                                     shard.act_saved_bytes - whole // 3) / 1e8
    assert split.step_s == pytest.approx(planned + allreduce_s(8, 2, LINK))
    # and the step's own costs outside its blocks, for its 4 micro-batches, as every tree pays them
    costed = predict(split.plan, replace(work, step=StepCosts(fixed_s=0.01, per_microbatch_s=0.002)), hw)
    assert costed.overhead_s == pytest.approx(0.01 + 4 * 0.002)
    assert costed.step_s == pytest.approx(split.step_s + costed.overhead_s)
    # four devices: split(4, offload), the pipeline and replicate nestings over split(2, offload) too
    four = search(work, Hardware.uniform(4, memory_bytes=whole // 6, intra=LINK, host_bytes=10**9), 4)
    assert {"split(4, offload)", "replicate(2, split(2, offload))", "replicate(4, offload)",
            "pipeline(2, schedule=1f1b, partition=even, split(2, offload))",
            "replicate(2, pipeline(2, schedule=gpipe, partition=even, offload))"} <= {
        re.sub(r"offload\(.*?\)", "offload", str(p.plan)) for p in four.ranked}


def test_a_pipeline_over_offload_plans_each_pipeline_ranks_blocks():
    asked: dict = {}
    work = replace(_work(), offload=_streaming_planner(asked))
    whole = work.profile.train_state_bytes
    hw = Hardware.uniform(2, memory_bytes=whole // 3, intra=LINK, host_bytes=10**9)
    text = f"pipeline(2, schedule=gpipe, partition=even, offload(device_budget={whole // 3}, host_budget=10**6))"
    pred = predict(parse_plan(text.replace("10**6", "1000000")), work, hw)
    # each rank's engine got its blocks (even cut: 0-1, 2-3), each one's activations and kept input per
    # micro-batch, and the 4 micro-batches GPipe holds at once
    prof, last = work.profile, asked[1]
    assert [b.index for b in last.blocks] == [0, 1] and last.train_state_bytes == sum(
        b.param_bytes + b.grad_bytes + b.optim_bytes for b in prof.blocks[2:])
    assert last.blocks[0].act_saved_bytes == prof.blocks[2].act_saved_bytes + prof.blocks[1].out_bytes
    assert asked["inflight"] == (4, 4)
    # the schedule's makespan, plus the slowest rank's streaming beyond its blocks
    plain = predict(parse_plan("pipeline(2, schedule=gpipe, partition=even)"), work, hw)
    bs = prof.blocks
    held = [b.param_bytes + b.grad_bytes + b.optim_bytes + 4 * (b.act_saved_bytes + (bs[g - 1].out_bytes if g else 0))
            for g, b in enumerate(bs)]
    st = [sum(held[:2]), sum(held[2:])]
    extra = max(2 * max(0, x - whole // 3) / 1e8 for x in st)
    assert pred.compute_s == pytest.approx(plain.compute_s + extra) and pred.stages == ((0, 2), (2, 4))
    assert pred.bubble == pytest.approx(plain.bubble) and pred.peak_bytes == (whole // 3,) * 2  # both stream
    with pytest.raises(StratumError, match="splits the backward"):
        predict(parse_plan(text.replace("gpipe", "zb-1f1b").replace("10**6", "1000000")), work, hw)
    # a rank running one stage hands its 16-bit gradients over as the leaf's setting says; one running two (wave:
    # the first and last stages on rank 0, the middle two on rank 1) a tensor at a time, as it trains
    assert asked["tensor_grads"] == [False, False]
    asked["tensor_grads"] = []
    predict(parse_plan(text.replace("gpipe", "wave").replace("10**6", "1000000")), work, hw)
    assert asked["tensor_grads"] == [True, True]


def test_where_split_fits_in_memory_no_offload_tree_ranks_above_it_unless_faster():
    asked: dict = {}
    work = replace(_work(), offload=_streaming_planner(asked))
    whole = work.profile.train_state_bytes + work.profile.act_saved_bytes
    hw = Hardware.uniform(2, memory_bytes=int(whole * 0.7), intra=LINK, host_bytes=10**9)  # split(2) fits
    res = search(work, hw, 2)
    split = next(p for p in res.ranked if str(p.plan) == "split(2)")
    assert not asked  # an in-memory tree fits: the memory engine is not asked
    assert all(p.step_s <= split.step_s for p in res.ranked[:res.ranked.index(split)])
    assert not any(isinstance(p.plan.leaf, Offload) for p in res.ranked)


def test_the_search_is_bounded_in_time_and_says_when_it_stopped():
    res = search(_work(), _hw(4), 4, time_limit_s=0.0)
    assert not res.complete and res.examined == 0
    assert "stopped at the time limit: not every tree was priced" in res.table().splitlines()[0]
    with pytest.raises(StratumError, match="stopped at its time limit before it priced a tree"):
        _ = res.best


def test_a_sharded_replicas_reduction_is_a_ring_all_reduce_times_the_hardwares_sharded_scale():
    prof = _profile()
    ring = predict(parse_plan("replicate(2, shard=true)"), _work(), _hw(2))
    gloo = predict(parse_plan("replicate(2, shard=true)"), _work(), replace(_hw(2), sharded_scale=2.5))
    grads = allreduce_s(sum(b.param_bytes for b in prof.blocks), 2, LINK)
    assert gloo.reduce_s == pytest.approx(ring.reduce_s + 1.5 * grads)
    # replicas without shard=true run bucketed all-reduces: the scale does not touch them
    plain = predict(parse_plan("replicate(2)"), _work(), replace(_hw(2), sharded_scale=2.5))
    assert plain.reduce_s == predict(parse_plan("replicate(2)"), _work(), _hw(2)).reduce_s


def test_processes_sharing_fewer_cores_run_a_pipelines_busy_ranks_on_the_idle_ones_share():
    work = _work(fs=(0.002,) * 4, params=(1000,) * 4)
    tree = parse_plan("replicate(2, pipeline(2, schedule=gpipe, partition=even))")
    own = Hardware.uniform(4, memory_bytes=64 * MiB, intra=Link(bandwidth=float("inf"), latency=0.0))
    base = predict(tree, work, own)
    # 4 processes on 2 cores, speeds measured with all 4 busy: GPipe's 2 micro-batches over 2 stages leave a third
    # of the ranks' time idle, so the busy ones run 1 / (2/3) faster — up to a core each (2 / 4 busy: no gain)
    shared = predict(tree, work, replace(own, shared_cores=2))
    assert base.bubble == pytest.approx(1 / 3)
    assert shared.compute_s == pytest.approx(base.compute_s * (1 - 1 / 3))
    assert shared.step_s == pytest.approx(base.step_s - base.compute_s / 3)
    # as many cores as processes, or a tree without bubbles: the measured pace stands
    assert predict(tree, work, replace(own, shared_cores=4)).compute_s == base.compute_s
    flat = parse_plan("replicate(4)")
    assert predict(flat, work, replace(own, shared_cores=2)).compute_s == predict(flat, work, own).compute_s
