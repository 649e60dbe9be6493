"""Saturn-style joint planning: each job's strategy (which may span several slots at once), its slots and its
start time, to minimise the makespan.

A job's candidate strategies are :class:`Option` s — predicted seconds on ``devices`` slots at once (plain or
offload on one; replicate(k) or pipeline(k) on k). A plan gives every job one option, a set of that many slots
and a start; on every slot the jobs do not overlap, and no job starts on a slot before it is free.

The MILP (binaries y[job, option], z[job, slot], o[job, job'] for the order of a pair; starts S[job]; makespan C):
one option per job; |slots of a job| = its option's devices; C ≥ S + d (d = Σ y·seconds); S ≥ free_at[slot] where
the job uses the slot; for a pair sharing a slot, one ends before the other starts (big-M on o and on both z's).
It is solved by PuLP's CBC under a time limit, warm-started from the greedy plan (longest job first; each takes,
among its options of near-least device-seconds, the one that ends earliest on the slots that free first), which
is also the fallback without PuLP or without an integer solution in time. :func:`list_schedule` turns an order
and the choices into starts (as early as the slots allow), so every plan returned is feasible by construction.

When every option is on one slot, order within a slot does not matter and the plain assignment MILP of
:mod:`stratum.sweep.makespan` (no order variables, a much tighter model) solves it (:func:`plan_jobs`).
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass

from stratum.sweep.makespan import plan_makespan, pulp_available


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
    """milp or greedy."""
    optimal: bool
    """The solver proved the makespan optimal."""
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


def _makespan(placed: dict[str, Placed], free_at: list[float]) -> float:
    return max([p.end for p in placed.values()] + [0.0])


def greedy_gang(options: dict[str, dict[str, Option]], free_at: list[float]) -> GangPlan:
    """Longest job first (by its fastest option); each takes, among its options whose device-seconds are within
    a factor of its least, the one that ends earliest given the slots so far. The factors tried are
    :data:`AREA_FACTORS` (1: the most efficient option, always; unbounded: the earliest end, always); the best
    plan is kept."""
    t0 = time.perf_counter()
    fitting = {j: {n: o for n, o in opts.items() if o.devices <= len(free_at)} for j, opts in options.items()}
    order = sorted(fitting, key=lambda j: (-min(o.seconds for o in fitting[j].values()), j))
    best: dict[str, Placed] | None = None
    for factor in AREA_FACTORS:
        placed = _greedy_within(order, fitting, free_at, factor)
        if best is None or _makespan(placed, free_at) < _makespan(best, free_at) - 1e-12:
            best = placed
    return GangPlan(placed=best or {}, makespan=_makespan(best or {}, free_at), method="greedy", optimal=False,
                    solve_s=time.perf_counter() - t0)


AREA_FACTORS = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, float("inf"))


def _greedy_within(order: list[str], fitting: dict[str, dict[str, Option]], free_at: list[float],
                   factor: float) -> dict[str, Placed]:
    picks: dict[str, tuple[str, Option]] = {}
    done: list[str] = []
    for job in order:
        least = min(o.seconds * o.devices for o in fitting[job].values())
        pick = None
        for name, opt in sorted(fitting[job].items()):
            if opt.seconds * opt.devices > factor * least * (1 + 1e-12):
                continue
            trial = list_schedule(done + [job], {**picks, job: (name, opt)}, free_at)
            key = (trial[job].end, opt.devices, name)
            if pick is None or key < pick[0]:
                pick = (key, (name, opt))
        assert pick is not None  # (the option of the least area is within any factor >= 1)
        picks[job] = pick[1]
        done.append(job)
    return list_schedule(done, picks, free_at)


def plan_gang(options: dict[str, dict[str, Option]], free_at: list[float], *, time_limit_s: float) -> GangPlan:
    """The best plan found within ``time_limit_s``: the MILP's when PuLP is installed and it is no worse than
    greedy."""
    for job, opts in options.items():
        if not any(o.devices <= len(free_at) for o in opts.values()):
            raise ValueError(f"{job}: every option needs more than the {len(free_at)} slots")
    greedy = greedy_gang(options, free_at)
    if not options or not pulp_available():
        return greedy
    milp = _milp(options, free_at, time_limit_s, greedy)
    return milp if milp is not None and milp.makespan <= greedy.makespan + 1e-9 else greedy


def _milp(options: dict[str, dict[str, Option]], free_at: list[float], time_limit_s: float,
          start: GangPlan) -> GangPlan | None:
    pulp = importlib.import_module("pulp")  # optional extra (sweep): imported only when planning
    t0 = time.perf_counter()
    jobs = sorted(options)
    slots = range(len(free_at))
    opts = {j: {n: o for n, o in options[j].items() if o.devices <= len(free_at)} for j in jobs}
    big = max(free_at) + sum(max(o.seconds for o in opts[j].values()) for j in jobs)
    prob = pulp.LpProblem("sweep_gang", pulp.LpMinimize)
    cmax = pulp.LpVariable("C", lowBound=0)
    y = {(j, n): pulp.LpVariable(f"y_{a}_{b}", cat="Binary")
         for a, j in enumerate(jobs) for b, n in enumerate(sorted(opts[j]))}
    z = {(j, s): pulp.LpVariable(f"z_{a}_{s}", cat="Binary") for a, j in enumerate(jobs) for s in slots}
    st = {j: pulp.LpVariable(f"S_{a}", lowBound=0) for a, j in enumerate(jobs)}
    pairs = [(a, b) for ia, a in enumerate(jobs) for b in jobs[ia + 1:]]
    o = {(a, b): pulp.LpVariable(f"o_{jobs.index(a)}_{jobs.index(b)}", cat="Binary") for a, b in pairs}
    dur = {j: pulp.lpSum(y[j, n] * opt.seconds for n, opt in opts[j].items()) for j in jobs}
    prob += cmax
    # the slots' busy time fits under C on every slot: implied by the rest, but it gives the relaxation the area
    # bound, so a plan that meets it is proved optimal at once instead of at the time limit
    prob += len(free_at) * cmax >= sum(free_at) + pulp.lpSum(y[j, n] * opt.seconds * opt.devices
                                                               for j in jobs for n, opt in opts[j].items())
    for j in jobs:
        prob += pulp.lpSum(y[j, n] for n in opts[j]) == 1
        prob += pulp.lpSum(z[j, s] for s in slots) == pulp.lpSum(y[j, n] * opt.devices for n, opt in opts[j].items())
        prob += cmax >= st[j] + dur[j]
        for s in slots:
            prob += st[j] >= free_at[s] * z[j, s]
    for a, b in pairs:  # sharing a slot: a before b (o = 1) or b before a
        for s in slots:
            both = 2 - z[a, s] - z[b, s]
            prob += st[a] + dur[a] <= st[b] + big * (1 - o[a, b]) + big * both
            prob += st[b] + dur[b] <= st[a] + big * o[a, b] + big * both
    for j in jobs:  # warm start: the greedy plan
        p = start.placed[j]
        for n in opts[j]:
            y[j, n].setInitialValue(int(n == p.strategy))
        for s in slots:
            z[j, s].setInitialValue(int(s in p.slots))
        st[j].setInitialValue(p.start)
    for a, b in pairs:
        o[a, b].setInitialValue(int(start.placed[a].start <= start.placed[b].start))
    cmax.setInitialValue(start.makespan)
    status = prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, warmStart=True))
    picks, fixed, starts = {}, {}, {}
    for j in jobs:
        chosen = [n for n in opts[j] if (y[j, n].value() or 0) > 0.5]
        used = tuple(s for s in slots if (z[j, s].value() or 0) > 0.5)
        if len(chosen) != 1 or len(used) != opts[j][chosen[0]].devices or st[j].value() is None:
            return None  # no integer solution within the limit
        picks[j], fixed[j], starts[j] = (chosen[0], opts[j][chosen[0]]), used, st[j].value()
    # the solver's order and slots, started as early as they allow: feasible whatever its rounding
    placed = list_schedule(sorted(jobs, key=lambda j: (starts[j], j)), picks, free_at, fixed)
    optimal = pulp.LpStatus[status] == "Optimal" and getattr(prob, "sol_status", 1) == 1
    return GangPlan(placed=placed, makespan=_makespan(placed, free_at), method="milp", optimal=optimal,
                    solve_s=time.perf_counter() - t0)


def plan_jobs(options: dict[str, dict[str, Option]], free_at: list[float], *, time_limit_s: float) -> GangPlan:
    """The plan the planned scheduler follows: :func:`plan_gang`'s, or — when every option holds one slot — the
    assignment MILP's (:func:`stratum.sweep.makespan.plan_makespan`), each slot's queue started back to back."""
    if any(o.devices > 1 for opts in options.values() for o in opts.values()):
        return plan_gang(options, free_at, time_limit_s=time_limit_s)
    flat = plan_makespan({j: {n: o.seconds for n, o in opts.items()} for j, opts in options.items()}, free_at,
                         time_limit_s=time_limit_s)
    order = [j for queue in flat.queues for j in queue]
    picks = {j: (c.strategy, options[j][c.strategy]) for j, c in flat.choices.items()}
    placed = list_schedule(order, picks, free_at, {j: (c.slot,) for j, c in flat.choices.items()})
    return GangPlan(placed=placed, makespan=_makespan(placed, free_at), method=flat.method, optimal=flat.optimal,
                    solve_s=flat.solve_s)


def gang_table(plan: GangPlan) -> str:
    """One line per job, by start: start, end, slots, strategy."""
    rows = [f"{'start':>8} {'end':>8}  {'slots':10} job strategy"]
    for job, p in sorted(plan.placed.items(), key=lambda kv: (kv[1].start, kv[0])):
        rows.append(f"{p.start:8.3g} {p.end:8.3g}  {','.join(map(str, p.slots)):10} {job} {p.strategy}")
    return "\n".join(rows)
