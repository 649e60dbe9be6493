"""The one cost model: seconds and bytes of a sequence of units — a model's blocks, or a pipeline's stages — and
the link between ranks. Every planner and simulator reads it: the offload planner prices blocks
(:meth:`Costs.blocks`), the pipeline simulator and partitioner price stages (:meth:`Costs.over` sums blocks into
stages; :meth:`Costs.unit` makes identical made-up stages for comparing schedules).

Per unit: ``f``, ``b`` (forward and whole backward), ``i`` and ``w`` (the backward split into its input- and
weight-gradient parts) in seconds; ``act_bytes`` kept from a forward to its backward per micro-batch;
``out_bytes`` of the unit's output (the message to the next stage, and the gradient coming back);
``spill_bytes`` that an activation spill copies; ``param_bytes`` of the unit's parameters (= its gradient's bytes,
what a data-parallel reduction moves).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from stratum.errors import StratumError
from stratum.profile.profile import Profile

FIELDS = ("f", "b", "i", "w", "act_bytes", "out_bytes", "spill_bytes", "param_bytes")


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Per-unit costs (seconds, bytes) and the point-to-point link (seconds, bytes/second); see the module.
    The per-unit fields take any sequence and are stored as tuples."""

    f: Sequence[float]
    b: Sequence[float]
    i: Sequence[float]
    w: Sequence[float]
    act_bytes: Sequence[float]
    """Bytes unit s keeps alive per micro-batch between its forward and its (weight) backward."""
    out_bytes: Sequence[float]
    """Bytes of unit s's output activation (= bytes of the gradient sent back into it)."""
    spill_bytes: Sequence[float] = ()
    """Bytes an activation spill of unit s copies (the profiler's measure; ``act_bytes`` where not given)."""
    param_bytes: Sequence[float] = ()
    """Bytes of unit s's parameters, and of its gradient (0 where not given)."""
    half_bytes: tuple[Sequence[float], Sequence[float], Sequence[float]] | None = None
    """``act_bytes``, ``out_bytes`` and ``spill_bytes`` of the units run on 16-bit parameters (the offload
    engine's 16-bit chunks), where measured (:meth:`on_half_params`); None: as the others."""
    latency: float = 0.0
    bandwidth: float = math.inf
    time_unit: str = "s"
    """What a time in these costs is: seconds (profiled costs), or "units" (:meth:`unit`'s made-up costs)."""
    memory_unit: str = "bytes"
    """What an activation size in these costs is: bytes, or "units"."""

    def __post_init__(self) -> None:
        if not self.spill_bytes:
            object.__setattr__(self, "spill_bytes", self.act_bytes)
        if not self.param_bytes:
            object.__setattr__(self, "param_bytes", (0,) * len(self.f))
        n = len(self.f)
        for name in FIELDS:
            # byte counts from a profile stay integers: the planner's budgets and answers are whole bytes
            val = tuple(x if isinstance(x, int) and not isinstance(x, bool) else float(x) for x in getattr(self, name))
            object.__setattr__(self, name, val)
            if len(val) != n:
                raise StratumError(f"costs: {name} has {len(val)} entries, f has {n}; give one per stage")
            if any(x < 0 or math.isnan(x) for x in val):
                raise StratumError(f"costs: {name} has a negative or NaN entry")
        if self.latency < 0:
            raise StratumError(f"costs: latency must be >= 0 seconds, got {self.latency}")
        if not self.bandwidth > 0:
            raise StratumError(f"costs: bandwidth must be > 0 bytes/s, got {self.bandwidth}")

    def on_half_params(self) -> Costs:
        """These costs with the byte columns measured on 16-bit parameters in place (itself where none were)."""
        if self.half_bytes is None:
            return self
        act, out, spill = self.half_bytes
        return replace(self, act_bytes=act, out_bytes=out, spill_bytes=spill, half_bytes=None)

    @property
    def num_stages(self) -> int:
        return len(self.f)

    def compute(self, a) -> float:
        """Seconds of a schedule action (its ``kind`` F, B, I or W, on its ``stage``)."""
        return {"F": self.f, "B": self.b, "I": self.i, "W": self.w}[a.kind][a.stage]

    def message_s(self, nbytes: float) -> float:
        """Seconds for a cross-rank message of ``nbytes`` bytes."""
        return self.latency + nbytes / self.bandwidth

    # ---- made from ----------------------------------------------------------------------------------------
    @classmethod
    def blocks(cls, profile: Profile) -> Costs:
        """A :class:`stratum.profile.Profile`'s blocks, one unit each."""
        bs = profile.blocks
        half = None
        if bs and all(x.half_act_saved_bytes is not None for x in bs):
            half = ([x.half_act_saved_bytes or 0 for x in bs], [x.half_out_bytes or 0 for x in bs],
                    [x.half_spill_bytes or x.half_act_saved_bytes or 0 for x in bs])
        return cls(f=[x.fwd_s for x in bs], b=[x.bwd_s for x in bs], i=[x.bwd_input_s for x in bs],
                   w=[x.bwd_weight_s for x in bs], act_bytes=[x.act_saved_bytes for x in bs],
                   out_bytes=[x.out_bytes for x in bs], spill_bytes=[x.spill_bytes or x.act_saved_bytes for x in bs],
                   param_bytes=[x.param_bytes for x in bs], half_bytes=half)

    @classmethod
    def zeros(cls, n: int) -> Costs:
        """``n`` units that cost nothing (what is known without a profile)."""
        z, zb = (0.0,) * n, (0,) * n
        return cls(f=z, b=z, i=z, w=z, act_bytes=zb, out_bytes=zb, spill_bytes=zb, param_bytes=zb)

    @classmethod
    def unit(cls, num_stages: int, *, stages_per_rank: int = 1, f: float = 1.0, b: float = 2.0, i: float = 1.0,
             w: float = 1.0, act_bytes: float = 1.0, out_bytes: float = 0.0, latency: float = 0.0,
             bandwidth: float = math.inf) -> Costs:
        """Identical stages. With ``stages_per_rank`` = v the compute and activation of each stage are divided
        by v, so a rank's total work and memory per micro-batch stay those of a one-stage-per-rank pipeline
        (the fair way to compare interleaved/wave with 1F1B); message sizes are not divided."""
        k = 1.0 / stages_per_rank
        n = num_stages
        return cls(f=(f * k,) * n, b=(b * k,) * n, i=(i * k,) * n, w=(w * k,) * n,
                   act_bytes=(act_bytes * k,) * n, out_bytes=(out_bytes,) * n, latency=latency,
                   bandwidth=bandwidth, time_unit="units", memory_unit="units")

    @classmethod
    def from_profile(cls, profile: Profile, partition: Sequence[Sequence[int] | range], *, latency: float = 0.0,
                     bandwidth: float = math.inf) -> Costs:
        """A profile's blocks summed into the stages of ``partition``, with the link given."""
        return replace(cls.blocks(profile).over(partition), latency=latency, bandwidth=bandwidth)

    def with_action_s(self, seconds: float) -> Costs:
        """These costs with ``seconds`` added to every action of every unit (forward, backward, and the backward's
        input- and weight-gradient parts)."""
        f, b, i, w = ([x + seconds for x in getattr(self, k)] for k in ("f", "b", "i", "w"))
        return replace(self, f=f, b=b, i=i, w=w)

    def over(self, partition: Sequence[Sequence[int] | range]) -> Costs:
        """These units summed into groups (blocks into stages): ``partition[s]`` is group s's range, as
        ``range(a, b)`` or ``(a, b)`` (b exclusive), covering every unit contiguously, in order. Times, kept
        and spilled bytes add up; a group's message is its last unit's output."""
        spans = [(r.start, r.stop) if isinstance(r, range) else tuple(r) for r in partition]
        if not spans:
            raise StratumError("partition is empty; give one block range per stage")
        nxt = 0
        for s, sp in enumerate(spans):
            if len(sp) != 2 or sp[0] != nxt or sp[1] <= sp[0]:
                raise StratumError(f"partition: stage {s} is {list(sp)}, expected a non-empty range starting at "
                                   f"block {nxt} (stages must cover the blocks contiguously, in order)")
            nxt = sp[1]
        if nxt != self.num_stages:
            raise StratumError(f"partition covers blocks 0..{nxt - 1}, but the profile has {self.num_stages} "
                               "blocks")
        summed: dict[str, Any] = {name: [sum(getattr(self, name)[a:b]) for a, b in spans]
                                  for name in ("f", "b", "i", "w", "act_bytes", "spill_bytes", "param_bytes")}
        return replace(self, **summed, out_bytes=[self.out_bytes[b - 1] for _, b in spans])


