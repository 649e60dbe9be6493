"""From a Plan to an Engine: each node of the tree becomes an executor wrapping its child's.

The leaf runs blocks (``local``: the plain engine, or under a pipeline node the pipeline's stage runtime;
``offload``: the memory engine); a split node parallelizes the blocks the leaf runs; a pipeline node drives its
stages with a schedule; a replicate node shares micro-batches over replicas and reduces their gradients, and
chooses the leaf's optimizer (sharded for ``shard=true``). The trainer and the CLI see only the Engine and the
:class:`~stratum.dist.world.World` it runs in.

Everything that can be checked without processes — nesting, sizes against the model, schedules, partitions,
backend — is checked by :func:`check_plan` before any process starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from stratum.config import Config
from stratum.dist.launch import resolve_backend
from stratum.dist.world import World, single_world
from stratum.errors import StratumError
from stratum.ir.plan import Offload, Plan, render
from stratum.model.blockseq import BlockSeq
from stratum.model.build import build_model
from stratum.model.placement import build_blocks
from stratum.offload.engine import OffloadEngine
from stratum.offload.setup import offload_engine, placement_for
from stratum.parallel.burst import check_burst_model
from stratum.parallel.burst_setup import burst_engine
from stratum.parallel.pipeline_offload import OffloadPipelineEngine, check_schedule, leaf_config
from stratum.parallel.replicate import ReplicateEngine, shares
from stratum.parallel.replicate_offload import ReplicatedOffload, chunk_owner
from stratum.parallel.replicate_pipeline_offload import ReplicatedOffloadPipeline
from stratum.parallel.running_stats import RunningStats
from stratum.parallel.shard import ShardedAdamW
from stratum.parallel.split import apply_split, check_split, split_blocks
from stratum.parallel.split_offload import ShardLayout, SplitOffload, SplitOffloadPipeline, split_locally
from stratum.runtime.device import compute_rate, resolve_device
from stratum.runtime.engine import Engine, GradEngine
from stratum.runtime.loss_scale import loss_scale_spec
from stratum.runtime.optim import MakeOptimizer, optim_spec
from stratum.runtime.pipeline import PipelineEngine, PipelinePlan, make_schedule, plan_pipeline
from stratum.runtime.plain import PlainEngine
from stratum.schedule.generators import generate, is_kind
from stratum.schedule.textio import load


def check_plan(cfg: Config, *, tokenizer_vocab: int) -> PipelinePlan | None:
    """Refuse, with one line each, a plan this model and machine cannot run; the pipeline's stage plan if any."""
    plan = cfg.plan
    if plan.split is not None and plan.replicate is not None and plan.replicate.shard:
        raise StratumError(f"parallel.plan {str(plan)!r}: replicate(shard=true) cannot shard split parameters "
                           "yet; use shard=false with split")
    dev = resolve_device(cfg.train.device)
    if plan.world_size() > 1:
        resolve_backend(cfg.parallel.backend, dev)
        if dev.type == "cuda" and torch.cuda.is_available() and plan.world_size() > torch.cuda.device_count():
            raise StratumError(f"parallel.plan {str(plan)!r} needs {plan.world_size()} GPUs but this machine has "
                               f"{torch.cuda.device_count()}; start the other ranks on other machines with "
                               "torchrun, or make the plan smaller")
    meta = build_model(cfg.model, tokenizer_vocab=tokenizer_vocab, seq_len=cfg.data.seq_len, seed=cfg.train.seed,
                       device="meta")
    if plan.split is not None:
        check_split(meta, plan.split.n)
    if plan.burst is not None:
        check_burst_model(meta, plan.burst, cfg.train.micro_batch_size)
    if plan.pipeline is None:
        return None
    speeds = given_speeds(cfg)  # (the cut a run with these speeds makes; measured ones are not known yet)
    pplan = plan_pipeline(plan.pipeline, meta, cfg.train.grad_accum, stage_speeds(speeds, plan))
    if plan.replicate is not None:
        _check_replica_schedules(cfg, plan, speeds)
    if isinstance(plan.leaf, Offload):
        check_schedule(pplan.schedule)
    return pplan


