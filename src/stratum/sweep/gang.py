"""Saturn-style joint planning: each job's strategy (which may span several slots at once), its slots and its
start time, to minimise the makespan.

A job's candidate strategies are :class:`Option` s — predicted seconds on ``devices`` slots at once (plain or
offload on one; replicate(k) or pipeline(k) on k). A plan gives every job one option, a set of that many slots
and a start; on every slot the jobs do not overlap, and no job starts on a slot before it is free.

The MILP (binaries y[job, option], z[job, slot], o[job, job'] for the order of a pair; starts S[job]; makespan C):
one option per job; |slots of a job| = its option's devices; C ≥ S + d (d = Σ y·seconds); S ≥ free_at[slot] where
the job uses the slot; for a pair sharing a slot, one ends before the other starts (big-M on o and on both z's).
It is solved by PuLP's CBC under a time limit, warm-started from the greedy plan (longest job first; each takes,
among its options of near-least device-seconds, the one that ends earliest on the slots that free first) as the
local search of :mod:`stratum.sweep.gang_search` improved it, which is also the fallback without PuLP or without
a better integer solution in time; a better MILP plan is searched again.
:func:`~stratum.sweep.gang_plan.list_schedule` turns an order and the choices into starts (as early as the slots
allow), so every plan returned is feasible by construction.

When every option is on one slot, order within a slot does not matter and the plain assignment MILP of
:mod:`stratum.sweep.makespan` (no order variables, a much tighter model) solves it (:func:`plan_jobs`).
"""

from __future__ import annotations

import importlib
import time
from dataclasses import replace

from stratum.sweep.gang_plan import GangPlan, Option, Placed, list_schedule, makespan_of
from stratum.sweep.gang_search import improve
from stratum.sweep.makespan import plan_makespan, pulp_available


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
        if best is None or makespan_of(placed, free_at) < makespan_of(best, free_at) - 1e-12:
            best = placed
    return GangPlan(placed=best or {}, makespan=makespan_of(best or {}, free_at), method="greedy", optimal=False,
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
            key = (round(trial[job].end, 9), opt.devices, name)  # ends equal but for rounding: fewer devices
            if pick is None or key < pick[0]:
                pick = (key, (name, opt))
        assert pick is not None  # (the option of the least area is within any factor >= 1)
        picks[job] = pick[1]
        done.append(job)
    return list_schedule(done, picks, free_at)


def plan_gang(options: dict[str, dict[str, Option]], free_at: list[float], *, time_limit_s: float,
              gap: float = 0.0) -> GangPlan:
    """The best plan found within about ``time_limit_s``: the greedy plan improved by local search
    (:mod:`stratum.sweep.gang_search`), then — with PuLP installed — the MILP warm-started from it, and the
    MILP's plan searched again where it is better. The solver stops once its plan is proved within ``gap``
    (relative) of the optimum. ``solve_s`` is the whole time spent, whichever plan stands."""
    for job, opts in options.items():
        if not any(o.devices <= len(free_at) for o in opts.values()):
            raise ValueError(f"{job}: every option needs more than the {len(free_at)} slots")
    t0 = time.perf_counter()
    plan = _best_gang(options, free_at, time_limit_s, gap)
    return replace(plan, solve_s=time.perf_counter() - t0)


def _best_gang(options: dict[str, dict[str, Option]], free_at: list[float], time_limit_s: float,
               gap: float) -> GangPlan:
    greedy = _searched(greedy_gang(options, free_at), options, free_at, time_limit_s)
    if not options or not pulp_available():
        return greedy
    milp = _milp(options, free_at, time_limit_s, gap, greedy)
    if milp is None or milp.makespan > greedy.makespan + 1e-9:
        return greedy
    return milp if milp.optimal else _searched(milp, options, free_at, time_limit_s)


SEARCH_SHARE = 0.2
"""The share of the time limit the local search may take each time it runs."""


def _searched(plan: GangPlan, options: dict[str, dict[str, Option]], free_at: list[float],
              time_limit_s: float) -> GangPlan:
    """``plan`` improved by the local search; its method gains "+search" where the search changed the plan
    (:func:`plan_gang` times the whole)."""
    placed = improve(plan.placed, options, free_at, deadline=time.monotonic() + SEARCH_SHARE * time_limit_s)
    if placed == plan.placed:
        return plan
    return replace(plan, placed=placed, makespan=makespan_of(placed, free_at), method=f"{plan.method}+search",
                   optimal=False)


def _milp(options: dict[str, dict[str, Option]], free_at: list[float], time_limit_s: float, gap: float,
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
    status = prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, warmStart=True, gapRel=gap))
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
    return GangPlan(placed=placed, makespan=makespan_of(placed, free_at), method="milp", optimal=optimal,
                    solve_s=time.perf_counter() - t0)


def plan_jobs(options: dict[str, dict[str, Option]], free_at: list[float], *, time_limit_s: float,
              gap: float = 0.0) -> GangPlan:
    """The plan the planned scheduler follows: :func:`plan_gang`'s, or — when every option holds one slot — the
    assignment MILP's (:func:`stratum.sweep.makespan.plan_makespan`), each slot's queue started back to back."""
    if any(o.devices > 1 for opts in options.values() for o in opts.values()):
        return plan_gang(options, free_at, time_limit_s=time_limit_s, gap=gap)
    flat = plan_makespan({j: {n: o.seconds for n, o in opts.items()} for j, opts in options.items()}, free_at,
                         time_limit_s=time_limit_s, gap=gap)
    order = [j for queue in flat.queues for j in queue]
    picks = {j: (c.strategy, options[j][c.strategy]) for j, c in flat.choices.items()}
    placed = list_schedule(order, picks, free_at, {j: (c.slot,) for j, c in flat.choices.items()})
    return GangPlan(placed=placed, makespan=makespan_of(placed, free_at), method=flat.method, optimal=flat.optimal,
                    solve_s=flat.solve_s)
