"""ASHA as the sweep state records it: the rung bookkeeping rebuilt from the state database, and the stop rule at
a sweep's end — one rule for every scheduler (the runner's loop, and sharded-lrtf's worker and runner)."""

from __future__ import annotations

from collections.abc import Callable

from stratum.sweep.asha import Asha
from stratum.sweep.segment import result_values
from stratum.sweep.state import PAUSED, PENDING, STOPPED, SweepState


def asha_from_state(state: SweepState, *, min_steps: int, eta: int) -> Asha:
    """The rung results recorded so far; a job that reported at a rung and is no longer paused (or stopped)
    there was promoted from it."""
    asha = Asha(min_steps=min_steps, eta=eta)
    status = {j.id: (j.status, j.step) for j in state.jobs()}
    for job, step, metric in state.rungs():
        asha.report(job, step, metric)
        st, at = status[job]
        if not (st in (PAUSED, STOPPED) and at == step):
            asha.promote(job, step)
    return asha


def report_rung(state: SweepState, asha: Asha, job: str, rung: int, records: list[dict], start: int) -> float:
    """Record ``job``'s eval loss at ``rung`` from its metrics ``records`` (its segment from step ``start``) in
    ``asha`` and, with the job paused there, in the state (one transaction); the eval loss."""
    records = [r for r in records if r["step"] <= rung]  # (a killed run may have logged steps past it)
    metric = records[-1].get("eval_loss") if records else None
    if not records or records[-1]["step"] != rung or metric is None:  # _check_asha makes eval steps cover the rungs
        raise RuntimeError(f"{job}: no eval loss at rung {rung}")
    asha.report(job, rung, metric)
    state.add_rung(job, rung, metric, status=PAUSED, **result_values(records, start))
    return metric


def promote_at_end(state: SweepState, asha: Asha, say: Callable[[str], None]) -> str | None:
    """Nothing left to start or run: the next job a rung's final count promotes (:meth:`Asha.promotable_at_end`),
    made pending (it resumes from its checkpoint at the rung: sharded-lrtf's worker takes it so); its id, or None.
    """
    promo = asha.promotable_at_end()
    if promo is None:
        return None
    job, rung = promo
    asha.promote(job, rung)
    state.update(job, status=PENDING)
    say(f"{job}: promoted at step {rung} ({asha.why_at_end(rung)})")
    return job


def stop_paused(state: SweepState, asha: Asha, say: Callable[[str], None]) -> None:
    """Nothing left to run or promote: the jobs still paused at a rung were not among its best; they stop there."""
    for row in state.jobs():
        if row.status == PAUSED:
            n = len(asha.results.get(row.step, {}))
            state.update(row.id, status=STOPPED,
                         reason=f"asha: not in the best {asha.kept_at_end(n)} of {n} at step {row.step}")
            say(f"{row.id}: stopped at step {row.step} (asha)")
