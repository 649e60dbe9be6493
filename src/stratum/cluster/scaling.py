"""A job's step on a group of devices, priced by the one cost model every planner uses.

Data parallelism over n devices is the burst plan that runs every block at width n
(:func:`stratum.plan.burst.price_burst`): a block's forward and backward on a 1/n share of the global batch, priced
by the device model (:mod:`stratum.ir.work`: from the block's kernel count and FLOPs on a device with a
``peak_flops``, else its profiled time over the device's speed), and its gradient's ring all-reduce over the
group's slowest link (:mod:`stratum.ir.prices`) beside the backward of the blocks before it, as data-parallel
runtimes on GPUs run it (:mod:`stratum.plan.burst_overlap`). A group runs at its slowest device. Saved
activations grow linearly with the sequences of the batch; a job fits a device when its training state and one
sequence's activations do (a device may run its share as micro-batches; the price is that of one batch), and runs
only on devices it fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from stratum.cluster.models import ModelCosts
from stratum.errors import StratumError
from stratum.ir.costs import Costs
from stratum.ir.hardware import Device, Hardware
from stratum.ir.prices import on_device
from stratum.plan.burst import Compute, price_burst
from stratum.plan.burst_overlap import OverlappedStep, overlapped, plan_burst_overlapped


@dataclass(frozen=True, kw_only=True)
class StepCost:
    """One optimizer step of a job on a group of devices."""

    step_s: float
    """Seconds per step."""
    rank_busy_s: tuple[float, ...]
    """Per device of the group, in its order: seconds busy per step (computing, moving or all-reducing); the
    rest of step_s is idle."""


def device_need(mc: ModelCosts) -> float:
    """Bytes a device needs to train the model data-parallel: its training state and one sequence's activations."""
    return mc.state_bytes + mc.act_bytes


def holders(mc: ModelCosts, devices: Sequence[Device]) -> tuple[int, ...]:
    """The ranks of ``devices`` that hold the model (:func:`device_need`), in the order a job takes them: the
    smallest memory first (it leaves the larger devices to the jobs that need them), then by rank."""
    need = device_need(mc)
    return tuple(sorted((r for r, d in enumerate(devices) if need <= d.memory_bytes),
                        key=lambda r: (devices[r].memory_bytes, r)))


def check_fits(mc: ModelCosts, devices: Sequence[Device], what: str, *, count: int = 1) -> None:
    """A one-line error when fewer than ``count`` of ``devices`` hold ``what`` (a job asking ``count`` devices):
    the policies place a job only on devices that hold it."""
    held = holders(mc, devices)
    if len(held) >= count:
        return
    big = max(devices, key=lambda d: d.memory_bytes)
    need = f"{what} needs {device_need(mc) / 2**30:.1f} GiB per device (training state and one sequence's activations)"
    if not held:
        raise StratumError(f"{need} but the largest device, {big.name!r}, holds {big.memory_bytes / 2**30:.1f} GiB; "
                           "leave it out of the trace or give the hardware larger devices")
    raise StratumError(f"{need}, which {len(held)} of the devices hold, but it asks for {count}; ask for at most "
                       f"{len(held)} or give the hardware more devices of {device_need(mc) / 2**30:.1f} GiB or more")


def at_batch(costs: Costs, sequences: int) -> Costs:
    """Per-sequence ``costs`` at a batch of ``sequences`` (times and activation bytes scale; parameters do not)."""
    k = sequences
    return replace(costs, f=[x * k for x in costs.f], b=[x * k for x in costs.b], i=[x * k for x in costs.i],
                   w=[x * k for x in costs.w], act_bytes=[x * k for x in costs.act_bytes],
                   out_bytes=[x * k for x in costs.out_bytes], spill_bytes=[x * k for x in costs.spill_bytes])


def _group(mc: ModelCosts, batch: int, ranks: Sequence[int], hw: Hardware) -> tuple[Costs, Compute]:
    """The step's costs on the group's slowest device (the lowest ``peak_flops``, then ``speed``; a device
    without a ``peak_flops`` counts as the slowest) and the device model pricing its blocks."""
    n = len(ranks)
    if n < 1 or batch < n:
        raise StratumError(f"a step of {batch} sequences over {n} devices needs 1 <= devices <= batch")
    slowest = min((hw.devices[r] for r in ranks), key=lambda d: (d.peak_flops, d.speed))
    return on_device(at_batch(mc.costs, batch), slowest), Compute(device=slowest, work=mc.work, samples=batch)


def dp_step(mc: ModelCosts, *, batch: int, ranks: Sequence[int], hw: Hardware) -> StepCost:
    """Data parallelism of a ``batch``-sequence step over ``ranks`` of ``hw``."""
    costs, compute = _group(mc, batch, ranks, hw)
    n = len(ranks)
    step = overlapped(price_burst(costs, [n] * costs.num_stages, devices=n, link=hw.group_link(ranks),
                                  compute=compute), costs)
    return StepCost(step_s=step.step_s, rank_busy_s=step.rank_busy_s)


def burst_step(mc: ModelCosts, *, batch: int, ranks: Sequence[int], hw: Hardware,
               amplification: float) -> OverlappedStep:
    """DeepPool's burst plan of a ``batch``-sequence step over ``ranks``, all-reduces beside the backward
    (:func:`stratum.plan.burst_overlap.plan_burst_overlapped`); a block of width k runs on the first k of
    ``ranks`` and talks over their slowest link."""
    costs, compute = _group(mc, batch, ranks, hw)
    group = list(ranks)
    return plan_burst_overlapped(costs, devices=len(group), link=lambda k: hw.group_link(group[:k]),
                      amplification=amplification, compute=compute)
