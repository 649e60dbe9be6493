"""Measure a step's own costs outside its blocks (:class:`~stratum.ir.costs.StepCosts`) on the plain engine,
beside the profile that prices the blocks.

The plain engine trains the real model for steps of one and of two micro-batches, alternated (so a load that
moves between them moves both alike), each kind timed ``repeats`` times after a warm-up; with ``T(m)`` the median
step of ``m`` micro-batches, ``B`` the profile's forward and backward seconds of one micro-batch and ``U`` the
AdamW update's price:

- per micro-batch: ``T(2) − T(1) − B`` (what a second micro-batch costs beyond its blocks);
- fixed: ``T(1) − B − per_microbatch − U``.

A figure the load pushed below zero counts as 0. The steps draw random tokens from their own generator, so the
caller's random state is unchanged.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from stratum.data.tokens import Batch
from stratum.ir.costs import StepCosts
from stratum.model.blockseq import BlockSeq
from stratum.profile.profile import Profile
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


def measure_step_costs(model: BlockSeq, *, profile: Profile, vocab: int, micro_batch: int, seq_len: int,
                       optim: OptimSpec, device: torch.device, update_s: float,
                       repeats: int = REPEATS) -> StepCosts:
    """Train ``model`` (materialised, on ``device``; its weights change) on the plain engine and return the
    step's costs outside the profile's blocks and the update's price ``update_s`` (see the module)."""
    engine = PlainEngine(model, optim=optim, device=device)
    gen = torch.Generator().manual_seed(0)
    one, two = (_batches(vocab, micro_batch, seq_len, m, gen) for m in (1, 2))
    t1: list[float] = []
    t2: list[float] = []
    with torch.random.fork_rng(devices=[]):  # dropout may draw: the caller's stream stays where it was
        _timed(engine, one, device)  # warm-up: the moments are allocated, the kernels chosen
        _timed(engine, two, device)
        for _ in range(repeats):
            t1.append(_timed(engine, one, device))
            t2.append(_timed(engine, two, device))
    blocks = sum(b.fwd_s + b.bwd_s for b in profile.blocks)
    m1, m2 = statistics.median(t1), statistics.median(t2)
    costs = step_costs_from(m1, m2, blocks_s=blocks, update_s=update_s)
    logger.info(f"plain engine step: {m1:.4f} s (1 micro-batch), {m2:.4f} s (2); profiled blocks {blocks:.4f} s "
                f"a micro-batch, update {update_s:.4f} s: {costs.per_microbatch_s:.4f} s per micro-batch and "
                f"{costs.fixed_s:.4f} s per step outside them")
    return costs


def step_costs_from(one_s: float, two_s: float, *, blocks_s: float, update_s: float) -> StepCosts:
    """The step's costs outside its blocks from the plain engine's steps of one and two micro-batches (``one_s``,
    ``two_s``), a micro-batch's profiled blocks ``blocks_s`` and the update's price ``update_s`` (the module's
    formulas; a figure below zero counts as 0)."""
    per_mb = max(0.0, two_s - one_s - blocks_s)
    return StepCosts(fixed_s=max(0.0, one_s - blocks_s - per_mb - update_s), per_microbatch_s=per_mb)
