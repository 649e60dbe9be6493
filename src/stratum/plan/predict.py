"""A Plan tree's predicted step time and per-device peak memory, on the one cost model.

Inputs: a :class:`Workload` (the profile's per-block costs, the step's micro-batches, which blocks ``split`` can
shard) and a :class:`~stratum.ir.hardware.Hardware` spec (rank r runs on ``devices[r]``). The model, per step:

- **blocks**: a block's profiled forward/backward seconds, times ``StepCosts.block_scale`` (the blocks' pace
  when the step costs were measured over the profile's), over its device's speed (as
  :func:`~stratum.ir.prices.on_device`; a mirrored rank runs at the slowest device it mirrors). Under
  ``split(s)`` a shardable block computes 1/s of its work and keeps 1/s of its state and saved activations, and
  its forward and backward each all-reduce its output twice over the split group (Megatron's attention and MLP
  reductions) and pay DTensor's dispatch and copies (``StepCosts.split_block_s``, shared between forward and
  backward as the block's own times are); the step pays ``StepCosts.split_fixed_s`` for its norm, clipping and
  update over DTensor parameters.
- **pipeline**: the schedule the node names, for the replica's micro-batches, over the stages the node's partition
  cuts (even, balanced by parameter count, or the profiled cut of :func:`stratum.plan.partition.partition`),
  run through the event simulator (:func:`stratum.sim.pipeline.simulate`) with the pipeline group's link: the
  makespan is the compute part of the step and each rank's peak saved activations its activation memory. On
  processes sharing fewer cores (``Hardware.shared_cores``), the busy ranks take the idle ones' share
  (:func:`_shared_pace`).
  Without a pipeline a rank runs its micro-batches one after another and holds one micro-batch's activations.
- **replicate(r)**: micro-batches split evenly over the replicas (the step's count must divide); then each rank's
  gradient is all-reduced over its replica group (``shard=true``: reduce-scattered and the parameters
  all-gathered, the same bytes, times the hardware's ``sharded_scale``), after the backward, on the group's slowest
  link.
- **memory** per rank: parameters + gradients + AdamW moments of the blocks it holds (gradients and moments 1/r
  under ``shard=true``) plus its peak activations, against its device's memory.
- **update**: AdamW over the parameters a rank holds (1/s of split blocks', 1/r of all under ``shard=true``) at
  the workload's measured seconds per parameter, over the rank's speed.

- **the step's own costs**: every rank pays the plain engine's measured costs outside its blocks
  (:class:`~stratum.ir.costs.StepCosts`: a fixed part per step and a part per micro-batch it runs, over its
  speed, :func:`~stratum.ir.prices.step_overhead_s`) — a pipeline rank, instead of the per-micro-batch part, the
  stage runtime's measured cost per action in each action the schedule gives it (inside the simulated makespan,
  so a rank's actions wait on each other as its blocks do) — and the scalar collectives the engines make each
  step, each a ring all-reduce of a few bytes (so its latencies) over its group: the loss over the replicas and
  over the pipeline ranks, the gradient norm over the pipeline ranks, the split group and (``shard=true``) the
  replicas.
  The replicas' gradient all-reduce runs in :data:`~stratum.parallel.buckets.BUCKET_BYTES` buckets, one call
  (one set of latencies) per bucket.

The offload leaf (under any nesting of split, pipeline and replicate) is priced by its own planner through
``Workload.offload``: one rank's memory engine for its micro-batches, under split planning its shards (1/s of the
split blocks' seconds, bytes and saved activations, with the group's two all-reduces each way in the blocks'
times: a recomputed block re-runs them), under a pipeline its stages' blocks inside the schedule's makespan
(:func:`_offload_pipeline`), plus the replicas' all-reduce of the gradients a rank holds, the step's
scalar collectives and the step's own costs outside its blocks, as every tree pays them.

Not modelled: overlap of the gradient reduction with the backward, contention between links.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from stratum.errors import StratumError
from stratum.ir.costs import Costs, StepCosts
from stratum.ir.hardware import Hardware, Link
from stratum.ir.plan import Offload, Plan
from stratum.ir.prices import allreduce_s, bucketed_allreduce_s, step_overhead_s, with_link
from stratum.parallel.buckets import BUCKET_BYTES
from stratum.parallel.pipeline_offload import check_schedule, several_stages, stage_block_costs, stage_inflight
from stratum.plan.partition import balanced_partition, even_partition, partition
from stratum.profile.profile import Profile
from stratum.runtime.pipeline import PipelinePlan
from stratum.schedule.generators import generate
from stratum.schedule.ir import Schedule
from stratum.sim.pipeline import SimResult, simulate
from stratum.units import fmt_bytes

SPLIT_REDUCTIONS = 2
"""All-reduces of a split block's output per forward (and per backward): after attention and after the MLP."""
SCALAR_BYTES = 8
"""Bytes of a loss or gradient-norm all-reduce (one float64)."""


