"""Prices on the one cost model: a block on a device, a transfer on a link, a collective on a group.

Pure functions over :class:`~stratum.ir.costs.Costs` and :class:`~stratum.ir.hardware.Hardware`'s parts, so every
planner (plan search, burst parallelism) and simulator (pipeline, cluster) charges the same seconds.

Collectives take the ring algorithms' closed forms (Thakur, Rabenseifner & Gropp, 2005) with ``α`` the link's
latency, ``β = 1/bandwidth`` and ``N`` the bytes of the whole buffer (what one rank holds before an all-reduce,
after an all-gather, before a reduce-scatter):

- all-reduce: ``2(n−1)/n · N·β + 2(n−1) · α`` (a reduce-scatter then an all-gather);
- all-gather and reduce-scatter: ``(n−1)/n · N·β + (n−1) · α``;
- broadcast: a binomial tree, ``⌈log2 n⌉ · (α + N·β)``;
- a bucketed all-reduce: one all-reduce per bucket of at most ``B`` bytes, so ``⌈N/B⌉`` latencies:
  ``2(n−1)/n · N·β + 2(n−1) · ⌈N/B⌉ · α``.

A step's own costs outside its blocks (:class:`~stratum.ir.costs.StepCosts`) are ``fixed + m · per_microbatch``
for ``m`` micro-batches, over the device's speed.

A group of one rank costs nothing, and so does an empty buffer.
"""

from __future__ import annotations

import math
from dataclasses import replace

from stratum.errors import StratumError
from stratum.ir.costs import Costs, StepCosts
from stratum.ir.hardware import Device, Link


def _check(nbytes: float, n: int) -> None:
    if nbytes < 0 or math.isnan(nbytes):
        raise StratumError(f"a message of {nbytes} bytes: sizes must be >= 0")
    if n < 1:
        raise StratumError(f"a collective over {n} ranks: groups have at least 1 rank")


def transfer_s(nbytes: float, link: Link) -> float:
    """Seconds to send ``nbytes`` over ``link`` (0 for nothing)."""
    _check(nbytes, 1)
    return 0.0 if nbytes == 0 else link.latency + nbytes / link.bandwidth


def allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring all-reduce of an ``nbytes`` buffer over ``n`` ranks."""
    _check(nbytes, n)
    if n == 1 or nbytes == 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def ring_link(n: int, nbytes: float, seconds: float, scalar_s: float, *, fallback_bandwidth: float) -> Link:
    """The link on which ring all-reduces over ``n`` ranks took ``scalar_s`` for a few bytes (its 2(n − 1)
    latencies) and ``seconds`` for ``nbytes`` more: :func:`allreduce_s` solved for the latency and the bandwidth
    (``fallback_bandwidth`` where the latencies alone took ``seconds``: nothing to read a bandwidth from)."""
    moving = seconds - scalar_s
    bandwidth = 2 * (n - 1) / n * nbytes / moving if moving > 0 and nbytes > 0 else fallback_bandwidth
    return Link(bandwidth=bandwidth, latency=scalar_s / (2 * (n - 1)))


def bucketed_allreduce_s(nbytes: float, n: int, link: Link, bucket_bytes: float) -> float:
    """Seconds of all-reducing ``nbytes`` over ``n`` ranks as ``⌈nbytes / bucket_bytes⌉`` ring all-reduces (each
    call pays the ring's latencies; the bytes cost what one all-reduce of them costs)."""
    _check(nbytes, n)
    if not bucket_bytes > 0:
        raise StratumError(f"a bucket of {bucket_bytes} bytes: buckets hold more than 0 bytes")
    if n == 1 or nbytes == 0:
        return 0.0
    calls = math.ceil(nbytes / bucket_bytes)
    return allreduce_s(nbytes, n, link) + (calls - 1) * 2 * (n - 1) * link.latency


def step_overhead_s(step: StepCosts, microbatches: int, device: Device) -> float:
    """Seconds of a step's own costs outside its blocks (``step``) for ``microbatches`` micro-batches on
    ``device``: ``(fixed + m · per_microbatch) / speed``."""
    if microbatches < 0:
        raise StratumError(f"a step of {microbatches} micro-batches: give 0 or more")
    return (step.fixed_s + microbatches * step.per_microbatch_s) / device.speed


def allgather_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring all-gather that leaves ``nbytes`` on every rank (each gives ``nbytes / n``)."""
    _check(nbytes, n)
    if n == 1 or nbytes == 0:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def reduce_scatter_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring reduce-scatter of an ``nbytes`` buffer (each rank ends with its reduced ``nbytes / n``)."""
    return allgather_s(nbytes, n, link)


def broadcast_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a binomial-tree broadcast of ``nbytes`` from one rank to ``n − 1`` others."""
    _check(nbytes, n)
    if n == 1 or nbytes == 0:
        return 0.0
    return math.ceil(math.log2(n)) * (link.latency + nbytes / link.bandwidth)


def block_s(costs: Costs, k: int, device: Device) -> float:
    """Seconds of unit ``k``'s forward and backward on ``device`` (its profiled time over the device's speed)."""
    if not 0 <= k < costs.num_stages:
        raise StratumError(f"unit {k} is outside the costs' {costs.num_stages} units")
    return (costs.f[k] + costs.b[k]) / device.speed


def on_device(costs: Costs, device: Device) -> Costs:
    """``costs`` with every time divided by ``device``'s speed (bytes unchanged)."""
    s = device.speed
    return replace(costs, f=[x / s for x in costs.f], b=[x / s for x in costs.b], i=[x / s for x in costs.i],
                   w=[x / s for x in costs.w])


def with_link(costs: Costs, link: Link) -> Costs:
    """``costs`` whose point-to-point messages travel over ``link``."""
    return replace(costs, latency=link.latency, bandwidth=link.bandwidth)
