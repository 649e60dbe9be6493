"""The device model: a block's forward + backward time on a device from its kernel count and FLOPs.

A block launches ``K`` kernels per forward + backward whatever its batch, and does ``F`` FLOPs per sample. On a
device with a sustained rate ``P`` (``peak_flops``), a launch latency ``L`` (``launch_s``) and a half-performance
work per kernel ``W½`` (``half_flops``), the block on ``s`` samples takes

    max(K · L,  F·s / (P · occupancy)),   occupancy = w / (w + W½),   w = F·s / K (the work per kernel)

that is ``max(K·L, (F·s + K·W½) / P)``: Hockney's (r∞, n½) model of a pipelined unit per kernel (Hockney &
Jesshope, *Parallel Computers 2*, 1988), floored by the launches the host issues one after another. A small
batch leaves a device under-used by a fixed time per kernel, so a block with many small kernels (layer norms,
element-wise ops) scales worse with its batch share than one with a few large matrix products. With ``W½`` left
at its default ``P · L`` the time is ``F·s/P + K·L`` (each kernel pays one start-up).

A device without ``peak_flops`` is the profiled one (or a multiple of it by ``speed``): its blocks take their
profiled time, scaled linearly with the samples, floored by ``K · L`` where kernel counts are known.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stratum.errors import StratumError
from stratum.ir.hardware import Device


@dataclass(frozen=True, kw_only=True)
class Work:
    """Per block: the kernels one forward + backward launches and its FLOPs per sample."""

    kernels: Sequence[int]
    """Kernels launched by the block's forward and backward, whatever the batch (one per non-view operator)."""
    flops: Sequence[float]
    """Forward + backward FLOPs of one sample."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernels", tuple(int(k) for k in self.kernels))
        object.__setattr__(self, "flops", tuple(float(f) for f in self.flops))
        if len(self.kernels) != len(self.flops):
            raise StratumError(f"work: {len(self.kernels)} kernel counts but {len(self.flops)} FLOP counts; give "
                               "one of each per block")
        if any(k < 0 for k in self.kernels) or any(not f >= 0 for f in self.flops):
            raise StratumError("work: kernel and FLOP counts must be >= 0")

    @property
    def num_blocks(self) -> int:
        return len(self.kernels)


def half_flops(device: Device) -> float:
    """The device's FLOPs per kernel at half its peak rate (its ``half_flops``, else ``peak_flops × launch_s``)."""
    return device.half_flops or device.peak_flops * device.launch_s


def kernels_s(kernels: int, flops: float, device: Device) -> float:
    """Seconds of ``kernels`` kernels doing ``flops`` FLOPs in all on ``device`` (which has a ``peak_flops``)."""
    if not device.peak_flops > 0:
        raise StratumError(f"device {device.name!r} has no peak_flops; its blocks take their profiled time")
    if kernels == 0 and flops > 0:
        raise StratumError(f"{flops:g} FLOPs in no kernel: count the block's kernels")
    return max(kernels * device.launch_s, (flops + kernels * half_flops(device)) / device.peak_flops)


def share_s(work: Work | None, i: int, samples: float, device: Device, profiled_s: float) -> float:
    """Seconds of block ``i``'s forward + backward on ``samples`` samples on ``device``: the kernel model where
    the device has a ``peak_flops`` (``work`` required), else ``profiled_s`` (the block's time on ``samples``
    samples, profiled and over the device's speed) floored by its launches where ``work`` is known."""
    if device.peak_flops > 0:
        if work is None:
            raise StratumError(f"device {device.name!r} prices blocks by kernels and FLOPs (peak_flops) but the "
                               "model's kernel counts are unknown; count them (stratum.profile.work)")
        return kernels_s(work.kernels[i], work.flops[i] * samples, device)
    floor = work.kernels[i] * device.launch_s if work is not None else 0.0
    return max(floor, profiled_s)