@dataclass(frozen=True, kw_only=True)
class LeafAsk:
    """What the offload leaf's planner is asked to price: one rank's memory engine for one step."""

    microbatches: int
    """Micro-batches the rank runs per step (its replica's share)."""
    device_budget: int
    """The leaf's device budget, bytes."""
    host_budget: int
    """The leaf's host budget, bytes."""
    splits: int
    """The split group's size: the engine packs this rank's shards of the blocks split cuts (1: every block
    whole)."""
    profile: Profile
    """The costs of the blocks the rank's engine runs (:func:`shard_profile`; under a pipeline its stages'
    blocks, renumbered from 0, per micro-batch, :func:`~stratum.parallel.pipeline_offload.stage_block_costs`)."""
    blocks: tuple[int, ...] = ()
    """Under a pipeline: the blocks (of the whole model) the rank holds; empty: every block."""
    inflight: tuple[int, ...] = ()
    """Under a pipeline: per held block, the micro-batches its stage holds at once (their activations kept,
    checkpointed or spilled as the rank's planner chooses, Placement.inflight)."""
    tensor_grads: bool = False
    """Under a pipeline: the rank runs several stages, so its 16-bit gradients go home a tensor at a time
    (:func:`~stratum.parallel.pipeline_offload.handoff_config`)."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What the plans are priced for: one training step of a profiled model."""

    profile: Profile
    """Per-block seconds and bytes per micro-batch (``stratum profile``)."""
    microbatches: int
    """Micro-batches per optimizer step over all replicas (the one-process ``train.grad_accum``)."""
    splittable: tuple[int, ...] = ()
    """Blocks ``split`` shards (:func:`stratum.parallel.split.split_blocks`); the others stay whole."""
    split_sizes: tuple[int, ...] = ()
    """Split sizes the model's layers divide into (heads, MLP width); empty = split is not offered."""
    param_counts: tuple[float, ...] = ()
    """Per block, the weights ``partition=balanced`` cuts by (as the pipeline runtime counts them); empty = the
    profile's parameter counts."""
    profile_path: str = ""
    """The profile's file: a plan names the profiled cut as ``partition=<this file>``; "" = not offered."""
    update_s_per_param: float = 0.0
    """Seconds of the AdamW update per parameter on the profiled device (measured beside the profile); 0 = the
    update is not priced."""
    step: StepCosts = StepCosts()
    """The step's costs outside its blocks on the profiled device (measured on the plain engine beside the
    profile); zeros = not priced."""
    offload: Callable[[LeafAsk], tuple[float, int]] | None = None
    """Prices the offload leaf (its own planner, :func:`stratum.offload.planner.make_placement`) for one rank →
    (seconds of its micro-batches and the update, device peak bytes), a StratumError where nothing fits; None =
    the offload leaf is not offered."""

    def __post_init__(self) -> None:
        if self.microbatches < 1:
            raise StratumError(f"a step needs at least one micro-batch, got {self.microbatches}")
        if not self.profile.blocks:
            raise StratumError("the profile has no blocks")

    @property
    def weights(self) -> list[float]:
        return list(self.param_counts) or [float(b.n_params) or 1.0 for b in self.profile.blocks]


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """A plan's predicted step (SIMULATED: the cost model's figures, not measurements)."""

    plan: Plan
    step_s: float
    """Seconds of one optimizer step: compute (with pipeline bubbles and split reductions) + gradient reduction +
    update + the step's own costs."""
    compute_s: float
    """The compute part: the pipeline's simulated makespan, or the slowest replica's micro-batches in a row."""
    reduce_s: float
    """Seconds of the replicas' gradient reduction after the backward and of the step's scalar (loss, norm)
    all-reduces."""
    update_s: float = 0.0
    """Seconds of the slowest rank's AdamW update of the parameters it holds (1/r of them under shard=true)."""
    overhead_s: float = 0.0
    """Seconds of the slowest rank's step costs outside its blocks (:class:`~stratum.ir.costs.StepCosts`)."""
    bubble: float
    """Idle share of the pipeline ranks during the compute part (0 without a pipeline)."""
    peak_bytes: tuple[int, ...]
    """Predicted peak bytes per rank: training state held plus peak saved activations."""
    limit_bytes: tuple[int, ...]
    """Each rank's device memory."""
    stages: tuple[tuple[int, int], ...] = ()
    """The pipeline's cut, (first block, last block + 1) per stage; empty without a pipeline."""
    why: str = ""
    """What does not fit ("" when the plan fits)."""

    @property
    def fits(self) -> bool:
        return not self.why