def _check_replica_schedules(cfg: Config, plan: Plan, speeds: list[float] | None) -> None:
    """Replicas of a pipeline each run their share of a step's micro-batches, in proportion to their speeds: a
    schedule of a fixed count (a file, some torch classes) must take every share a run can give, or the run would
    fail after its start (or mid-run, where measured speeds re-share a step)."""
    assert plan.pipeline is not None and plan.replicate is not None
    total = cfg.micro_batches_per_step
    if cfg.parallel.speeds.strip() == "auto":
        counts: list[int] = list(range(1, total - plan.replicas + 2))
        why = "parallel.speeds = auto shares a step's micro-batches by the replicas' measured speeds"
    else:
        given = shares(total, plan.replicas, replica_speeds(speeds, plan))
        counts = sorted(set(given))
        why = f"parallel.speeds gives the replicas {', '.join(map(str, given))} of a step's {total} micro-batches"
    p = plan.pipeline
    advice = "give the replicas equal speeds, or a generated schedule kind"
    if not is_kind(p.schedule):  # a file (validated with the plan): one count
        n = load(Path(p.schedule).expanduser()).num_microbatches
        if any(m != n for m in counts):
            raise StratumError(f"schedule file {p.schedule} runs exactly {n} micro-batches a step, and {why}; "
                               f"{advice}")
        return
    for m in counts:
        try:
            generate(p.schedule, ranks=p.ranks, microbatches=m, virtual=p.virtual, waves=p.waves)
        except StratumError as e:
            raise StratumError(f"{why}, and a replica's pipeline cannot run {m}: {e}; {advice}") from None


def given_speeds(cfg: Config) -> list[float] | None:
    """``parallel.speeds`` given as numbers, one per process; None where speeds are equal or measured at start."""
    text = cfg.parallel.speeds.strip()
    return [float(v) for v in text.split(",")] if text and text != "auto" else None


def rank_model(cfg: Config, world: World, *, tokenizer_vocab: int,
               speeds: list[float] | None = None) -> tuple[BlockSeq, PipelinePlan | None]:
    """The model this rank runs — only its pipeline stages' blocks materialised where the plan pipelines it,
    block by block (lazy) under the offload leaf — and the pipeline's stage plan (cut by ``speeds``, one per
    process, where given)."""
    plan, t = world.plan, cfg.train
    # under the memory engine every block gets its values (its shards, under split) as the engine packs it
    lazy = isinstance(plan.leaf, Offload)
    if plan.pipeline is None:
        return build_model(cfg.model, tokenizer_vocab=tokenizer_vocab, seq_len=cfg.data.seq_len, seed=t.seed,
                           lazy=lazy), None
    if lazy:  # the stage's blocks get their values as the memory engine packs them (the pipeline engine keeps
        # only its stages of a source that cannot be built block by block)
        model = build_model(cfg.model, tokenizer_vocab=tokenizer_vocab, seq_len=cfg.data.seq_len, seed=t.seed,
                            lazy=True)
        return model, plan_pipeline(plan.pipeline, model, t.grad_accum, stage_speeds(speeds, plan))
    meta = build_model(cfg.model, tokenizer_vocab=tokenizer_vocab, seq_len=cfg.data.seq_len, seed=t.seed,
                       device="meta")
    pplan = plan_pipeline(plan.pipeline, meta, t.grad_accum, stage_speeds(speeds, plan))
    keep = set(pplan.blocks_of(world.coord.stage_rank))
    model = build_blocks(cfg.model, keep, tokenizer_vocab=tokenizer_vocab, seq_len=cfg.data.seq_len, seed=t.seed,
                         device=world.device)
    return model, pplan


