"""A joint plan's data — each job's option, slots and start — and the list schedule that turns an order and the
options into starts: what the greedy plan, the MILP (:mod:`stratum.sweep.gang`) and the local search
(:mod:`stratum.sweep.gang_search`) all produce and read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Option:
    """One candidate strategy of a job."""

    seconds: float
    """Its predicted time to the job's end."""
    devices: int = 1
    """Slots it holds at once."""
    peak_bytes: int = 0
    """Its predicted peak bytes per device (what made it a candidate: it fits)."""


@dataclass(frozen=True, kw_only=True)
class Placed:
    """A job in a plan."""

    strategy: str
    slots: tuple[int, ...]
    start: float
    end: float


@dataclass(kw_only=True)
class GangPlan:
    placed: dict[str, Placed]
    """Job → its strategy, slots and times."""
    makespan: float
    method: str
    """milp or greedy, with "+search" where the local search improved it."""
    optimal: bool
    """The solver proved the makespan optimal (within the gap it was given)."""
    solve_s: float


def list_schedule(order: list[str], picks: dict[str, tuple[str, Option]], free_at: list[float],
                  fixed_slots: dict[str, tuple[int, ...]] | None = None) -> dict[str, Placed]:
    """Jobs in ``order``, each started as early as its slots allow: the ``devices`` slots that free first (or
    ``fixed_slots[job]``)."""
    ends = list(free_at)
    out = {}
    for job in order:
        name, opt = picks[job]
        slots = (fixed_slots or {}).get(job) or tuple(sorted(sorted(range(len(ends)),
                                                                     key=lambda s: (ends[s], s))[:opt.devices]))
        start = max(ends[s] for s in slots)
        for s in slots:
            ends[s] = start + opt.seconds
        out[job] = Placed(strategy=name, slots=slots, start=start, end=start + opt.seconds)
    return out


def makespan_of(placed: dict[str, Placed], free_at: list[float]) -> float:
    return max([p.end for p in placed.values()] + [0.0])


def gang_table(plan: GangPlan) -> str:
    """One line per job, by start: start, end, slots, strategy."""
    rows = [f"{'start':>8} {'end':>8}  {'slots':10} job strategy"]
    for job, p in sorted(plan.placed.items(), key=lambda kv: (kv[1].start, kv[0])):
        rows.append(f"{p.start:8.3g} {p.end:8.3g}  {','.join(map(str, p.slots)):10} {job} {p.strategy}")
    return "\n".join(rows)
