"""ASHA inside the sharded-lrtf worker, asynchronous as under the other schedulers: a job's thread that reaches a
rung reports its eval loss and gives its slot back; it goes on once a report (its own or a later one) promotes
it, competing for slots by the LRTF rule again; when no job of the worker is left running or waiting for a slot,
the jobs still at their rungs end their threads there.

Every report and promotion is written to the sweep state at once, as the runner's loop writes them for the other
schedulers (a report: the rung's metric and the job paused, one transaction; a promotion: the job running), so
``stratum sweep status``, results.csv and a resumed sweep see the same. The stop of the jobs left paused is the
runner's, once no job is left to run (:func:`stratum.sweep.asha_state.stop_paused`): a job retried in a later
worker may still promote one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stratum.sweep.asha import Asha
from stratum.sweep.asha_state import asha_from_state, report_rung
from stratum.sweep.state import PAUSED, RUNNING, SweepState


@dataclass
class RungBoard:
    """The worker's rung bookkeeping (the sweep's :class:`Asha`) and its jobs' threads at rungs."""

    asha: Asha
    state: SweepState
    say: Callable[[str], None]
    active: set[str]
    """Jobs running or waiting for a slot."""
    paused: set[str]
    """Jobs at a rung, waiting for a promotion."""
    ending: bool = False
    """No job is active (or the worker stops): the paused ones wait no longer."""
    cond: threading.Condition = field(default_factory=threading.Condition)

    @classmethod
    def open(cls, sweep_dir: Path, jobs: list[str], *, min_steps: int, eta: int,
             say: Callable[[str], None]) -> RungBoard:
        """The board of a worker given ``jobs``: those recorded as paused wait at their rungs (promoted at once
        where the recorded reports allow)."""
        state = SweepState(sweep_dir)
        paused = {row.id for row in state.jobs() if row.id in jobs and row.status == PAUSED}
        board = cls(asha_from_state(state, min_steps=min_steps, eta=eta), state, say, active=set(jobs) - paused,
                    paused=paused)
        with board.cond:
            board._promote()
            board._check_end()
        return board

    def next_stop(self, step: int, steps: int) -> int:
        return self.asha.next_stop(step, steps)

    def waits(self, job: str) -> bool:
        """Whether ``job`` waits at a rung (the worker's start: its recorded status)."""
        with self.cond:
            return job in self.paused

    def promoted(self, job: str) -> bool:
        """Wait until ``job`` (at a rung) is promoted (True) or the worker ends with it there (False)."""
        with self.cond:
            self.cond.wait_for(lambda: job not in self.paused or self.ending)
            return job not in self.paused

    def at_rung(self, job: str, rung: int, records: list[dict], start: int) -> bool:
        """``job`` reached ``rung`` (its metrics ``records``, its segment from step ``start``): record its eval
        loss there, then wait as :meth:`promoted`."""
        with self.cond:
            metric = report_rung(self.state, self.asha, job, rung, records, start)
            self.say(f"{job}: at rung {rung}, eval loss {metric:.4f}")
            self.active.discard(job)
            self.paused.add(job)
            self._promote()
            self._check_end()
        return self.promoted(job)

    def finish(self, job: str) -> None:
        """``job``'s thread ends (done, failed or stopped)."""
        with self.cond:
            self.active.discard(job)
            self._check_end()

    def stop(self) -> None:
        with self.cond:
            self.ending = True
            self.cond.notify_all()

    def _promote(self) -> None:
        while (promo := self.asha.promotable()) is not None:
            job, rung = promo
            self.asha.promote(job, rung)
            if job not in self.paused:  # stopped in an earlier sweep run, or not this worker's
                continue
            self.paused.discard(job)
            self.active.add(job)
            self.state.update(job, status=RUNNING)
            self.say(f"{job}: promoted at step {rung} (among the best 1/{self.asha.eta} there)")
            self.cond.notify_all()

    def _check_end(self) -> None:
        if not self.active:
            self.ending = True
            self.cond.notify_all()

    def close(self) -> None:
        self.state.close()
