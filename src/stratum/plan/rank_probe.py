"""Measure a model's ranks as a multi-process run on this CPU machine runs them, for the plan search.

On a CPU the devices are processes sharing the machine's cores: with each other, with their gloo threads and with
the launcher. The hardware probe's matrix-multiply rate of bare processes does not see the last two, and its
all-reduce figure is the best of a quiet loop, where a training step's gradient all-reduce takes its median time
after peers that end their backward at different moments. So before it ranks trees for ``n`` CPU processes the
search runs the model itself: ``n`` processes each train it on the plain engine for steps of ``m``
micro-batches and all-reduce their gradients over gloo after each backward, as ``replicate(n)`` does (every other
step they reduce-scatter and all-gather them instead, as ``replicate(n, shard=true)`` does); the searching process
does the same alone first. :func:`as_ranks_run` turns the figures into the spec the search prices with: the
devices' speeds (one process alone over each rank together), the intra-node link (the latency from the median
all-reduce of the loss's scalar, the bandwidth from the gradient all-reduce's through the ring price) and
``Hardware.sharded_scale`` (the sharded pair's seconds over the all-reduce's). Every wait is bounded by the timeout.
"""

from __future__ import annotations

import datetime
import queue
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from stratum.data.tokens import Batch
from stratum.dist.launch import free_port, wait_until
from stratum.errors import StratumError
from stratum.ir.hardware import Hardware
from stratum.ir.prices import ring_link
from stratum.model.blockseq import BlockSeq
from stratum.parallel.split import apply_split
from stratum.plan.process_probe import run_forked
from stratum.runtime.engine import OptimSpec, clip_coef
from stratum.runtime.plain import PlainEngine

WARMUP = 3
STEPS = 16
LR = 1e-4
PROBE_BUDGET_S = 60.0
"""The longest the probe may take by :func:`probe_seconds`: a model whose steps would take longer is not probed
(its spec's matrix-multiply speeds stand) rather than hold the search for minutes."""
SPLIT_PROBE = 2
"""The split size the probe times DTensor at: pairs of ranks, the smallest split and the one most trees use."""


@dataclass(frozen=True, kw_only=True)
class RankProbe:
    """What :func:`probe_ranks` measured (seconds are medians over its steps)."""

    alone_s: float
    """Seconds of one micro-batch's forward and backward in one process alone."""
    rank_s: tuple[float, ...]
    """Each rank's seconds of one micro-batch's forward and backward, all ranks running together."""
    allreduce_s: float
    """Seconds of a rank's gradient all-reduce after its backward (the median over ranks)."""
    sharded_s: float
    """Seconds of a rank's reduce-scatter and all-gather of the same gradients (the median over ranks)."""
    scalar_s: float
    """Seconds of a rank's all-reduce of one float64 after them, as the loss's (the median over ranks)."""
    grad_bytes: int
    """The gradient bytes each rank all-reduced."""
    split_step_s: tuple[float, float] = (0.0, 0.0)
    """A rank's training steps of one and of two micro-batches with the split blocks sharded over its pair of ranks,
    every pair at once (the median over ranks; zeros: not measured)."""


def _reduce(flat: torch.Tensor, world: int, timeout_s: float) -> None:
    """All-reduce ``flat`` (a replicate node's bucket) over the world."""
    wait_until(dist.all_reduce(flat, async_op=True), backend="gloo", deadline=time.monotonic() + timeout_s)


