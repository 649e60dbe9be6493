"""The shard worker's slots: which waiting job's shard task a freed slot takes, and what a waiting job holds on
its device.

A slot goes, at every shard-task boundary, to the waiting job with the longest remaining time
(:mod:`stratum.sweep.shard_lrtf`'s rule, applied to the real tasks' ends; ties to sweep order). A job's training
takes any device's slot for its first task and that device's slots from then on (its engine's pinned state,
buffers and streams live there). A job that yields its slot gives its device memory back first (its engine's
``turn.vacate``) unless the device has room for it to wait with it (:meth:`SlotScheduler._keeps`); the waiting job
a device's next freed slot goes to stages its next shard (``turn.stage_next``) and gives that back again once
another job overtakes it — so a device holds its running tasks' memory, one staged job's, and what its capacity
leaves room for. Every grant (slot, job, its task index, the waiting jobs' remaining seconds, the jobs' device
bytes), stage, give-back (bytes and seconds), kept wait and job end goes to the grant log
(``<sweep dir>/shard_tasks.jsonl``), from which :func:`task_seconds` reads each task's seconds on its slot.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from stratum.offload.tasks import Turn
from stratum.sweep.shard_lrtf import pick_longest

START_TIMEOUT_S = 600.0  # the jobs' threads all reach the scheduler within this (they only load their configs)


@dataclass(frozen=True)
class DeviceMemory:
    """What the give-back rule knows of the devices' memory (:meth:`SlotScheduler.acquire`)."""

    capacity: list[int | None]
    """Bytes each slot's device may hold for the jobs together (None: no limit — the CPU, whose "device" tier is
    RAM, so that a give-back there only copies)."""
    budget: int
    """Each job's device budget, bytes."""

    @property
    def limited(self) -> bool:
        """Some device's memory is limited: a waiting job there may have to give back."""
        return any(c is not None for c in self.capacity)


UNLIMITED = DeviceMemory(capacity=[], budget=0)
"""No device's memory limited: a waiting job keeps its device memory."""


class Stopped(KeyboardInterrupt):
    """The worker was asked to stop before the job's training started."""