def _mesh_link(hw: Hardware, plan: Plan, dim: str) -> Link:
    """The slowest link of any group along ``dim`` (every group of a dimension moves at the pace of the worst)."""
    links = [hw.group_link(g) for g in plan.all_groups(dim) if len(g) > 1]
    if not links:
        return Link(bandwidth=math.inf, latency=0.0)
    return Link(bandwidth=min(x.bandwidth for x in links), latency=max(x.latency for x in links))


def _slowest(hw: Hardware, plan: Plan, dim: str, index: int) -> float:
    return min(hw.devices[r].speed for r in range(plan.world_size()) if getattr(plan.coord(r), dim) == index)


def _split_costs(work: Workload, s: int, link: Link) -> tuple[Costs, list[float]]:
    """Per-block costs on one rank of a split group of ``s``, and per block the state bytes it holds."""
    c = Costs.blocks(work.profile)
    pace = work.step.block_scale  # the profile's blocks at the pace the step costs were measured at
    c = replace(c, f=[x * pace for x in c.f], b=[x * pace for x in c.b], i=[x * pace for x in c.i],
                w=[x * pace for x in c.w])
    state = [float(b.param_bytes + b.grad_bytes + b.optim_bytes) for b in work.profile.blocks]
    if s == 1:
        return c, state
    cols: dict[str, Any] = {k: list(getattr(c, k)) for k in ("f", "b", "i", "w", "act_bytes", "spill_bytes",
                                                              "param_bytes")}
    for k in work.splittable:
        for name in cols:
            cols[name][k] /= s
        state[k] /= s
        comm = SPLIT_REDUCTIONS * allreduce_s(c.out_bytes[k], s, link)
        f, b = cols["f"][k], cols["b"][k]
        dispatch = work.step.split_block_s * (f / (f + b) if f + b > 0 else 0.5)  # DTensor's, forward's share
        cols["f"][k] += comm + dispatch
        cols["b"][k] += comm + work.step.split_block_s - dispatch
        cols["i"][k] += comm + work.step.split_block_s - dispatch
    return replace(c, **cols), state


@lru_cache(maxsize=256)
def _schedule(kind: str, ranks: int, microbatches: int, virtual: int, waves: int) -> Schedule:
    return generate(kind, ranks=ranks, microbatches=microbatches, virtual=virtual, waves=waves)


def _stages(work: Workload, plan: Plan, sched: Schedule) -> list[range]:
    """The cut the pipeline runtime makes for this node (:func:`stratum.runtime.pipeline.plan_pipeline`) with
    ``parallel.speeds`` unset, as a tree the search chooses runs: the cut ignores the devices' speeds, the
    stage times do not."""
    node, n = plan.pipeline, len(work.profile.blocks)
    assert node is not None  # (a plan with a pipeline node)
    if sched.num_stages > n:
        raise StratumError(f"{sched.num_stages} stages but the model has {n} blocks")
    if node.partition == "even":
        return even_partition(n, sched.num_stages)
    if node.partition == "balanced":
        return balanced_partition(work.weights, sched.num_stages)
    if work.profile_path and node.partition == work.profile_path:
        return list(partition(work.profile, sched.stage_to_rank).stages)
    raise StratumError(f"partition {node.partition!r} is not one the search prices (even, balanced, the profile)")