@dataclass(frozen=True, kw_only=True)
class StepCosts:
    """Seconds of a training step outside its blocks' forward and backward, on the profiled device, as the plain
    engine runs it (measured beside the profile: :mod:`stratum.plan.step_probe`), and the blocks' pace at that
    moment. Every engine makes these calls too, so a planner charges them to every rank, over its device's
    speed."""

    fixed_s: float = 0.0
    """Per step, outside the blocks and the AdamW update: the gradient norm and clipping, zeroing the gradients,
    the loss's reduction, the engine's Python."""
    per_microbatch_s: float = 0.0
    """Per micro-batch, outside the blocks: the batch's copy to the device, the loss scaling, autograd's
    graph set-up and the engine's Python."""
    split_block_s: float = 0.0
    """Per split block and micro-batch, its forward and backward together: what DTensor's dispatch and copies
    add to the block's own compute under ``split`` (its sharded arithmetic and reductions are priced apart)."""
    split_fixed_s: float = 0.0
    """Per step under ``split``: what the gradient norm, clipping and update over DTensor parameters add."""
    per_action_s: float = 0.0
    """Per action of a pipeline rank (a stage's forward or backward, or the backward's input- or weight-gradient
    part), beyond its blocks: the stage runtime's bookkeeping, the autograd call, the batch and the loss where the
    stage has them. A pipeline rank pays it in each action, in place of ``per_microbatch_s``."""

    block_scale: float = 1.0
    """The blocks' seconds when these costs were measured over the profile's: a planner multiplies the profile's
    block times by it, so that blocks and step costs are priced at the load of one moment."""

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_microbatch_s", "split_block_s", "split_fixed_s", "per_action_s"):
            x = getattr(self, name)
            if not x >= 0 or math.isinf(x):
                raise StratumError(f"step costs: {name} must be a number of seconds >= 0, got {x}")
        if not self.block_scale > 0 or math.isinf(self.block_scale):
            raise StratumError(f"step costs: block_scale must be a positive number, got {self.block_scale}")
