"""Improve a joint plan by local search: the MILP of :mod:`stratum.sweep.gang` (big-M pairs on every slot) often
stops at its time limit far from the area bound on a dozen jobs or more, and the greedy plan is a single pass.

From a plan, each move changes one job's option (among all it has) and lists the jobs again
(:func:`~stratum.sweep.gang.list_schedule`: each job, in order, on the slots that free first) in several orders —
the current plan's starts, and longest first by seconds, by device-seconds and by devices — or swaps two jobs in
the current order. A move is taken when it lowers (makespan, the jobs' summed ends): the second term lets the
search leave a plateau where the makespan is held by one job, by finishing the others sooner. It stops when no
move helps or at its deadline; every plan it returns is a list schedule, so feasible by construction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from stratum.sweep.gang_plan import Option, Placed, list_schedule

Picks = dict[str, tuple[str, Option]]
Key = tuple[float, float]
EPS = 1e-9


def score(placed: dict[str, Placed]) -> Key:
    """What the search lowers: (makespan, the jobs' summed ends)."""
    ends = [p.end for p in placed.values()]
    return (max(ends + [0.0]), sum(ends))


def _orders(picks: Picks, current: list[str]) -> Iterator[list[str]]:
    """The orders a move's jobs are listed in (see the module)."""
    yield current
    keys: list[Callable[[str], tuple]] = [
        lambda j: (-picks[j][1].seconds, j),
        lambda j: (-picks[j][1].seconds * picks[j][1].devices, j),
        lambda j: (-picks[j][1].devices, -picks[j][1].seconds, j)]
    for key in keys:
        yield sorted(current, key=key)


def _better(a: Key, b: Key) -> bool:
    return a[0] < b[0] - EPS or (a[0] <= b[0] + EPS and a[1] < b[1] - EPS)


def improve(placed: dict[str, Placed], options: dict[str, dict[str, Option]], free_at: list[float], *,
            deadline: float) -> dict[str, Placed]:
    """A plan no worse than ``placed`` (same jobs; every option within the slots), searched until no move
    helps or ``time.monotonic()`` passes ``deadline``."""
    fitting = {j: {n: o for n, o in options[j].items() if o.devices <= len(free_at)} for j in options}
    picks: Picks = {j: (p.strategy, fitting[j][p.strategy]) for j, p in placed.items()}
    order = sorted(placed, key=lambda j: (placed[j].start, j))
    best, best_key = placed, score(placed)
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        ends = {j: best[j].end for j in best}
        for trial_picks, trial_order in _moves(picks, order, fitting, ends):
            trial = list_schedule(trial_order, trial_picks, free_at)
            key = score(trial)
            if _better(key, best_key):
                best, best_key, picks = trial, key, trial_picks
                order = sorted(trial, key=lambda j: (trial[j].start, j))
                improved = True
                break
            if time.monotonic() >= deadline:
                break
    return best


def _moves(picks: Picks, order: list[str], fitting: dict[str, dict[str, Option]],
           ends: dict[str, float]) -> Iterator[tuple[Picks, list[str]]]:
    """Every change of one job's option to one priced otherwise (in every order of :func:`_orders`), the jobs
    that end last first; then every swap of two jobs in ``order``."""
    for job in sorted(order, key=lambda j: (-ends[j], j)):
        now = picks[job][1]
        for name, opt in sorted(fitting[job].items()):
            if opt.devices != now.devices or abs(opt.seconds - now.seconds) > EPS:  # one priced alike: no change
                changed = {**picks, job: (name, opt)}
                for o in _orders(changed, order):
                    yield changed, o
    for a in range(len(order)):
        for b in range(a + 1, len(order)):
            swapped = list(order)
            swapped[a], swapped[b] = swapped[b], swapped[a]
            yield picks, swapped
