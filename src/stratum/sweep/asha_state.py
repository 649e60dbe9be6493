"""ASHA as the sweep state records it: the rung bookkeeping rebuilt from the state database, and the stop rule at
a sweep's end — one rule for every scheduler (the runner's loop, and sharded-lrtf's worker and runner)."""

from __future__ import annotations

from collections.abc import Callable

from stratum.sweep.asha import Asha
from stratum.sweep.segment import result_values
from stratum.sweep.state import PAUSED, STOPPED, SweepState


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


def stop_paused(state: SweepState, eta: int, say: Callable[[str], None]) -> None:
    """Nothing left to run: the jobs still paused at a rung were never among its best; they stop there."""
    for row in state.jobs():
        if row.status == PAUSED:
            state.update(row.id, status=STOPPED, reason=f"asha: not in the best 1/{eta} at step {row.step}")
            say(f"{row.id}: stopped at step {row.step} (asha)")
