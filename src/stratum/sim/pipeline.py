"""Event simulation of a pipeline :class:`Schedule`: makespan, bubble ratio, per-rank peak activation bytes.

Model:

- Each rank runs its action list in order; an action starts when the rank is free and all its inputs have
  arrived (the executor's semantics, see :mod:`stratum.schedule.validate`).
- Compute cost per stage: ``f[s]``, ``b[s]``, ``i[s]``, ``w[s]`` seconds.
- A cross-rank message costs ``latency + bytes / bandwidth`` seconds and overlaps with compute (a dedicated
  link per rank pair, no contention). A hand-off between stages on the same rank is free. The forward
  activation out of stage s and the gradient coming back into it both have ``out_bytes[s]`` bytes.
- **Bubble ratio** = 1 - (sum of busy seconds over ranks) / (P * makespan): the idle share of the P ranks
  during the step.
- **Activation memory**: stage s holds ``act_bytes[s]`` for a micro-batch from the start of its F until the end
  of its B, or until the end of W when the backward is split (the weight gradient needs the stage's saved
  inputs, so they cannot go at I). Peak per rank is the maximum of the sum over time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from stratum.errors import StratumError
from stratum.schedule.ir import Action, Schedule


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Per-stage costs (seconds, bytes) and the point-to-point link (seconds, bytes/second)."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    act_bytes: tuple[float, ...]
    """Bytes stage s keeps alive per micro-batch between its forward and its (weight) backward."""
    out_bytes: tuple[float, ...]
    """Bytes of stage s's output activation (= bytes of the gradient sent back into it)."""
    latency: float = 0.0
    bandwidth: float = math.inf
    time_unit: str = "s"
    """What a time in these costs is: seconds (profiled costs), or "units" (:meth:`unit`'s made-up costs)."""
    memory_unit: str = "bytes"
    """What an activation size in these costs is: bytes, or "units"."""

    def __post_init__(self) -> None:
        n = len(self.f)
        for name in ("f", "b", "i", "w", "act_bytes", "out_bytes"):
            val = tuple(float(x) for x in getattr(self, name))
            object.__setattr__(self, name, val)
            if len(val) != n:
                raise StratumError(f"costs: {name} has {len(val)} entries, f has {n}; give one per stage")
            if any(x < 0 or math.isnan(x) for x in val):
                raise StratumError(f"costs: {name} has a negative or NaN entry")
        if self.latency < 0:
            raise StratumError(f"costs: latency must be >= 0 seconds, got {self.latency}")
        if not self.bandwidth > 0:
            raise StratumError(f"costs: bandwidth must be > 0 bytes/s, got {self.bandwidth}")

    @property
    def num_stages(self) -> int:
        return len(self.f)

    def compute(self, a: Action) -> float:
        return {"F": self.f, "B": self.b, "I": self.i, "W": self.w}[a.kind][a.stage]

    def message_s(self, nbytes: float) -> float:
        """Seconds for a cross-rank message of ``nbytes`` bytes."""
        return self.latency + nbytes / self.bandwidth

    @classmethod
    def unit(cls, num_stages: int, *, stages_per_rank: int = 1, f: float = 1.0, b: float = 2.0, i: float = 1.0,
             w: float = 1.0, act_bytes: float = 1.0, out_bytes: float = 0.0, latency: float = 0.0,
             bandwidth: float = math.inf) -> "Costs":
        """Identical stages. With ``stages_per_rank`` = v the compute and activation of each stage are divided
        by v, so a rank's total work and memory per micro-batch stay those of a one-stage-per-rank pipeline
        (the fair way to compare interleaved/wave with 1F1B); message sizes are not divided."""
        k = 1.0 / stages_per_rank
        n = num_stages
        return cls(f=(f * k,) * n, b=(b * k,) * n, i=(i * k,) * n, w=(w * k,) * n,
                   act_bytes=(act_bytes * k,) * n, out_bytes=(out_bytes,) * n, latency=latency,
                   bandwidth=bandwidth, time_unit="units", memory_unit="units")

    @classmethod
    def from_profile(cls, profile, partition: Sequence[Sequence[int] | range], *, latency: float = 0.0,
                     bandwidth: float = math.inf) -> "Costs":
        """Sum a :class:`stratum.profile.Profile`'s per-block costs over each stage's blocks.

        ``partition[s]`` is the block range of stage s, as ``range(a, b)`` or ``(a, b)`` (b exclusive); the
        ranges must cover all blocks, contiguously, in order. I = sum of ``bwd_input_s``, W = sum of
        ``bwd_weight_s``; the message size is the ``out_bytes`` of the stage's last block.
        """
        blocks = profile.blocks
        spans = [(r.start, r.stop) if isinstance(r, range) else tuple(r) for r in partition]
        if not spans:
            raise StratumError("partition is empty; give one block range per stage")
        nxt = 0
        for s, sp in enumerate(spans):
            if len(sp) != 2 or sp[0] != nxt or sp[1] <= sp[0]:
                raise StratumError(f"partition: stage {s} is {list(sp)}, expected a non-empty range starting at "
                                   f"block {nxt} (stages must cover the blocks contiguously, in order)")
            nxt = sp[1]
        if nxt != len(blocks):
            raise StratumError(f"partition covers blocks 0..{nxt - 1}, but the profile has {len(blocks)} blocks")
        sel = [blocks[a:b] for a, b in spans]
        return cls(f=[sum(x.fwd_s for x in bs) for bs in sel], b=[sum(x.bwd_s for x in bs) for bs in sel],
                   i=[sum(x.bwd_input_s for x in bs) for bs in sel],
                   w=[sum(x.bwd_weight_s for x in bs) for bs in sel],
                   act_bytes=[sum(x.act_saved_bytes for x in bs) for bs in sel],
                   out_bytes=[bs[-1].out_bytes for bs in sel], latency=latency, bandwidth=bandwidth)