def predict(plan: Plan, work: Workload, hw: Hardware) -> Prediction:
    """Price ``plan`` (see the module); a plan the model or hardware cannot run at all is a StratumError."""
    r, p, s = plan.mesh_shape
    world = plan.world_size()
    if world > hw.num_devices:
        raise StratumError(f"{world} processes but the hardware has {hw.num_devices} devices")
    if work.microbatches % r:
        raise StratumError(f"{work.microbatches} micro-batches per step do not split evenly over {r} replicas")
    if s > 1 and s not in work.split_sizes:
        raise StratumError(f"the model's layers do not split {s} ways")
    if plan.replicate is not None and plan.replicate.shard and s > 1:
        raise StratumError("replicate(shard=true) does not run over split")
    m = work.microbatches // r
    if isinstance(plan.leaf, Offload):
        return _predict_offload(plan, work, hw, m)
    blocks, state = _split_costs(work, s, _mesh_link(hw, plan, "split"))
    limits = tuple(hw.devices[k].memory_bytes for k in range(world))
    cut: tuple[tuple[int, int], ...]
    if plan.pipeline is None:
        speed = min(hw.devices[k].speed for k in range(world))
        compute = m * sum(blocks.f[k] + blocks.b[k] for k in range(blocks.num_stages)) / speed
        held, cut = [list(range(blocks.num_stages))], ()
        act, bubble = [float(sum(blocks.act_bytes))], 0.0
    else:
        node = plan.pipeline
        sched = _schedule(node.schedule, p, m, node.virtual, node.waves)
        stages = _stages(work, plan, sched)
        res = _simulated(plan, hw, sched, blocks.over(stages).with_action_s(work.step.per_action_s))
        compute, bubble, act = res.makespan * _shared_pace(hw, world, res.bubble), res.bubble, list(res.peak_act)
        held = [[b for j in sched.stages_of(q) for b in stages[j]] for q in range(p)]
        cut = tuple((x.start, x.stop) for x in stages)
    shard = plan.replicate is not None and plan.replicate.shard
    grad_bytes = [sum(blocks.param_bytes[b] for b in h) for h in held]
    reduce = max(_grad_reduce_s(x, plan, hw) for x in grad_bytes) + _scalar_collectives_s(plan, hw)
    update = _update_s(work, plan, hw, held)
    overhead = _overhead_s(work, plan, hw, m)
    if s > 1:  # the norm, clipping and update over DTensor parameters
        overhead += work.step.split_fixed_s / min(hw.devices[k].speed for k in range(world))
    peaks = []
    for rank in range(world):
        q = plan.coord(rank).stage_rank
        st = sum(_state(work, b, state[b], r if shard else 1) for b in held[q])
        peaks.append(int(math.ceil(st + act[q])))
    why = ""
    over = [k for k in range(world) if peaks[k] > limits[k]]
    if over:
        worst = max(over, key=lambda j: peaks[j] - limits[j])
        why = (f"rank {worst} needs {fmt_bytes(peaks[worst])} of its {fmt_bytes(limits[worst])} "
               f"({len(over)} of {world} ranks over)")
    return Prediction(plan=plan, step_s=compute + reduce + update + overhead, compute_s=compute, reduce_s=reduce,
                      update_s=update, overhead_s=overhead, bubble=bubble, peak_bytes=tuple(peaks), limit_bytes=limits,
                      stages=cut, why=why)


def _overhead_s(work: Workload, plan: Plan, hw: Hardware, microbatches: int) -> float:
    """The slowest rank's step costs outside its blocks: the fixed part, and the per-micro-batch part for
    ``microbatches`` where there is no pipeline (a pipeline rank pays ``per_action_s`` in its actions instead)."""
    paid = 0 if plan.pipeline is not None else microbatches
    return max(step_overhead_s(work.step, paid, hw.devices[k]) for k in range(plan.world_size()))


def _shared_pace(hw: Hardware, world: int, bubble: float) -> float:
    """What a pipeline's simulated makespan takes on devices that share ``hw.shared_cores`` cores among more
    processes: their speeds are measured with every process busy, each on ``cores / world`` of a core; a schedule
    that leaves a share ``bubble`` of the ranks' time idle keeps ``world · (1 − bubble)`` of them busy on average,
    each then on up to a whole core. → ``max(cores / world, 1 − bubble)`` (1 where every process has its core)."""
    cores = hw.shared_cores
    if cores == 0 or world <= cores:
        return 1.0
    return max(cores / world, 1.0 - bubble)


