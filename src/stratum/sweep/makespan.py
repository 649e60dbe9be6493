"""Saturn-style planning: choose each job's strategy and slot to minimise the makespan.

Every job has candidate strategies (name, predicted seconds on one slot); slots may be busy until ``free_at``.
The MILP (binary x[job, slot, strategy], continuous makespan C ≥ free_at[s] + Σ x·t on every slot) is solved by
PuLP's bundled CBC under a time limit, warm-started from the greedy plan; without PuLP, or when the solver finds
nothing better in time, the greedy plan (longest job first onto the slot that frees first, each job's fastest
strategy) is used. Order within a slot does not change its finishing time; longest first is used, so a slot that
falls behind its prediction holds the short jobs the re-plan can move.

Strategies that span several slots at once (pipeline or replicate over k devices) are planned by
:mod:`stratum.sweep.gang`, which falls back to this model when every option holds one slot.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class Choice:
    """Where and how one job runs in a plan."""

    slot: int
    """The slot it runs on."""
    strategy: str
    """The candidate strategy picked."""
    seconds: float
    """Its predicted time."""


@dataclass(kw_only=True)
class MakespanPlan:
    """A plan: every job's slot and strategy, the slots' queues and the predicted makespan."""

    choices: dict[str, Choice]
    """Job → where and how it runs."""
    queues: list[list[str]]
    """Per slot, its jobs in the order they start."""
    makespan: float
    """Predicted time until the last slot is done (from now, counting free_at)."""
    method: str
    """milp, or greedy (no solver, or the solver found nothing better)."""
    optimal: bool
    """The solver proved the makespan optimal (within the gap it was given)."""
    solve_s: float
    """Wall seconds spent planning."""


def slot_ends(choices: dict[str, Choice], free_at: list[float]) -> list[float]:
    """When each slot finishes under ``choices``: its free time plus its jobs' seconds."""
    ends = list(free_at)
    for c in choices.values():
        ends[c.slot] += c.seconds
    return ends


def _plan(choices: dict[str, Choice], free_at: list[float], method: str, optimal: bool, t0: float) -> MakespanPlan:
    queues: list[list[str]] = [[] for _ in free_at]
    for job in sorted(choices, key=lambda j: (-choices[j].seconds, j)):
        queues[choices[job].slot].append(job)
    return MakespanPlan(choices=choices, queues=queues, makespan=max(slot_ends(choices, free_at), default=0.0),
                        method=method, optimal=optimal, solve_s=time.perf_counter() - t0)


def greedy_plan(options: dict[str, dict[str, float]], free_at: list[float]) -> MakespanPlan:
    """LPT list scheduling: each job's fastest strategy, longest first, onto the slot that frees first."""
    t0 = time.perf_counter()
    ends = list(free_at)
    choices = {}
    best = {j: min(opts.items(), key=lambda kv: (kv[1], kv[0])) for j, opts in options.items()}
    for job in sorted(best, key=lambda j: (-best[j][1], j)):
        s = min(range(len(ends)), key=lambda i: (ends[i], i))
        name, sec = best[job]
        choices[job] = Choice(slot=s, strategy=name, seconds=sec)
        ends[s] += sec
    return _plan(choices, free_at, "greedy", False, t0)


def pulp_available() -> bool:
    """PuLP (the sweep extra) can be imported: the MILP is tried; else the greedy plan is the plan."""
    try:
        importlib.import_module("pulp")
    except ImportError:
        return False
    return True


def plan_makespan(options: dict[str, dict[str, float]], free_at: list[float], *,
                  time_limit_s: float, gap: float = 0.0) -> MakespanPlan:
    """The best plan found within ``time_limit_s``: the MILP's if PuLP is installed and it beats greedy; the solver
    stops once its plan is proved within ``gap`` (relative) of the optimum."""
    greedy = greedy_plan(options, free_at)
    if not options or not pulp_available():
        return greedy
    milp = _milp_plan(options, free_at, time_limit_s, gap, greedy)
    return milp if milp is not None and milp.makespan <= greedy.makespan + 1e-9 else greedy


def _milp_plan(options: dict[str, dict[str, float]], free_at: list[float], time_limit_s: float, gap: float,
               start: MakespanPlan) -> MakespanPlan | None:
    """The MILP, warm-started from ``start``; None when CBC found no integer solution in time."""
    pulp = importlib.import_module("pulp")  # optional extra (sweep): imported only when planning
    t0 = time.perf_counter()
    slots = range(len(free_at))
    prob = pulp.LpProblem("sweep_makespan", pulp.LpMinimize)
    cmax = pulp.LpVariable("C", lowBound=0)
    x = {(j, s, c): pulp.LpVariable(f"x_{n}_{s}_{k}", cat="Binary")
         for n, (j, opts) in enumerate(sorted(options.items())) for s in slots for k, c in enumerate(sorted(opts))}
    prob += cmax
    for j, opts in options.items():
        prob += pulp.lpSum(x[j, s, c] for s in slots for c in opts) == 1
    for s in slots:
        prob += cmax >= free_at[s] + pulp.lpSum(x[j, s, c] * t for j, opts in options.items()
                                                for c, t in opts.items())
    for (j, s, c), var in x.items():  # warm start: the greedy plan, so a time-limited solve has an incumbent
        ch = start.choices[j]
        var.setInitialValue(1 if (ch.slot, ch.strategy) == (s, c) else 0)
    cmax.setInitialValue(start.makespan)
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, warmStart=True, gapRel=gap)
    status = prob.solve(solver)
    choices = {}
    for (j, s, c), var in x.items():
        if var.value() is not None and var.value() > 0.5:
            choices[j] = Choice(slot=s, strategy=c, seconds=options[j][c])
    if len(choices) != len(options):  # no integer solution within the limit
        return None
    optimal = pulp.LpStatus[status] == "Optimal" and getattr(prob, "sol_status", 1) == 1
    return _plan(choices, free_at, "milp", optimal, t0)
