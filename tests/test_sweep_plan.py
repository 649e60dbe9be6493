"""The pure parts of sweep scheduling: the makespan MILP against brute force, its time limit and greedy fallback,
the simulated schedulers, and ASHA's promotions on fake metric streams."""

from __future__ import annotations

import io
import itertools
import json
import random
import time

import pytest
from rich.console import Console

from stratum.sweep import makespan
from stratum.sweep.asha import Asha, rung_steps
from stratum.sweep.live import LiveTable, last_record
from stratum.sweep.makespan import greedy_plan, plan_makespan, slot_ends
from stratum.sweep.simulate import simulate
from stratum.sweep.state import SweepState

needs_pulp = pytest.mark.skipif(not makespan.pulp_available(), reason="PuLP (the sweep extra) is not installed")


def brute_force(options: dict[str, dict[str, float]], free_at: list[float]) -> float:
    jobs = sorted(options)
    best = float("inf")
    per_job = [[(s, c) for s in range(len(free_at)) for c in options[j]] for j in jobs]
    for pick in itertools.product(*per_job):
        ends = list(free_at)
        for j, (s, c) in zip(jobs, pick):
            ends[s] += options[j][c]
        best = min(best, max(ends))
    return best


def check_feasible(plan, options, free_at) -> None:
    assert set(plan.choices) == set(options)
    assert sorted(j for q in plan.queues for j in q) == sorted(options)
    for j, c in plan.choices.items():
        assert options[j][c.strategy] == c.seconds and 0 <= c.slot < len(free_at)
    assert plan.makespan == pytest.approx(max(slot_ends(plan.choices, free_at)))


@needs_pulp
@pytest.mark.parametrize("seed", range(6))
def test_milp_makespan_equals_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    n_jobs, n_slots = rng.randint(3, 6), rng.randint(2, 3)
    options = {f"j{i}": {"plain": float(rng.randint(1, 20))} for i in range(n_jobs)}
    if seed % 2:  # a second strategy per job (e.g. offload: slower on some, faster on others)
        for opts in options.values():
            opts["offload"] = float(rng.randint(1, 20))
    free_at = [float(rng.choice([0, 0, 3])) for _ in range(n_slots)]
    plan = plan_makespan(options, free_at, time_limit_s=20)
    check_feasible(plan, options, free_at)
    assert plan.makespan == pytest.approx(brute_force(options, free_at))


@needs_pulp
def test_greedy_is_beaten_where_lpt_is_not_optimal():
    # LPT on 2 slots puts 3,3 / 2,2,2 → 7; the optimum is 3,3 | 2,2,2 = 6 (3+3 = 6, 2+2+2 = 6)
    options = {f"j{i}": {"plain": t} for i, t in enumerate([3.0, 3.0, 2.0, 2.0, 2.0])}
    assert greedy_plan(options, [0.0, 0.0]).makespan == 7.0
    plan = plan_makespan(options, [0.0, 0.0], time_limit_s=20)
    assert (plan.method, plan.makespan, plan.optimal) == ("milp", 6.0, True)


@needs_pulp
def test_a_solver_stopped_by_its_time_limit_still_returns_a_feasible_plan_in_time():
    rng = random.Random(0)
    options = {f"j{i}": {"plain": rng.uniform(1, 100), "offload": rng.uniform(1, 100)} for i in range(60)}
    free_at = [0.0] * 7
    t0 = time.perf_counter()
    plan = plan_makespan(options, free_at, time_limit_s=1.0)
    assert time.perf_counter() - t0 < 15  # 1 s of search + model build and solver start-up
    check_feasible(plan, options, free_at)
    assert not plan.optimal  # stopped by the limit, not by a proof
    assert plan.makespan <= greedy_plan(options, free_at).makespan + 1e-9