def _simulated(plan: Plan, hw: Hardware, sched: Schedule, costs: Costs) -> SimResult:
    """The pipeline's schedule run by the event simulator over stage ``costs``, each stage at its pipeline rank's
    pace (the slowest device that rank mirrors), messages on the pipeline group's link."""
    speed = [_slowest(hw, plan, "stage_rank", q) for q in range(plan.stage_ranks)]
    k = [1.0 / speed[sched.stage_to_rank[j]] for j in range(costs.num_stages)]
    costs = replace(costs, f=[x * y for x, y in zip(costs.f, k)], b=[x * y for x, y in zip(costs.b, k)],
                    i=[x * y for x, y in zip(costs.i, k)], w=[x * y for x, y in zip(costs.w, k)])
    return simulate(sched, with_link(costs, _mesh_link(hw, plan, "stage_rank")))


def _grad_reduce_s(nbytes: float, plan: Plan, hw: Hardware) -> float:
    """The replicas' gradient reduction of a rank's ``nbytes``: bucketed all-reduces, or (``shard=true``) a
    reduce-scatter and an all-gather of the same bytes, one call each: a ring all-reduce's price times the
    hardware's ``sharded_scale``."""
    r, link = plan.replicas, _mesh_link(hw, plan, "replica")
    if plan.replicate is not None and plan.replicate.shard:
        return allreduce_s(nbytes, r, link) * hw.sharded_scale
    return bucketed_allreduce_s(nbytes, r, link, BUCKET_BYTES)


def _scalar_collectives_s(plan: Plan, hw: Hardware) -> float:
    """The step's loss and gradient-norm all-reduces (see the module): each pays its group's ring latencies."""
    r, p, s = plan.mesh_shape
    shard = plan.replicate is not None and plan.replicate.shard
    calls = {"replica": (r, 1 + int(shard)), "stage_rank": (p, 2), "split": (s, 1)}
    return sum(k * allreduce_s(SCALAR_BYTES, n, _mesh_link(hw, plan, dim))
               for dim, (n, k) in calls.items() if n > 1)


def _update_s(work: Workload, plan: Plan, hw: Hardware, held: list[list[int]]) -> float:
    """The slowest rank's AdamW update: the parameters it holds (split blocks 1/s, all 1/r under shard=true)."""
    s = plan.splits
    shard = plan.replicas if plan.replicate is not None and plan.replicate.shard else 1
    split = set(work.splittable) if s > 1 else set()
    worst = 0.0
    for rank in range(plan.world_size()):
        q = plan.coord(rank).stage_rank
        n = sum(work.profile.blocks[b].n_params / (s if b in split else 1) for b in held[q]) / shard
        worst = max(worst, n * work.update_s_per_param / hw.devices[rank].speed)
    return worst


def _predict_offload(plan: Plan, work: Workload, hw: Hardware, m: int) -> Prediction:
    """The memory engine under any nesting of split, pipeline and replicate: its planner's step for one rank's
    micro-batches and shards (the slowest device's pace; under a pipeline, :func:`_offload_pipeline`), then the
    replicas' all-reduce of the gradients a rank holds, the step's scalar all-reduces and its own costs outside
    the blocks."""
    if work.offload is None:
        raise StratumError("the offload leaf is not offered for this workload")
    world, leaf = plan.world_size(), plan.leaf
    assert isinstance(leaf, Offload)  # (predict sends offload leaves here)
    prof = shard_profile(work, plan.splits, _mesh_link(hw, plan, "split"))
    ask = LeafAsk(microbatches=m, device_budget=int(leaf.device_budget), host_budget=int(leaf.host_budget),
                  splits=plan.splits, profile=prof)
    if plan.pipeline is None:
        step, peak = work.offload(ask)
        compute, bubble, peaks = step / min(hw.devices[k].speed for k in range(world)), 0.0, [peak]
        held: list[list[int]] = [list(range(len(prof.blocks)))]
        cut: tuple[tuple[int, int], ...] = ()
    else:
        compute, bubble, peaks, held, cut = _offload_pipeline(plan, work, hw, ask)
    grads = max(sum(prof.blocks[b].param_bytes for b in h) for h in held)
    reduce = (bucketed_allreduce_s(grads, plan.replicas, _mesh_link(hw, plan, "replica"), BUCKET_BYTES)
              + _scalar_collectives_s(plan, hw))
    overhead = _overhead_s(work, plan, hw, m)
    limits = tuple(hw.devices[k].memory_bytes for k in range(world))
    per_rank = tuple(int(peaks[plan.coord(k).stage_rank if plan.pipeline else 0]) for k in range(world))
    over = [k for k in range(world) if per_rank[k] > limits[k]]
    why = "" if not over else (f"rank {over[0]}'s memory engine peaks at {fmt_bytes(per_rank[over[0]])} of its "
                               f"{fmt_bytes(limits[over[0]])}")
    return Prediction(plan=plan, step_s=compute + reduce + overhead, compute_s=compute, reduce_s=reduce,
                      overhead_s=overhead, bubble=bubble, peak_bytes=per_rank, limit_bytes=limits, stages=cut,
                      why=why)


