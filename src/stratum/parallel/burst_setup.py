"""The burst node's engine as the plan tree builds it: the given widths, or widths planned when the run starts
from a quick profile of the model (on rank 0) and the link measured between the processes, shared by all.

Planned widths follow the timings of the moment, and other widths sum a step's gradients in another order: they
are recorded in the run's out_dir (:data:`RECORD`), and a run that resumes from a checkpoint keeps them, so that
it continues the interrupted run to the bit. Give ``widths=`` to make another run's choice your own."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from stratum.atomic import atomic_write_text
from stratum.config import Config
from stratum.dist.world import World
from stratum.ir.costs import Costs
from stratum.ir.hardware import Link
from stratum.ir.plan import Burst
from stratum.ir.prices import allreduce_s
from stratum.model.blockseq import BlockSeq
from stratum.offload.setup import quick_profile
from stratum.parallel.burst import BurstEngine, check_burst_model
from stratum.plan.burst import BurstPlan, plan_burst
from stratum.runtime.engine import OptimSpec


def measure_link(world: World, nbytes: int = 1 << 20, runs: int = 3) -> Link:
    """The link of this world's all-reduce (collective: every rank takes part): latency from a one-number
    all-reduce, bandwidth from an ``nbytes`` one, inverted through the ring all-reduce's price."""
    n = world.size("replica")

    def timed(numel: int) -> float:
        t = torch.zeros(numel, device=world.device)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            world.all_reduce(t, "replica", "measuring the link")
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    small, large = timed(1), timed(nbytes // 4)
    unit = allreduce_s(nbytes, n, Link(bandwidth=1.0, latency=0.0))  # seconds per (byte/second)⁻¹
    latency = small / (2 * (n - 1))
    return Link(bandwidth=unit / max(large - small, 1e-9), latency=latency)


def planned(cfg: Config, model: BlockSeq, world: World, node: Burst) -> BurstPlan:
    """The widths rank 0 plans from a quick profile of ``model`` and the measured link, on every rank."""
    link = measure_link(world)
    plan: BurstPlan | None = None
    if world.rank == 0:
        prof = quick_profile(model, micro_batch=cfg.train.micro_batch_size, seq_len=cfg.data.seq_len,
                             device=world.device, precision=cfg.train.precision, seed=cfg.train.seed)
        plan = plan_burst(Costs.blocks(prof), devices=node.n, link=link, amplification=node.amplification)
    shared = world.share_object(plan, "replica", "the burst plan")
    assert shared is not None  # (rank 0's)
    return shared


RECORD = "burst_widths.json"
"""The widths a run planned, in its out_dir: what a resumed run keeps."""


def _record_key(cfg: Config, model: BlockSeq, node: Burst) -> dict:
    """What the planned widths were planned for: a record of anything else is planned again."""
    return {"devices": node.n, "amplification": node.amplification, "blocks": len(model),
            "micro_batch": cfg.train.micro_batch_size, "seq_len": cfg.data.seq_len}


def recorded_widths(cfg: Config, model: BlockSeq, node: Burst) -> tuple[int, ...] | None:
    """The widths this run planned before (its out_dir's :data:`RECORD`), if planned for this burst node, model
    and batch; None otherwise."""
    try:
        rec = json.loads((Path(cfg.train.out_dir).expanduser() / RECORD).read_text())
        if rec["for"] == _record_key(cfg, model, node):
            return tuple(int(w) for w in rec["widths"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def record_planned_widths(cfg: Config, model: BlockSeq, engine: object) -> None:
    """Where ``engine`` is a burst node's that planned its widths now (neither given nor kept from before), write
    them to the run's out_dir (:data:`RECORD`), so that a resumed run keeps them; anything else: nothing."""
    node = cfg.plan.burst
    if isinstance(engine, BurstEngine) and engine.plan is not None and node is not None:
        atomic_write_text(Path(cfg.train.out_dir).expanduser() / RECORD,
                          json.dumps({"for": _record_key(cfg, model, node), "widths": list(engine.widths)}) + "\n")


def burst_engine(cfg: Config, model: BlockSeq, world: World, optim: OptimSpec, *,
                 resuming: bool = False) -> BurstEngine:
    """The burst node's engine: its given widths, the widths the run planned before where it is ``resuming``
    from a checkpoint, or widths planned now (and recorded)."""
    node = world.plan.burst
    assert node is not None  # (a plan with a burst node)
    check_burst_model(model, node, cfg.train.micro_batch_size)
    widths = node.width_list()
    if not widths and resuming:  # rank 0's record, for every rank: nodes may not share a filesystem
        before: tuple[int, ...] | None = recorded_widths(cfg, model, node) if world.rank == 0 else None
        shared = world.share_object(before, "replica", "the burst widths planned before")
        widths = shared or ()
    plan = None if widths else planned(cfg, model, world, node)
    if plan is not None:
        widths = plan.widths
    return BurstEngine(model, widths=widths, optim=optim, world=world, precision=cfg.train.precision, plan=plan,
                       microbatches=cfg.train.grad_accum)