def test_greedy_fallback_without_pulp(monkeypatch):
    monkeypatch.setattr(makespan, "pulp_available", lambda: False)
    options = {"a": {"plain": 4.0}, "b": {"plain": 3.0, "offload": 1.0}, "c": {"plain": 2.0}}
    plan = plan_makespan(options, [1.0, 0.0], time_limit_s=1)
    check_feasible(plan, options, [1.0, 0.0])
    # longest first onto the slot that frees first: a → slot 1 (free at 0), c → slot 0 (free at 1), b (offload, 1)
    # → slot 0 (ends 3, before slot 1's 4)
    assert plan.method == "greedy"
    assert {j: (c.slot, c.strategy) for j, c in plan.choices.items()} == {"a": (1, "plain"), "c": (0, "plain"),
                                                                        "b": (0, "offload")}
    assert plan.makespan == 4.0


def test_simulated_fifo_and_planned_on_a_hand_computed_case():
    # sweep order: 2, 2, 2, 3, 3 seconds on 2 slots. fifo: t=0 slot0←a slot1←b; t=2 slot0←c slot1←d;
    # t=4 slot0←e → ends at 7. planned: {a, b, c} | {d, e} → 6.
    steps = {"a": 2, "b": 2, "c": 2, "d": 3, "e": 3}
    step_s = dict.fromkeys(steps, 1.0)
    fifo = simulate("fifo", steps, step_s, slots=2)
    assert fifo.runs == [(0, 0, "a", 2), (0, 1, "b", 2), (2, 0, "c", 4), (2, 1, "d", 5), (4, 0, "e", 7)]
    assert fifo.makespan == 7.0 and fifo.utilisation == pytest.approx(12 / 14)
    planned = simulate("planned", steps, step_s, slots=2)
    assert planned.makespan == 6.0 and planned.utilisation == pytest.approx(1.0)


def test_lrtf_gives_a_freed_slot_the_job_with_the_longest_remaining_time_as_a_table():
    # jobs of 2, 2 and 4 one-second steps, in that order, slices of 1 step, 2 slots. At every instant the two
    # slots take the two longest remaining jobs (ties: sweep order):
    #   t=0: remaining a2 b2 c4 → c, a      t=1: a1 b2 c3 → c, b
    #   t=2: a1 b1 c2 → c, a                t=3: b1 c1 → b, c   (tie: sweep order puts b first)
    steps, step_s = {"a": 2, "b": 2, "c": 4}, {"a": 1.0, "b": 1.0, "c": 1.0}
    lrtf = simulate("lrtf", steps, step_s, slots=2, segment_steps=1)
    table = [(t, slot, job) for t, slot, job, _ in lrtf.runs]
    assert table == [(0, 0, "c"), (0, 1, "a"), (1, 0, "c"), (1, 1, "b"), (2, 0, "c"), (2, 1, "a"),
                     (3, 0, "b"), (3, 1, "c")]
    assert lrtf.makespan == 4.0  # the work bound 8 s / 2 slots; fifo needs 6 (c starts after a)
    assert simulate("fifo", steps, step_s, slots=2).makespan == 6.0


def test_asha_promotes_the_top_third_and_stops_the_worst_at_each_rung():
    # nine jobs report at rung 1 all at once (metric = eval loss), as a synchronous stream
    asha = Asha(min_steps=1, eta=3)
    assert rung_steps(1, 3, 27) == [1, 3, 9] and asha.next_stop(1, 27) == 3 and asha.next_stop(9, 27) == 27
    losses = {f"j{i}": v for i, v in enumerate([5.0, 1.0, 4.0, 3.0, 9.0, 2.0, 7.0, 8.0, 6.0])}
    for j, v in losses.items():
        asha.report(j, 1, v)
    promoted = []
    while (p := asha.promotable()) is not None:
        asha.promote(*p)
        promoted.append(p)
    assert promoted == [("j1", 1), ("j5", 1), ("j3", 1)]  # the best three, best first
    paused = sorted((j for j in losses if asha.is_paused(j)), key=losses.get)
    assert all(losses[s] > max(losses[p] for p, _ in promoted) for s in paused)  # the stopped are the worst
    # at rung 3 the three report; the best of them (1/3 of 3) goes on, the other two stop
    for j, v in [("j1", 0.9), ("j5", 0.5), ("j3", 0.7)]:
        asha.report(j, 3, v)
    assert asha.promotable() == ("j5", 3)


