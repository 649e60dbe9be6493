"""Measure a step's own costs outside its blocks (:class:`~stratum.ir.costs.StepCosts`) on the plain engine,
beside the profile that prices the blocks.

The plain engine trains the real model for steps of one and of two micro-batches; where the model has blocks
``split`` shards and a second copy is given, that copy's k split blocks are sharded over a mesh of this one
process (DTensor's dispatch and copies, no arithmetic saved and nothing to send) and trained the same way; the
same model runs as a one-process pipeline of two zb-wave stages (:data:`PROBE_SCHEDULE`: the stage runtime's
actions without messages); and the model's blocks are timed as the profiler times them. The kinds alternate (so
a load that moves between them moves all alike), each timed ``repeats`` times after a warm-up. With ``P(m)``,
``S(m)`` and ``Z(m)`` the median plain, split and pipeline steps of ``m`` micro-batches, ``B`` the blocks'
forward and backward seconds of one micro-batch now and ``U`` the AdamW update's price:

- per micro-batch: ``P(2) − P(1) − B`` (what a second micro-batch costs beyond its blocks);
- fixed: ``P(1) − B − per_microbatch − U``;
- per split block and micro-batch: ``((S(2) − S(1)) − (P(2) − P(1))) / k``;
- split's fixed part: ``S(1) − P(1) − k · split_block``;
- per pipeline action: ``(Z(2) − Z(1) − B) / 6`` (one more micro-batch adds six actions, :data:`PROBE_ACTIONS`).

- the blocks' scale: ``B`` over the profile's blocks. The profile may have been taken under another load (or
  cached long before); a planner multiplies its block times by this, so that blocks, step costs and update are
  priced at the load of one moment, the search's.

"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from stratum.data.tokens import Batch
from stratum.dist.world import single_world
from stratum.errors import StratumError
from stratum.ir.costs import StepCosts
from stratum.ir.plan import parse_plan
from stratum.model.blockseq import BlockSeq
from stratum.parallel.split import apply_split, split_blocks
from stratum.profile.profile import Profile
from stratum.profile.profiler import profile_blockseq
from stratum.runtime.device import synchronize
from stratum.runtime.engine import GradEngine, OptimSpec
from stratum.runtime.pipeline import PipelineEngine, make_schedule, plan_pipeline
from stratum.runtime.plain import PlainEngine

logger = logging.getLogger(__name__)
REPEATS = 5
PROBE_SCHEDULE = "zb-wave"
"""The one-process pipeline's schedule: on one rank two stages, each running a forward and the backward's input-
and weight-gradient parts per micro-batch, every kind of action a pipeline rank runs but the whole backward."""
PROBE_ACTIONS = 6
"""The actions one more micro-batch adds to :data:`PROBE_SCHEDULE` on one rank (two stages × F, I, W)."""


def probe_batches(vocab: int, micro_batch: int, seq_len: int, count: int, gen: torch.Generator) -> list[Batch]:
    """``count`` micro-batches of random token ids: what the probes train on (timing, not learning)."""
    return [Batch(x=torch.randint(vocab, (micro_batch, seq_len), generator=gen),
                  y=torch.randint(vocab, (micro_batch, seq_len), generator=gen), stream=i) for i in range(count)]


def _timed(engine: GradEngine, batches: list[Batch], device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    engine.train_step(batches, 1e-4)
    synchronize(device)
    return time.perf_counter() - t0


@contextlib.contextmanager
def _one_process_mesh(device: torch.device) -> Iterator[DeviceMesh | None]:
    """A 1-D mesh of this process alone, in a world of one made for it (None where this process already belongs
    to a process group: its world is not this probe's to replace)."""
    if dist.is_initialized():
        yield None
        return
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        yield DeviceMesh(device.type, [0])
    finally:
        dist.destroy_process_group()


def _medians(kinds: list[Callable[[], float]], repeats: int) -> list[float]:
    """Each timed kind's median: every kind once per round, in turn, after a warm-up round."""
    times: list[list[float]] = [[] for _ in kinds]
    with torch.random.fork_rng(devices=[]):  # dropout may draw: the caller's stream stays where it was
        for kind in kinds:  # warm-up: the moments are allocated, the kernels chosen
            kind()
        for _ in range(repeats):
            for kind, out in zip(kinds, times):
                out.append(kind())
    return [statistics.median(x) for x in times]


def _blocks_s(model: BlockSeq, micro_batch: int, seq_len: int, device: torch.device) -> float:
    """Seconds of one micro-batch's forward and backward over ``model``'s blocks, timed as the profiler times
    them (one run each)."""
    prof = profile_blockseq(model, micro_batch=micro_batch, seq_len=seq_len, device=device, runs=1)
    return sum(b.fwd_s + b.bwd_s for b in prof.blocks)


def _one_rank_pipeline(model: BlockSeq, optim: OptimSpec, device: torch.device) -> PipelineEngine | None:
    """``model`` as a one-process zb-wave pipeline of two stages (every kind of action, no messages), or None
    where it has fewer than two blocks or the pipeline runtime refuses it (its actions are then not priced)."""
    if len(model) < 2:
        return None
    plan = parse_plan(f"pipeline(1, schedule={PROBE_SCHEDULE}, partition=even)")
    assert plan.pipeline is not None  # (parsed from a pipeline)
    node = plan.pipeline
    try:
        return PipelineEngine(model, plan=plan_pipeline(node, model, 1), optim=optim,
                              world=single_world(plan, device), schedule_for=lambda m: make_schedule(node, m))
    except StratumError as e:
        logger.info(f"a pipeline action's cost is not measured: {e}")
        return None


def measure_step_costs(model: BlockSeq, *, split_copy: BlockSeq | None, profile: Profile, vocab: int,
                       micro_batch: int, seq_len: int, optim: OptimSpec, device: torch.device, update_s: float,
                       repeats: int = REPEATS) -> StepCosts:
    """Train ``model`` (materialised, on ``device``; its weights change) on the plain engine and as a one-process
    pipeline, and ``split_copy`` (another copy, or None) with its split blocks sharded over this process alone;
    return the step's costs outside the blocks and the update's price ``update_s`` as ``profile``'s load saw them
    (see the module)."""
    gen = torch.Generator().manual_seed(0)
    one, two = (probe_batches(vocab, micro_batch, seq_len, m, gen) for m in (1, 2))
    k = len(split_blocks(split_copy)) if split_copy is not None else 0
    with _one_process_mesh(device) if k else contextlib.nullcontext() as mesh:
        kinds: dict[str, Callable[[], float]] = {"blocks": partial(_blocks_s, model, micro_batch, seq_len, device)}
        engines: dict[str, GradEngine | None] = {"plain": PlainEngine(model, optim=optim, device=device),
                   "pipeline": _one_rank_pipeline(model, optim, device)}
        if split_copy is not None and mesh is not None:
            apply_split(split_copy, split_blocks(split_copy), mesh)
            engines["split"] = PlainEngine(split_copy, optim=optim, device=device)
        for name, engine in engines.items():
            if engine is not None:
                kinds.update({f"{name} {len(b)}": partial(_timed, engine, b, device) for b in (one, two)})
        t = dict(zip(kinds, _medians(list(kinds.values()), repeats)))
    blocks = t["blocks"]
    scale = blocks / sum(b.fwd_s + b.bwd_s for b in profile.blocks) if profile.blocks else 1.0
    costs = replace(step_costs_from(t["plain 1"], t["plain 2"], blocks_s=blocks, update_s=update_s,
                                    split=(t["split 1"], t["split 2"]) if "split 1" in t else None, split_blocks=k,
                                    pipeline=(t["pipeline 1"], t["pipeline 2"]) if "pipeline 1" in t else None),
                    block_scale=scale if scale > 0 else 1.0)
    logger.info("step probe: " + ", ".join(f"{name} {x:.4f} s" for name, x in t.items() if name != "blocks")
                + f" (by micro-batches); its blocks {blocks:.4f} s a micro-batch now, {scale:.3g}× the profile's → "
                f"{costs}")
    return costs


def step_costs_from(one_s: float, two_s: float, *, blocks_s: float, update_s: float,
                    split: Sequence[float] | None = None, split_blocks: int = 0,
                    pipeline: Sequence[float] | None = None) -> StepCosts:
    """The step's costs outside its blocks from the plain engine's steps of one and two micro-batches (``one_s``,
    ``two_s``), a micro-batch's profiled blocks ``blocks_s``, the update's price ``update_s`` and, where given,
    the same steps with ``split_blocks`` blocks under DTensor (``split``: their one and two micro-batch steps);
    the module's formulas, a figure below zero counting as 0."""
    per_mb = max(0.0, two_s - one_s - blocks_s)
    fixed = max(0.0, one_s - blocks_s - per_mb - update_s)
    action = max(0.0, (pipeline[1] - pipeline[0] - blocks_s) / PROBE_ACTIONS) if pipeline else 0.0
    if not split or not split_blocks:
        return StepCosts(fixed_s=fixed, per_microbatch_s=per_mb, per_action_s=action)
    block = max(0.0, ((split[1] - split[0]) - (two_s - one_s)) / split_blocks)
    return StepCosts(fixed_s=fixed, per_microbatch_s=per_mb, split_block_s=block,
                     split_fixed_s=max(0.0, split[0] - one_s - split_blocks * block), per_action_s=action)
