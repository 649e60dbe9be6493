"""ASHA (asynchronous successive halving): stop the worst jobs at rungs, on the eval loss.

A job runs to its first rung (``sweep.asha_min_steps``) and pauses there with a checkpoint. A job at rung ``r``
is promoted (resumed to the next rung, or to its end past the last rung) once it is among the best
``⌊n/eta⌋`` of the ``n`` jobs that have reported at ``r`` and has not been promoted yet; a free slot takes a
promotion before it starts a new job, from the highest rung down. When no job is left to start or run, no rung
can get another report, and each rung's best ``max(1, ⌊n/eta⌋)`` go on (the best job of a rung fewer than eta
jobs reached, successive halving's last survivor, trains to its end rather than stopping there); then the jobs
still paused are stopped: they were not among their rung's best.
"""

from __future__ import annotations

from collections.abc import Callable
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
        return self._first_unpromoted(lambda n: n // self.eta)

    def promotable_at_end(self) -> tuple[str, int] | None:
        """As :meth:`promotable` once no job is left to start or run: every rung's count is final, and its best
        max(1, ⌊n/eta⌋) go on."""
        return self._first_unpromoted(self.kept_at_end)

    def kept_at_end(self, n: int) -> int:
        """How many of the ``n`` jobs that reported at a rung go on from it when the sweep has nothing else to run."""
        return max(1, n // self.eta)

    def why_at_end(self, rung: int) -> str:
        """Why :meth:`promotable_at_end` promoted a job from ``rung``, in words."""
        n = len(self.results[rung])
        return f"among the best {self.kept_at_end(n)} of the {n} job(s) there, no other job being left to report"

    def _first_unpromoted(self, quota: Callable[[int], int]) -> tuple[str, int] | None:
        for rung in sorted(self.results, reverse=True):
            res = self.results[rung]
            for job in sorted(res, key=lambda j: (res[j], j))[: quota(len(res))]:
                if job not in self.promoted.get(rung, set()):
                    return job, rung
        return None

    def promote(self, job: str, rung: int) -> None:
        self.promoted.setdefault(rung, set()).add(job)

    def is_paused(self, job: str) -> bool:
        """Reported at its last rung and not promoted from it."""
        rungs = [r for r, res in self.results.items() if job in res]
        return bool(rungs) and job not in self.promoted.get(max(rungs), set())