def test_asha_asynchronous_promotions_follow_the_rule_as_a_table():
    # (reporting job, its loss) → what a free slot would take right after, eta = 2: top ⌊n/2⌋ not yet promoted
    asha = Asha(min_steps=2, eta=2)
    stream = [("a", 5.0, None), ("b", 3.0, ("b", 2)), ("c", 4.0, None), ("d", 1.0, ("d", 2)), ("e", 6.0, None)]
    for job, loss, expected in stream:
        asha.report(job, 2, loss)
        got = asha.promotable()
        assert got == expected, (job, got)
        if got is not None:
            asha.promote(*got)
    # b was promoted with 2 results in; with 5 in, the top ⌊5/2⌋ = {d, b}: the stopped a, c, e are the worst three
    assert sorted(j for j in "abcde" if asha.is_paused(j)) == ["a", "c", "e"]


def test_asha_at_the_end_the_best_of_each_rung_goes_on_however_few_reached_it():
    # 3 jobs, eta = 2, rungs at 5 and 10 of 20 steps: ⌊3/2⌋ = 1 goes on from rung 5, ⌊1/2⌋ = 0 from rung 10 while
    # jobs may still report; once none can, each rung keeps max(1, ⌊n/2⌋): the sweep's best job trains to its end
    asha = Asha(min_steps=5, eta=2)
    for job, loss in [("j0", 3.0), ("j1", 2.5), ("j2", 2.0)]:
        asha.report(job, 5, loss)
    assert asha.promotable() == ("j2", 5)
    asha.promote("j2", 5)
    asha.report("j2", 10, 1.5)
    assert asha.promotable() is None and asha.promotable_at_end() == ("j2", 10)
    asha.promote("j2", 10)
    assert asha.promotable_at_end() is None  # rung 5's one place is j2's: j0 and j1 stop there
    assert sorted(j for j in ("j0", "j1", "j2") if asha.is_paused(j)) == ["j0", "j1"]
    assert asha.why_at_end(5) == "among the best 1 of the 3 job(s) there, no other job being left to report"


def test_the_live_table_reads_running_jobs_last_complete_record(tmp_path):
    state = SweepState(tmp_path)
    state.add_jobs([("j000", 0, "lr=0.001", 10), ("j001", 1, "lr=0.003", 10)])
    state.update("j000", status="running", slot=0)
    metrics = tmp_path / "jobs" / "j000" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    recs = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1000.0 + s} for s in (1, 2, 3)]
    recs[1]["eval_loss"] = 4.25  # (an earlier step's eval: the latest one shows, as no harvest recorded it)
    metrics.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 4, "lo')  # a line being written
    assert last_record(metrics) == recs[-1]
    out = io.StringIO()
    live = LiveTable(Console(file=out, force_terminal=True, width=120))
    live.tick(state.jobs(), tmp_path)
    live.close()
    text = out.getvalue()
    assert "3/10" in text and "4.7000" in text and "4.2500" in text and "1,003" in text and "0/10" in text


def test_retry_failed_gives_failed_jobs_their_retries_back_and_leaves_the_rest(tmp_path):
    state = SweepState(tmp_path)
    state.add_jobs([("j000", 0, "a", 10), ("j001", 1, "b", 10), ("j002", 2, "c", 10)])
    state.update("j000", status="done", step=10)
    state.update("j001", status="failed", attempts=2, reason="loss became nan at step 3", step=2)
    state.update("j002", status="failed", attempts=1, reason="worker died (SIGKILL)")
    assert state.reset_failed() == ["j001", "j002"]
    got = {r.id: (r.status, r.attempts, r.reason, r.step) for r in state.jobs()}
    assert got == {"j000": ("done", 0, "", 10), "j001": ("pending", 0, "", 2), "j002": ("pending", 0, "", 0)}
    assert state.reset_failed() == []