def _reduce_sharded(flat: torch.Tensor, world: int, timeout_s: float) -> None:
    """Reduce-scatter ``flat`` (padded to a multiple of the world) and all-gather the slices back: the pair of
    collectives ``replicate(shard=true)`` makes per step."""
    part = -(-flat.numel() // world)
    full = torch.zeros(part * world)
    full[:flat.numel()].copy_(flat)
    mine = torch.empty(part)
    wait_until(dist.reduce_scatter_single(mine, full, async_op=True), backend="gloo",
               deadline=time.monotonic() + timeout_s)
    wait_until(dist.all_gather_single(full, mine, async_op=True), backend="gloo",
               deadline=time.monotonic() + timeout_s)


def _train(rank: int, world: int, port: int, build: Callable[[], BlockSeq], batches: list[Batch],
           optim: OptimSpec, threads: int, timeout_s: float, split_ids: tuple[int, ...], out) -> None:
    """One probe process: ``WARMUP + STEPS`` steps of the plain engine on the model ``build`` makes (on the CPU)
    over ``batches``, each backward followed by the gradients' all-reduce (even steps) or reduce-scatter and
    all-gather (odd steps) over the ``world`` (none alone); puts (rank, s per micro-batch, all-reduce s, sharded
    pair s, bytes) on ``out``."""
    torch.set_num_threads(threads)
    model = build()
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    try:
        engine = PlainEngine(model, optim=optim, device=torch.device("cpu"))
        params = [p for _, p in engine.grad_params()]
        compute: list[float] = []
        scalar: list[float] = []
        reduce: tuple[list[float], list[float]] = ([], [])
        nbytes = 0
        for step in range(WARMUP + STEPS):
            t0 = time.perf_counter()
            engine.forward_backward(batches, len(batches))
            t1 = time.perf_counter()
            if world > 1:  # flattened as a replicate node's bucket is
                flat = torch.cat([p.grad.flatten() for p in params if p.grad is not None])
                (_reduce_sharded if step % 2 else _reduce)(flat, world, timeout_s)
                nbytes = flat.numel() * flat.element_size()
            t2 = time.perf_counter()
            if world > 1:  # the loss's all-reduce: a few bytes, its ring's latencies
                _reduce(torch.zeros(1, dtype=torch.float64), world, timeout_s)
            if step >= WARMUP:
                compute.append((t1 - t0) / len(batches))
                reduce[step % 2].append(t2 - t1)
                scalar.append(time.perf_counter() - t2)
            engine.update(LR, clip_coef(engine.grad_norm(), optim.grad_clip))
        split = _split_steps(model, split_ids, world, batches, optim) if split_ids and world > 1 else (0.0, 0.0)
        out.put((rank, statistics.median(compute), statistics.median(reduce[0]), statistics.median(reduce[1]),
                 statistics.median(scalar), nbytes, split))
    finally:
        if world > 1:
            dist.destroy_process_group()


def _split_steps(model: BlockSeq, split_ids: tuple[int, ...], world: int, batches: list[Batch],
                 optim: OptimSpec) -> tuple[float, float]:
    """Shard ``split_ids`` of ``model`` over this rank's pair of ranks (:data:`SPLIT_PROBE`; every pair at once, as
    ``replicate(world / 2, split(2))`` runs, DTensor over gloo) and time training steps of one and two
    micro-batches, alternated: their medians."""
    pairs = DeviceMesh("cpu", [[r, r + 1] for r in range(0, world, SPLIT_PROBE)], mesh_dim_names=("pair", "split"))
    apply_split(model, split_ids, pairs["split"])
    engine = PlainEngine(model, optim=optim, device=torch.device("cpu"))
    kinds = (batches[:1], (batches * 2)[:2])
    times: tuple[list[float], list[float]] = ([], [])
    for step in range(2 * (WARMUP + STEPS // 2)):
        t0 = time.perf_counter()
        engine.train_step(kinds[step % 2], LR)
        if step >= 2 * WARMUP:
            times[step % 2].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def probe_ranks(build: Callable[[], BlockSeq], n: int, *, batches: list[Batch], optim: OptimSpec, threads: int,
                timeout_s: float, split_ids: tuple[int, ...] = ()) -> RankProbe:
    """Train the model ``build`` makes on the CPU (a picklable call: each process builds its own) in this process
    alone, then in ``n`` (>= 2) processes together (:func:`run_forked`), each over ``batches`` per step with
    ``threads`` threads, and with ``split_ids`` (blocks split can shard 2 ways; ``n`` even) split over pairs of
    them (see the module)."""
    if n < 2:
        raise StratumError(f"the rank probe needs at least 2 processes, got {n}")
    alone = _alone_s(build, batches, optim, threads, timeout_s)
    got = run_forked(_train, n, (n, free_port(), build, batches, optim, threads, timeout_s, split_ids),
                     timeout_s=timeout_s, what=f"the rank probe ({n} processes)")
    if sorted(r for r, *_ in got) != list(range(n)):
        raise StratumError("the rank probe ended without every rank's results")
    by_rank = sorted(got)
    return RankProbe(alone_s=alone, rank_s=tuple(x[1] for x in by_rank),
                     allreduce_s=statistics.median(x[2] for x in by_rank),
                     sharded_s=statistics.median(x[3] for x in by_rank),
                     scalar_s=statistics.median(x[4] for x in by_rank), grad_bytes=max(x[5] for x in by_rank),
                     split_step_s=(statistics.median(x[6][0] for x in by_rank),
                                   statistics.median(x[6][1] for x in by_rank)))


def _alone_s(build: Callable[[], BlockSeq], batches: list[Batch], optim: OptimSpec, threads: int,
            timeout_s: float) -> float:
    """Seconds per micro-batch of one process alone, measured in this one: the process whose profile and step
    probe the search prices with, so that the speeds are relative to the pace its blocks were priced at."""
    before = torch.get_num_threads()
    out: queue.SimpleQueue = queue.SimpleQueue()
    try:
        _train(0, 1, 0, build, batches, optim, threads, timeout_s, (), out)
    finally:
        torch.set_num_threads(before)
    return out.get()[1]


def probe_seconds(step_s: float, n: int, cores: int) -> float:
    """About how long :func:`probe_ranks` takes for a model whose training step takes ``step_s`` alone: its steps
    alone, the ``n`` processes' (each at ``n / cores`` of that pace where they share fewer cores) and the split
    steps."""
    shared = max(1.0, n / max(cores, 1))
    return step_s * (WARMUP + STEPS + (WARMUP + STEPS + 2 * WARMUP + STEPS) * shared)


def as_ranks_run(hw: Hardware, probe: RankProbe) -> Hardware:
    """``hw`` with device k's speed ``alone_s / rank_s[k]``; the intra-node link the ring all-reduces of a scalar
    (``scalar_s``) and of ``grad_bytes`` (``allreduce_s``) were timed on (:func:`stratum.ir.prices.ring_link`; the
    spec's bandwidth kept where the latencies alone take that long); ``sharded_scale`` the reduce-scatter and
    all-gather's seconds over the all-reduce's. A device beyond the probe's ranks keeps its speed."""
    speeds = [probe.alone_s / t for t in probe.rank_s]
    devices = tuple(replace(d, speed=speeds[k]) if k < len(speeds) else d for k, d in enumerate(hw.devices))
    intra = ring_link(len(probe.rank_s), probe.grad_bytes, probe.allreduce_s, probe.scalar_s,
                      fallback_bandwidth=hw.intra_node.bandwidth)
    inter = intra if hw.inter_node == hw.intra_node else hw.inter_node
    scale = probe.sharded_s / probe.allreduce_s if probe.sharded_s > 0 and probe.allreduce_s > 0 else \
        hw.sharded_scale
    return replace(hw, devices=devices, intra_node=intra, inter_node=inter, sharded_scale=scale)


def split_block_s(probe: RankProbe, *, split_blocks_s: float, blocks: int, comm_s: float, speed: float) -> float:
    """DTensor's seconds per split block and micro-batch on the probe's pairs (``StepCosts.split_block_s``, in the
    profiled device's seconds): one more micro-batch's split step, less the rank's forward and backward with its
    ``blocks`` split blocks (``split_blocks_s`` of the alone run's) at 1/2 — at the rank's ``speed`` — per block,
    less a block's priced all-reduces over the pair ``comm_s``; 0 where not measured or where the load leaves
    nothing."""
    if probe.split_step_s[1] <= 0 or blocks == 0:
        return 0.0
    rank_s = (probe.alone_s - split_blocks_s * (1 - 1 / SPLIT_PROBE)) / speed
    per_block = (probe.split_step_s[1] - probe.split_step_s[0] - rank_s) / blocks - comm_s
    return max(0.0, per_block * speed)
