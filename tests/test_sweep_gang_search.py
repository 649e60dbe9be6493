"""The joint plan's local search: never worse than the plan it starts from, always feasible, and on small cases
where the greedy plan misses the optimum it finds the brute force's; a plateau held by one job is left by ending
the others sooner."""

from __future__ import annotations

import random
import time

import pytest

from stratum.sweep.gang import greedy_gang
from stratum.sweep.gang_plan import GangPlan, Option, list_schedule, makespan_of
from stratum.sweep.gang_search import improve, score

from test_sweep_gang import brute_force, check_feasible, random_case


def _searched(options: dict[str, dict[str, Option]], free_at: list[float]) -> GangPlan:
    placed = improve(greedy_gang(options, free_at).placed, options, free_at, deadline=time.monotonic() + 30)
    return GangPlan(placed=placed, makespan=makespan_of(placed, free_at), method="test", optimal=False, solve_s=0)


@pytest.mark.parametrize("seed", range(12))
def test_the_search_is_feasible_and_never_worse_than_where_it_starts(seed):
    rng = random.Random(seed)
    options = random_case(rng, 6, 3)
    free_at = [0.0, round(rng.uniform(0, 3), 2), 0.5]
    greedy = greedy_gang(options, free_at)
    plan = _searched(options, free_at)
    check_feasible(plan, options, free_at)
    assert score(plan.placed) <= score(greedy.placed)


@pytest.mark.parametrize("seed", [2, 6, 30, 53])
def test_where_greedy_misses_the_optimum_the_search_finds_it(seed):
    # (the seeds of 4 jobs on 2 slots whose greedy plan is above the brute-force optimum)
    options = random_case(random.Random(seed), 4, 2)
    best = brute_force(options, [0.0, 0.0])
    assert greedy_gang(options, [0.0, 0.0]).makespan > best + 1e-6
    assert _searched(options, [0.0, 0.0]).makespan == pytest.approx(best, abs=1e-6)


def test_a_job_over_both_slots_that_delays_the_long_one_goes_back_to_one_slot():
    # a over both slots first (0-2) holds back long (10 s, one slot only): 12 s. The search runs a on one slot
    # beside long, then b: 10 s.
    options = {"long": {"plain": Option(seconds=10)},
               "a": {"plain": Option(seconds=3), "replicate(2)": Option(seconds=2, devices=2)},
               "b": {"plain": Option(seconds=3)}}
    start = list_schedule(["a", "long", "b"], {"a": ("replicate(2)", options["a"]["replicate(2)"]),
                                               "long": ("plain", options["long"]["plain"]),
                                               "b": ("plain", options["b"]["plain"])}, [0.0, 0.0])
    assert score(start) == (12.0, 2 + 12 + 5)
    assert score(improve(start, options, [0.0, 0.0], deadline=time.monotonic() + 30)) == (10.0, 10 + 3 + 6)


def test_a_plateau_held_by_one_job_is_left_by_ending_the_others_sooner():
    # long holds the makespan at 10 s whatever the rest do; c (6 s) before a (3 s) on the other slot ends them at
    # 6 and 9, a before c at 3 and 9: the same makespan, and the search takes the lower summed ends
    options = {"long": {"plain": Option(seconds=10)}, "a": {"plain": Option(seconds=3)},
               "c": {"plain": Option(seconds=6)}}
    picks = {j: ("plain", o["plain"]) for j, o in options.items()}
    start = list_schedule(["long", "c", "a"], picks, [0.0, 0.0])
    assert score(start) == (10.0, 10 + 6 + 9)
    assert score(improve(start, options, [0.0, 0.0], deadline=time.monotonic() + 30)) == (10.0, 10 + 3 + 9)