@dataclass
class SlotScheduler:
    """Grants ``slots`` slots to waiting jobs, longest remaining time first (a job whose engine lives on a device
    among that device's slots); records every grant, stage and vacate."""

    slots: int
    order: list[str]
    tasks_path: Path
    devices: list[str] = field(default_factory=list)
    """Each slot's device; [] = none named (any job takes any slot)."""
    memory: DeviceMemory = UNLIMITED
    """Each slot's device's capacity (in slot order) and the jobs' budget: whether a waiting job gives back."""
    bound: dict[str, str] = field(default_factory=dict)
    """Job → the device its engine lives on, from its training's first grant to its end (or a rung): its engine's
    pinned state, buffers and streams stay there between its tasks, so it takes only that device's slots; a job
    not training takes any slot."""
    cond: threading.Condition = field(default_factory=threading.Condition)
    free: list[int] = field(default_factory=list)
    waiting: dict[str, float] = field(default_factory=dict)
    granted: dict[str, int] = field(default_factory=dict)
    done_tasks: dict[str, int] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    next_up: dict[str, str] = field(default_factory=dict)
    """Device → the waiting job its next freed slot goes to as things stand (its slots all busy): it stages its
    next shard."""
    staged: set[str] = field(default_factory=set)
    """Waiting jobs that have staged their next shard since their last grant (their slots' memory taken again)."""
    turns: dict[str, Turn] = field(default_factory=dict)
    """Job → its engine's turn while its training runs: what it holds on its device is in every grant's record."""
    stopping: bool = False
    opened: bool = False
    """Grants start once every job waits (all are ready at the start: the first grants compare them all)."""
    t0: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.free = list(range(self.slots))
        self.devices = self.devices or [""] * self.slots
        self._capacity = dict(zip(self.devices, self.memory.capacity))
        self._log = open(self.tasks_path, "a")

    def _fits(self, job: str, device: str) -> bool:
        """``job`` may take a slot of ``device``."""
        return self.bound.get(job, device) == device

    def _rivals(self, device: str) -> dict[str, float]:
        """The waiting jobs that may take a slot of ``device`` now, and their remaining seconds."""
        return {j: r for j, r in self.waiting.items() if self._fits(j, device) and not self._stops(j)}

    def acquire(self, job: str, remaining_s: float, turn: Turn | None = None) -> int:
        """Give back ``job``'s slot if it holds one, and wait for a slot for its next task (its remaining seconds
        ``remaining_s``) — in one step, so the job competes for the slot it frees; the slot's number. A job that
        will not keep its slot first gives its device memory back (``turn.vacate``) unless its device has room
        for it to wait with it (:meth:`_keeps`), so the next task there starts with it free; while it waits as its
        device's next in line it stages its next shard (``turn.stage_next``: its slots' memory taken again, its
        chunks moving while others compute), and gives it back (room again aside) once another job overtakes it
        — so a device holds its running tasks' memory, one staged job's, and what its capacity leaves room for."""
        remaining = round(remaining_s, 6)  # the rule compares what the log records: times equal to the
        # microsecond tie to sweep order (jobs with one profile differ only in float rounding of their tasks)
        if turn is not None:
            with self.cond:
                self.turns[job] = turn
                gives = self._yields(job, remaining) and not self._keeps(job, "keep")
            if gives:
                self._vacate(job, turn, "vacate")
        with self.cond:
            self._free(job)
            self.waiting[job] = remaining
            self._grant()
            self.cond.notify_all()  # open_when_waiting counts the waiting jobs
            # no time limit: under LRTF a short job may rightly wait for hours; every granted thread gives its
            # slot back in a finally, and a stop wakes every waiter
            while job not in self.granted and not self._stops(job):
                self.cond.wait_for(lambda: job in self.granted or self._stops(job) or self._stages(job)
                                   or self._unstages(job))
                if job in self.granted or self._stops(job):
                    break
                if self._stages(job):
                    self._stage(job, self.turns[job])
                else:
                    self._unstage(job, self.turns[job])
            if job not in self.granted:
                self.waiting.pop(job, None)
                raise Stopped()
            return self.granted[job]

    def _stops(self, job: str) -> bool:
        """The worker is stopping and ``job`` has not started its training (a started one goes on to the end of
        its step, which its trainer saves: :func:`stratum.train.stopping.set_stop_check`)."""
        return self.stopping and job not in self.turns

    def _yields(self, job: str, remaining: float) -> bool:
        """``job`` holds a slot that another waiting job would take from it now."""
        if job not in self.granted:
            return False
        rivals = self._rivals(self.devices[self.granted[job]])
        return bool(rivals) and pick_longest({**rivals, job: remaining}, self.order) != job

    def _keeps(self, job: str, why: str) -> bool:
        """``job``, about to wait, may keep its device memory (recorded under ``why`` with its bytes): its device's
        waiting jobs' bytes, its own, and its running and staged jobs at their budgets fit the device's capacity.
        So a device never holds more than its capacity, and no job has to give back later to make room: a
        running job stays under its budget, and a job that waits holding memory only leaves that set to run."""
        d = self.bound.get(job, "")
        cap = self._capacity.get(d)
        own = self.turns[job].device_bytes()
        if cap is not None:
            waiting = [t for j, t in self.turns.items() if j != job and self.bound.get(j) == d
                       and j not in self.granted and j not in self.staged]
            if sum(t.device_bytes() for t in waiting) + own + (self.devices.count(d) + 1) * self.memory.budget > cap:
                return False
        self._write({"job": job, why: own})
        return True

    def _stages(self, job: str) -> bool:
        d = self.bound.get(job)
        return (job in self.turns and d is not None and self.next_up.get(d) == job and job not in self.staged
                and not self.stopping
                and not any(self.bound.get(j) == d for j in self.staged))  # one staged job per device at a time

    def _unstages(self, job: str) -> bool:
        return job in self.staged and self.next_up.get(self.bound.get(job, "")) != job

    def _stage(self, job: str, turn: Turn) -> None:
        """Run ``job``'s stage outside the lock (called and returning with it held); record what it moved."""
        self.staged.add(job)
        task = self.done_tasks.get(job, 0)  # the task it stages for (it may be granted while staging)
        self.cond.release()
        try:
            chunks = turn.stage_next()
        finally:
            self.cond.acquire()
        self._write({"job": job, "stage": task, "chunks": chunks})

    def _unstage(self, job: str, turn: Turn) -> None:
        """A staged job overtaken by another: unless its device has room for it to keep it, its memory goes back
        (outside the lock, called and returning with it held) before the other may stage."""
        if not self._keeps(job, "unstage_keep"):
            self.cond.release()
            try:
                self._vacate(job, turn, "unstage")
            finally:
                self.cond.acquire()
        self.staged.discard(job)
        self.cond.notify_all()

    def give_back(self, job: str, turn: Turn) -> None:
        """``job`` gives its device memory back now, whatever the rule
        (:attr:`stratum.sweep.shard_worker.ShardJob.gives_back_every_task`)."""
        self._vacate(job, turn, "vacate")

    def _vacate(self, job: str, turn: Turn, why: str) -> None:
        t0 = time.monotonic()
        freed = turn.vacate()
        with self.cond:
            self._write({"job": job, why: freed, "s": round(time.monotonic() - t0, 6)})

    def finish(self, job: str) -> None:
        """``job``'s thread ends: its slot goes to the next waiting job (the end recorded, so the log tells each
        task's length)."""
        with self.cond:
            self.done.add(job)
            if job in self.granted:
                self._write({"slot": self.granted[job], "job": job, "end": True})
            self.cond.notify_all()
        self.release(job)

    def release(self, job: str) -> None:
        """``job`` ended a task and its training (to its end or a rung): its slot goes to the next waiting job."""
        with self.cond:
            self.turns.pop(job, None)  # (its engine is gone: it may start again on any device)
            self.bound.pop(job, None)
            self._free(job)
            self._grant()

    def _free(self, job: str) -> None:
        slot = self.granted.pop(job, None)
        if slot is not None:
            self.free.append(slot)
            self.free.sort()

    def open_when_waiting(self, n: int) -> None:
        """Start granting once ``n`` jobs wait (or have ended)."""
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.waiting) + len(self.done) >= n, START_TIMEOUT_S):
                raise RuntimeError(f"the jobs' threads did not start within {START_TIMEOUT_S:g} s")
            self.opened = True
            self._grant()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def _grant(self) -> None:
        if not self.opened:
            return
        for slot in list(self.free):
            if not (rivals := self._rivals(self.devices[slot])):
                continue
            job = pick_longest(rivals, self.order)
            self.free.remove(slot)
            self.bound.setdefault(job, self.devices[slot])
            record = {"slot": slot, "job": job, "task": self.done_tasks.get(job, 0), "remaining": rivals}
            if self.turns:
                record["device_bytes"] = {j: t.device_bytes() for j, t in self.turns.items()}
            self._write(record)
            del self.waiting[job]
            self.staged.discard(job)
            self.granted[job] = slot
            self.done_tasks[job] = self.done_tasks.get(job, 0) + 1
            self.cond.notify_all()
        up: dict[str, str] = {}
        for d in dict.fromkeys(self.devices):
            if rivals := self._rivals(d):
                up[d] = pick_longest(rivals, self.order)
        if up != self.next_up:
            self.next_up = up
            self.cond.notify_all()

    def _write(self, record: dict) -> None:
        self._log.write(json.dumps({"t": round(time.monotonic() - self.t0, 6), **record}) + "\n")
        self._log.flush()

    def close(self) -> None:
        self._log.close()


def task_seconds(tasks_path: Path) -> dict[str, list[float]]:
    """Each job's shard tasks' seconds holding a slot, in its chain's order, from a ``shard_tasks.jsonl``: from a
    grant to the next grant or job end on the same slot (a task still running at the log's end is left out)."""
    records = []
    for line in tasks_path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # (a blank line, or one a killed worker left half-written)
            continue
    out: dict[str, list[float]] = {}
    for i, r in enumerate(records):
        if r.get("end") or "slot" not in r:  # a job's end, or a stage
            continue
        nxt = next((h["t"] for h in records[i + 1:] if h.get("slot") == r["slot"]), None)
        if nxt is not None:
            out.setdefault(r["job"], []).append(max(0.0, nxt - r["t"]))
    return out