def rank_speeds(cfg: Config, world: World) -> list[float] | None:
    """Every process's relative speed from ``parallel.speeds`` (measured now, collectively, for "auto"); None
    when speeds are equal by choice."""
    text = cfg.parallel.speeds.strip()
    if not text or world.plan.world_size() == 1:
        return None
    return world.gather_floats(compute_rate(world.device)) if text == "auto" else given_speeds(cfg)


def _slowest(speeds: list[float], plan: Plan, dim: str, size: int) -> list[float]:
    """Per index along ``dim``, the slowest process's speed: a replica (or a pipeline rank, over the replicas
    and splits that mirror it) runs at that pace."""
    return [min(speeds[r] for r in range(plan.world_size()) if getattr(plan.coord(r), dim) == i)
            for i in range(size)]


def replica_speeds(speeds: list[float] | None, plan: Plan) -> list[float] | None:
    return None if speeds is None or plan.replicas == 1 else _slowest(speeds, plan, "replica", plan.replicas)


def stage_speeds(speeds: list[float] | None, plan: Plan) -> list[float] | None:
    """One speed per pipeline rank, shared by every replica: their stages must hold the same blocks."""
    return None if speeds is None or plan.pipeline is None else _slowest(speeds, plan, "stage_rank",
                                                                           plan.stage_ranks)


def _optimizer(plan: Plan, cfg: Config, world: World) -> MakeOptimizer | None:
    """The leaf's optimizer as the plan chooses it: sharded over the replicas, or (None) the leaf's own."""
    if plan.replicate is None or not plan.replicate.shard:
        return None
    spec = optim_spec(cfg)
    return lambda named: ShardedAdamW(named, spec, world)


def _offload_leaf(cfg: Config, leaf: Offload, model: BlockSeq, world: World) -> OffloadEngine:
    """The memory engine under the leaf's budgets, running the first replica's placement (every replica must run
    the same chunk layout: it orders the gradient reductions); under replicate(shard=true) each replica updates
    (and holds the AdamW state of) every n-th chunk."""
    cfg = leaf_config(cfg, leaf)
    placement = placement_for(cfg, model, world.device, always_profile=True)
    # a split group's ranks re-run a recomputed block's collectives together: they run split rank 0's placement
    placement = world.share_object(placement, "split", "the offload placement")
    placement = world.share_object(placement, "replica", "the offload placement")
    rep = world.plan.replicate
    owns = chunk_owner(world.size("replica"), world.coord.replica) if rep is not None and rep.shard else None
    return offload_engine(cfg, model, world.device, placement, owns)


def _split_offload(model: BlockSeq, world: World, held: set[int]) -> ShardLayout | None:
    """Under ``split(n > 1, offload(…))``: the held layer blocks cut into this rank's plain shards (the memory
    engine chunks ordinary tensors, not DTensors); None for any other plan."""
    plan = world.plan
    if plan.split is None or not isinstance(plan.leaf, Offload) or world.group("split") is None:
        return None
    check_split(model, plan.split.n)
    return split_locally(model, held, world)


def _offload_tree(cfg: Config, leaf: Offload, model: BlockSeq, world: World,
                  speeds: list[float] | None) -> Engine:
    """The offload leaf without a pipeline: alone, under replicate, under split, or both."""
    plan = world.plan
    layout = _split_offload(model, world, set(range(len(model))))
    eng = _offload_leaf(cfg, leaf, model, world)
    engine: Engine = eng  # named by the memory engine itself when alone
    if plan.replicate is not None:
        engine = ReplicatedOffload(eng, node=plan.replicate, world=world, speeds=replica_speeds(speeds, plan),
                                   stats=RunningStats([model], world))
    if layout is not None:
        engine = SplitOffload(engine, eng, layout)
    if engine is not eng:
        engine.name = render(plan.root)
    return engine


def _split(model: BlockSeq, world: World, held: set[int]) -> None:
    """Tensor-parallelize the layer blocks this rank holds over its split group."""
    split = world.plan.split
    assert split is not None  # (called for a plan with a split node)
    check_split(model, split.n)
    group = world.group("split")
    if group is not None:
        mesh = DeviceMesh.from_group(group, world.device.type)
        apply_split(model, [i for i in split_blocks(model) if i in held], mesh)