def _offload_pipeline(plan: Plan, work: Workload, hw: Hardware, ask: LeafAsk) -> tuple[
        float, float, list[int], list[list[int]], tuple[tuple[int, int], ...]]:
    """``pipeline(p, [split(s,] offload(…)))``: each pipeline rank's memory engine plans its stages' blocks as the
    runtime does (the activations of the micro-batches each stage holds at once kept, checkpointed or spilled). The
    compute part is the schedule's simulated makespan over the blocks' times, plus the pipeline rank's engine
    time beyond its blocks' compute (unhidden traffic, the update) that is largest at its pace, as if it ran
    outside the schedule. → (compute, bubble, device peak per pipeline rank, blocks per pipeline rank, cut)."""
    assert plan.pipeline is not None and work.offload is not None  # (_predict_offload sends pipelines here)
    node, m, prof = plan.pipeline, ask.microbatches, ask.profile
    sched = _schedule(node.schedule, plan.stage_ranks, m, node.virtual, node.waves)
    check_schedule(sched)
    stages = _stages(work, plan, sched)
    res = _simulated(plan, hw, sched, Costs.blocks(prof).over(stages).with_action_s(work.step.per_action_s))
    pplan = PipelinePlan(schedule=sched, stages=stages)
    extra, peaks, held = 0.0, [], []
    for q in range(plan.stage_ranks):
        mine = pplan.blocks_of(q)
        sub = replace(prof, blocks=stage_block_costs(prof, pplan, mine))
        step, peak = work.offload(replace(ask, profile=sub, blocks=tuple(mine), inflight=stage_inflight(pplan, mine),
                                          tensor_grads=several_stages(pplan, mine)))
        busy = m * sum(b.fwd_s + b.bwd_s for b in sub.blocks)
        extra = max(extra, (step - busy) / _slowest(hw, plan, "stage_rank", q))
        peaks.append(peak)
        held.append(mine)
    compute = res.makespan * _shared_pace(hw, plan.world_size(), res.bubble)
    return compute + extra, res.bubble, peaks, held, tuple((x.start, x.stop) for x in stages)


def shard_profile(work: Workload, s: int, link: Link) -> Profile:
    """The profile one rank of a split group of ``s`` runs under the offload leaf (its plain shards, as
    :mod:`stratum.parallel.split_offload` cuts them): each block split shards at 1/s of its seconds, state
    bytes and saved activations, its forward and both backward times each with the group's
    :data:`SPLIT_REDUCTIONS` all-reduces of its output; the other blocks whole. Every block at the step costs'
    pace (``StepCosts.block_scale``)."""
    pace, split = work.step.block_scale, set(work.splittable) if s > 1 else set()
    blocks = []
    for i, b in enumerate(work.profile.blocks):
        k = s if i in split else 1
        comm = SPLIT_REDUCTIONS * allreduce_s(b.out_bytes, s, link) if i in split else 0.0
        blocks.append(replace(b, n_params=b.n_params // k, param_bytes=b.param_bytes // k,
                              grad_bytes=b.grad_bytes // k, optim_bytes=b.optim_bytes // k,
                              act_saved_bytes=b.act_saved_bytes // k, spill_bytes=b.spill_bytes // k,
                              fwd_s=b.fwd_s * pace / k + comm, bwd_s=b.bwd_s * pace / k + comm,
                              bwd_input_s=b.bwd_input_s * pace / k + (comm if b.bwd_input_s else 0.0)))
    return replace(work.profile, blocks=blocks)


def _state(work: Workload, b: int, held: float, shard: int) -> float:
    """Bytes of block ``b``'s training state on a rank (``held``: its share under split); with ZeRO-2 over
    ``shard`` replicas the gradients and moments are 1/shard."""
    if shard == 1:
        return held
    blk = work.profile.blocks[b]
    whole = blk.param_bytes + blk.grad_bytes + blk.optim_bytes
    frac = held / whole if whole else 0.0
    return frac * (blk.param_bytes + (blk.grad_bytes + blk.optim_bytes) / shard)
