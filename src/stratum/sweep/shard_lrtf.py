"""Hydra's Sharded-LRTF rule over chains of shard tasks: a freed slot takes the ready task of the job with the
longest remaining time.

A job is a chain of shard tasks (a group of blocks' forward, then the groups' backwards, micro-batch after
micro-batch, step after step); its next task is ready when its previous one has ended, on whichever slot. When a
slot frees, it takes the ready task of the job whose remaining tasks add up to the longest time (ties: sweep
order); with no ready task it idles until a task ends. :func:`sharded_lrtf` plays the rule out on predicted task
times — the simulator's schedule, and the order the real scheduler (:mod:`stratum.sweep.shard_worker`) applies to
measured ends — and :func:`task_table` prints it. Given a :class:`GiveBack`, a job that yields its slot to another
gives its device memory back first unless the device has room for it to wait with it (the worker's rule), and that
costs the slot the job's give-back seconds before the next task starts there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True, kw_only=True)
class ShardTask:
    """One shard task as scheduled."""

    job: str
    """Its job."""
    index: int
    """Its place in the job's chain (0-based)."""
    slot: int
    """The slot that runs it."""
    start: float
    """Its start (seconds from the schedule's start)."""
    end: float
    """Its end."""
    gives_back: bool = False
    """Its job gave its device memory back after it, holding the slot (:class:`GiveBack`)."""


@dataclass(frozen=True, kw_only=True)
class GiveBack:
    """What giving the device back costs, and when a yielding job must (the worker's rule,
    :meth:`stratum.sweep.slot_scheduler.SlotScheduler._keeps`, with every waiting job holding its whole budget)."""

    seconds: dict[str, float]
    """Job → seconds one give-back adds to its time on slots (its device memory out, and back for its next task)."""
    capacity: int | None
    """Bytes the slots' device may hold for the jobs together (None: no limit, nobody gives back)."""
    budget: int
    """Each job's device budget, bytes."""

    def keeps(self, waiting_holders: int, slots: int) -> bool:
        """A job about to wait may keep its memory beside ``waiting_holders`` waiting jobs that kept theirs: they,
        it, and the running and staged jobs at their budgets fit the capacity."""
        return self.capacity is None or (waiting_holders + 1 + slots + 1) * self.budget <= self.capacity


def pick_longest(remaining: dict[str, float], order: list[str]) -> str:
    """The job with the longest remaining time among ``remaining`` (ties: first in ``order``)."""
    return max(remaining, key=lambda j: (remaining[j], -order.index(j)))


def sharded_lrtf(chains: dict[str, list[float]], slots: int, give_back: GiveBack | None = None) -> list[ShardTask]:
    """Every task of ``chains`` (job → its tasks' times, in chain order; jobs in sweep order) placed on ``slots``
    identical slots by the rule, in start order (simultaneous starts: lower slot first); with ``give_back``, a
    yielding job's give-back holds its slot first (the module docstring)."""
    if slots < 1:
        raise ValueError("slots must be ≥ 1")
    order = list(chains)
    nxt = {j: 0 for j in order}
    left = {j: sum(ts) for j, ts in chains.items()}
    ready_at = {j: 0.0 for j in order}
    free_at = [0.0] * slots
    last: list[int | None] = [None] * slots  # where in ``out`` a slot's last task is, until it takes another job's
    holders: set[str] = set()  # waiting jobs that kept their device memory
    out: list[ShardTask] = []
    while any(nxt[j] < len(chains[j]) for j in order):
        now = min(free_at)
        ready = {j: left[j] for j in order if nxt[j] < len(chains[j]) and ready_at[j] <= now}
        if not ready:  # every slot that is free waits for a running task to end
            later = [ready_at[j] for j in order if nxt[j] < len(chains[j])]
            free_at = [max(t, min(later)) for t in free_at]
            continue
        slot = free_at.index(now)
        job = pick_longest(ready, order)
        i, last[slot] = last[slot], None
        was = out[i].job if i is not None else None
        if was is not None and was != job and nxt[was] < len(chains[was]) and give_back is not None:
            if not give_back.keeps(len(holders - {job}), slots):  # it yields and gives back, holding the slot
                free_at[slot] = ready_at[was] = now + give_back.seconds.get(was, 0.0)
                assert i is not None
                out[i] = replace(out[i], gives_back=True)
                continue
            holders.add(was)
        holders.discard(job)
        dur = chains[job][nxt[job]]
        last[slot] = len(out)
        out.append(ShardTask(job=job, index=nxt[job], slot=slot, start=now, end=now + dur))
        nxt[job] += 1
        left[job] -= dur
        ready_at[job] = now + dur
        free_at[slot] = now + dur
    return out


def makespan(tasks: list[ShardTask]) -> float:
    return max((t.end for t in tasks), default=0.0)


def task_table(tasks: list[ShardTask]) -> str:
    """One line per task: start, end, slot, job and its task index."""
    rows = [f"{'start':>8} {'end':>8} {'slot':>4}  task"]
    rows += [f"{t.start:8.3g} {t.end:8.3g} {t.slot:4d}  {t.job}[{t.index}]" + (" gives back" if t.gives_back else "")
             for t in tasks]
    return "\n".join(rows)


def chain(steps: int, tasks_per_step: int, task_s: float) -> list[float]:
    """A job's chain: ``steps`` steps of ``tasks_per_step`` tasks of ``task_s`` seconds."""
    return [task_s] * (steps * tasks_per_step)


def tasks_per_step(blocks: int, shard_blocks: int, micro_batches: int) -> int:
    """Shard tasks of one optimizer step: the forward and the backward of every group of ``shard_blocks`` blocks,
    for every micro-batch."""
    return 2 * math.ceil(blocks / shard_blocks) * micro_batches