def _held_blocks(model: BlockSeq, held: set[int]) -> list[nn.Module]:
    """The blocks this rank runs (a pipeline rank's stages; every block without a pipeline)."""
    return [model.blocks[i] for i in sorted(held)]


def build_engine(cfg: Config, model: BlockSeq, world: World, pipeline_plan: PipelinePlan | None = None,
                 speeds: list[float] | None = None, *, resuming: bool = False) -> Engine:
    """The executor tree of ``world.plan`` over ``model`` (as :func:`rank_model` built it); ``speeds`` (one per
    process, :func:`rank_speeds`) balances the replicas' shares and the pipeline's cut; ``resuming``: the run
    continues from a checkpoint, and keeps what it planned from measurements before (a burst node's widths)."""
    plan = world.plan
    spec, precision = optim_spec(cfg), cfg.train.precision
    if plan.burst is not None:
        burst = burst_engine(cfg, model, world, spec, resuming=resuming)
        burst.name = render(plan.root)
        return burst
    if isinstance(plan.leaf, Offload) and plan.pipeline is None:
        return _offload_tree(cfg, plan.leaf, model, world, speeds)
    if plan.pipeline is not None and pipeline_plan is None:
        pipeline_plan = plan_pipeline(plan.pipeline, model, cfg.train.grad_accum, stage_speeds(speeds, plan))
    held = set(pipeline_plan.blocks_of(world.coord.stage_rank) if pipeline_plan else range(len(model)))
    layout = _split_offload(model, world, held)
    if plan.split is not None and layout is None:
        _split(model, world, held)
    make_opt = _optimizer(plan, cfg, world)
    engine: GradEngine
    if plan.pipeline is not None and isinstance(plan.leaf, Offload):
        node = plan.pipeline
        rep = plan.replicate
        owns = chunk_owner(world.size("replica"), world.coord.replica) if rep is not None and rep.shard else None
        kw: dict[str, Any] = dict(cfg=cfg, leaf=plan.leaf, plan=pipeline_plan, optim=spec, world=world,
                                  precision=precision, schedule_for=lambda m: make_schedule(node, m), owns=owns)
        engine = (OffloadPipelineEngine(model, **kw) if layout is None else
                  SplitOffloadPipeline(model, layout=layout, **kw))
        if plan.replicate is not None:
            replicated = ReplicatedOffloadPipeline(engine, node=plan.replicate, world=world,
                                                   speeds=replica_speeds(speeds, plan),
                                                   stats=RunningStats(_held_blocks(model, held), world))
            replicated.name = render(plan.root)
            return replicated
    elif plan.pipeline is not None:
        node = plan.pipeline
        assert pipeline_plan is not None  # (planned above)
        engine = PipelineEngine(model, plan=pipeline_plan, optim=spec, world=world, precision=precision,
                                schedule_for=lambda m: make_schedule(node, m), make_optimizer=make_opt)
    else:
        engine = PlainEngine(model, optim=spec, device=world.device, precision=precision, make_optimizer=make_opt,
                             loss_scale=loss_scale_spec(cfg))
    if plan.replicate is not None:
        engine = ReplicateEngine(engine, node=plan.replicate, world=world, speeds=replica_speeds(speeds, plan),
                                 rebalance=cfg.parallel.speeds.strip() == "auto",
                                 stats=RunningStats(_held_blocks(model, held), world))
    engine.name = render(plan.root)
    return engine


def make_engine(cfg: Config, model: BlockSeq, device: torch.device) -> Engine:
    """The engine of a one-process plan (tests, benchmarks, a user's own loop on one device)."""
    plan = cfg.plan
    if plan.world_size() != 1:
        raise StratumError(f"parallel.plan {str(plan)!r} needs {plan.world_size()} processes; "
                           "build its engine inside them (stratum train, torchrun, or stratum.parallelize)")
    return build_engine(cfg, model, single_world(plan, device))
