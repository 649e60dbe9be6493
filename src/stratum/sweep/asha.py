"""ASHA (asynchronous successive halving): stop the worst jobs at rungs, on the eval loss.

A job runs to its first rung (``sweep.asha_min_steps``) and pauses there with a checkpoint. A job at rung ``r``
is promoted (resumed to the next rung, or to its end past the last rung) once it is among the best
``⌊n/eta⌋`` of the ``n`` jobs that have reported at ``r`` and has not been promoted yet; a free slot takes a
promotion before it starts a new job, from the highest rung down. When no job is left to start or run, the
paused jobs are stopped: they were never in the top 1/eta of their rung.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def rung_steps(min_steps: int, eta: int, steps: int) -> list[int]:
    """The rungs of a job of ``steps`` steps: min_steps·eta^k, below ``steps``."""
    rungs, r = [], min_steps
    while r < steps:
        rungs.append(r)
        r *= eta
    return rungs


@dataclass(kw_only=True)
class Asha:
    """The rung bookkeeping; pure (the runner persists every report in the sweep state)."""

    min_steps: int
    """The first rung, in steps."""
    eta: int
    """Reduction factor: the best 1/eta of a rung go on."""
    results: dict[int, dict[str, float]] = field(default_factory=dict)
    """Rung step → job → its eval loss there."""
    promoted: dict[int, set[str]] = field(default_factory=dict)
    """Rung step → the jobs promoted from it."""

    def next_stop(self, step: int, steps: int) -> int:
        """Where a job at ``step`` runs to next: its next rung, or its end."""
        return next((r for r in rung_steps(self.min_steps, self.eta, steps) if r > step), steps)

    def report(self, job: str, rung: int, metric: float) -> None:
        self.results.setdefault(rung, {})[job] = metric

    def promotable(self) -> tuple[str, int] | None:
        """The best job that may go on from the highest rung that has one, or None."""
        for rung in sorted(self.results, reverse=True):
            res = self.results[rung]
            top = sorted(res, key=lambda j: (res[j], j))[: len(res) // self.eta]
            for job in top:
                if job not in self.promoted.get(rung, set()):
                    return job, rung
        return None

    def promote(self, job: str, rung: int) -> None:
        self.promoted.setdefault(rung, set()).add(job)

    def is_paused(self, job: str) -> bool:
        """Reported at its last rung and not promoted from it."""
        rungs = [r for r, res in self.results.items() if job in res]
        return bool(rungs) and job not in self.promoted.get(max(rungs), set())
