"""Measure a step's own costs outside its blocks (:class:`~stratum.ir.costs.StepCosts`) on the plain engine,
beside the profile that prices the blocks.

The plain engine trains the real model for steps of one and of two micro-batches; where the model has blocks
``split`` shards and a second copy is given, that copy's k split blocks are sharded over a mesh of this one
process (DTensor's dispatch and copies, no arithmetic saved and nothing to send) and trained the same way; and
the model's blocks are timed as the profiler times them. The kinds alternate (so a load that moves between them
moves all alike), each timed ``repeats`` times after a warm-up. With ``P(m)`` and ``S(m)`` the median plain and
split steps of ``m`` micro-batches, ``B`` the blocks' forward and backward seconds of one micro-batch now and
``U`` the AdamW update's price:

- per micro-batch: ``P(2) − P(1) − B`` (what a second micro-batch costs beyond its blocks);
- fixed: ``P(1) − B − per_microbatch − U``;
- per split block and micro-batch: ``((S(2) − S(1)) − (P(2) − P(1))) / k``;
- split's fixed part: ``S(1) − P(1) − k · split_block``.

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
from stratum.ir.costs import StepCosts
from stratum.model.blockseq import BlockSeq
from stratum.parallel.split import apply_split, split_blocks
from stratum.profile.profile import Profile
from stratum.profile.profiler import profile_blockseq
from stratum.runtime.device import synchronize
from stratum.runtime.engine import OptimSpec
from stratum.runtime.plain import PlainEngine

logger = logging.getLogger(__name__)
REPEATS = 5


def _batches(vocab: int, micro_batch: int, seq_len: int, count: int, gen: torch.Generator) -> list[Batch]:
    return [Batch(x=torch.randint(vocab, (micro_batch, seq_len), generator=gen),
                  y=torch.randint(vocab, (micro_batch, seq_len), generator=gen), stream=i) for i in range(count)]


def _timed(engine: PlainEngine, batches: list[Batch], device: torch.device) -> float:
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


def measure_step_costs(model: BlockSeq, *, split_copy: BlockSeq | None, profile: Profile, vocab: int,
                       micro_batch: int, seq_len: int, optim: OptimSpec, device: torch.device, update_s: float,
                       repeats: int = REPEATS) -> StepCosts:
    """Train ``model`` (materialised, on ``device``; its weights change) on the plain engine, and ``split_copy``
    (another copy, or None) with its split blocks sharded over this process alone; return the step's costs
    outside the blocks and the update's price ``update_s`` as ``profile``'s load saw them (see the module)."""
    gen = torch.Generator().manual_seed(0)
    one, two = (_batches(vocab, micro_batch, seq_len, m, gen) for m in (1, 2))
    k = len(split_blocks(split_copy)) if split_copy is not None else 0
    with _one_process_mesh(device) if k else contextlib.nullcontext() as mesh:
        engines = [PlainEngine(model, optim=optim, device=device)]
        if split_copy is not None and mesh is not None:
            apply_split(split_copy, split_blocks(split_copy), mesh)
            engines.append(PlainEngine(split_copy, optim=optim, device=device))
        kinds: list[Callable[[], float]] = [partial(_blocks_s, model, micro_batch, seq_len, device)]
        kinds += [partial(_timed, e, b, device) for e in engines for b in (one, two)]
        blocks, *steps = _medians(kinds, repeats)
    scale = blocks / sum(b.fwd_s + b.bwd_s for b in profile.blocks) if profile.blocks else 1.0
    costs = replace(step_costs_from(*steps[:2], blocks_s=blocks, update_s=update_s, split=steps[2:] or None,
                                    split_blocks=k if len(steps) > 2 else 0), block_scale=scale if scale > 0 else 1.0)
    logger.info(f"plain engine step: {steps[0]:.4f} s (1 micro-batch), {steps[1]:.4f} s (2)"
                + (f"; its layers under DTensor: {steps[2]:.4f} s, {steps[3]:.4f} s" if len(steps) > 2 else "")
                + f"; its blocks {blocks:.4f} s a micro-batch now, {scale:.3g}× the profile's → {costs}")
    return costs


def step_costs_from(one_s: float, two_s: float, *, blocks_s: float, update_s: float,
                    split: Sequence[float] | None = None, split_blocks: int = 0) -> StepCosts:
    """The step's costs outside its blocks from the plain engine's steps of one and two micro-batches (``one_s``,
    ``two_s``), a micro-batch's profiled blocks ``blocks_s``, the update's price ``update_s`` and, where given,
    the same steps with ``split_blocks`` blocks under DTensor (``split``: their one and two micro-batch steps);
    the module's formulas, a figure below zero counting as 0."""
    per_mb = max(0.0, two_s - one_s - blocks_s)
    fixed = max(0.0, one_s - blocks_s - per_mb - update_s)
    if not split or not split_blocks:
        return StepCosts(fixed_s=fixed, per_microbatch_s=per_mb)
    block = max(0.0, ((split[1] - split[0]) - (two_s - one_s)) / split_blocks)
    return StepCosts(fixed_s=fixed, per_microbatch_s=per_mb, split_block_s=block,
                     split_fixed_s=max(0.0, split[0] - one_s - split_blocks * block))
