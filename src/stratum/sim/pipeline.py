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

from dataclasses import dataclass, field

from stratum.errors import StratumError
from stratum.ir.costs import Costs
from stratum.schedule.ir import Action, Schedule


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