@dataclass(frozen=True, kw_only=True)
class ActionRecord:
    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """What :func:`simulate` found, in the units of the costs (``time_unit``, ``memory_unit``)."""

    schedule: Schedule
    makespan: float
    busy: tuple[float, ...]
    """Busy seconds per rank."""
    peak_act: tuple[float, ...]
    """Peak live activation bytes per rank."""
    records: tuple[ActionRecord, ...] = field(repr=False)
    """Every action with its start and end, sorted by start time."""
    time_unit: str = "s"
    """Costs.time_unit: seconds, or "units" for unit costs."""
    memory_unit: str = "bytes"
    """Costs.memory_unit: bytes, or "units" for unit costs."""

    @property
    def bubble(self) -> float:
        """1 - sum(busy) / (P * makespan); 0 for an empty step."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    def summary(self) -> str:
        s = self.schedule
        lines = [s.describe(),
                 f"makespan {self.makespan:.6g} {self.time_unit}   bubble {self.bubble:.4f}   (SIMULATED)",
                 f"rank   {'busy ' + self.time_unit:<10}  peak activation {self.memory_unit}"]
        for r, (b, p) in enumerate(zip(self.busy, self.peak_act)):
            lines.append(f"{r:>4}   {b:<10.6g}  {p:.6g}")
        return "\n".join(lines)

    def chrome_trace(self) -> dict:
        """Chrome trace (chrome://tracing, Perfetto) object: one complete event per action, tid = rank."""
        from stratum.sim.trace import chrome_trace

        return chrome_trace(self)

    def write_trace(self, path) -> None:
        from stratum.sim.trace import write_chrome_trace

        write_chrome_trace(self, path)

    def write_png(self, path) -> None:
        from stratum.sim.trace import write_png

        write_png(self, path)


def simulate(schedule: Schedule, costs: Costs) -> SimResult:
    """Run ``schedule`` under ``costs`` (see the module docstring). The schedule must be valid."""
    S, P = schedule.num_stages, schedule.num_ranks
    if costs.num_stages != S:
        raise StratumError(f"costs are for {costs.num_stages} stages, the schedule has {S}")
    where = schedule.stage_to_rank
    end: dict[Action, float] = {}
    ptr = [0] * P
    free = [0.0] * P
    busy = [0.0] * P
    records: list[ActionRecord] = []
    total = sum(len(a) for a in schedule.actions)

    def arrival(a: Action, d: Action) -> float:
        if where[d.stage] == where[a.stage]:
            return end[d]
        nbytes = costs.out_bytes[d.stage] if d.kind == "F" else costs.out_bytes[a.stage]
        return end[d] + costs.message_s(nbytes)

    # Each rank's start times depend only on earlier actions, so any order that respects dependencies gives
    # the same result; sweep the ranks until all lists are through.
    while len(records) < total:
        progressed = False
        for r, acts in enumerate(schedule.actions):
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                ds = schedule.deps(a)
                if any(d not in end for d in ds):
                    break
                start = max([free[r]] + [arrival(a, d) for d in ds])
                dur = costs.compute(a)
                end[a] = start + dur
                free[r] = start + dur
                busy[r] += dur
                records.append(ActionRecord(rank=r, action=a, start=start, end=start + dur))
                ptr[r] += 1
                progressed = True
        if not progressed:
            raise StratumError(f"schedule {schedule.name} cannot run to the end; validate() it for the reason")

    # Activation memory: +act at F start, -act at the end of B (or W). Frees sort before allocations at equal
    # times, so back-to-back B then F on a rank does not count both.
    events: list[list[tuple[float, int, float]]] = [[] for _ in range(P)]
    for rec in records:
        a = rec.action
        nbytes = costs.act_bytes[a.stage]
        if a.kind == "F":
            events[rec.rank].append((rec.start, 1, nbytes))
        elif a.kind in "BW":
            events[rec.rank].append((rec.end, 0, -nbytes))
    peak = []
    for ev in events:
        cur = best = 0.0
        for _, _, delta in sorted(ev):
            cur += delta
            best = max(best, cur)
        peak.append(best)
    makespan = max([rec.end for rec in records] + [0.0])
    records.sort(key=lambda x: (x.start, x.rank))
    return SimResult(schedule=schedule, makespan=makespan, busy=tuple(busy), peak_act=tuple(peak),
                     records=tuple(records), time_unit=costs.time_unit, memory_unit=costs.memory_unit)
