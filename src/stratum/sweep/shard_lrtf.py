"""Hydra's Sharded-LRTF rule over chains of shard tasks: a freed slot takes the ready task of the job with the
longest remaining time.

A job is a chain of shard tasks (a group of blocks' forward, then the groups' backwards, micro-batch after
micro-batch, step after step); its next task is ready when its previous one has ended, on whichever slot. When a
slot frees, it takes the ready task of the job whose remaining tasks add up to the longest time (ties: sweep
order); with no ready task it idles until a task ends. :func:`sharded_lrtf` plays the rule out on predicted task
times — the simulator's schedule, and the order the real scheduler (:mod:`stratum.sweep.shard_worker`) applies to
measured ends — and :func:`task_table` prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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


def pick_longest(remaining: dict[str, float], order: list[str]) -> str:
    """The job with the longest remaining time among ``remaining`` (ties: first in ``order``)."""
    return max(remaining, key=lambda j: (remaining[j], -order.index(j)))


def sharded_lrtf(chains: dict[str, list[float]], slots: int) -> list[ShardTask]:
    """Every task of ``chains`` (job → its tasks' times, in chain order; jobs in sweep order) placed on ``slots``
    identical slots by the rule, in start order (simultaneous starts: lower slot first)."""
    if slots < 1:
        raise ValueError("slots must be ≥ 1")
    order = list(chains)
    nxt = {j: 0 for j in order}
    left = {j: sum(ts) for j, ts in chains.items()}
    ready_at = {j: 0.0 for j in order}
    free_at = [0.0] * slots
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
        dur = chains[job][nxt[job]]
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
    rows += [f"{t.start:8.3g} {t.end:8.3g} {t.slot:4d}  {t.job}[{t.index}]" for t in tasks]
    return "\n".join(rows)


def chain(steps: int, tasks_per_step: int, task_s: float) -> list[float]:
    """A job's chain: ``steps`` steps of ``tasks_per_step`` tasks of ``task_s`` seconds."""
    return [task_s] * (steps * tasks_per_step)


def tasks_per_step(blocks: int, shard_blocks: int, micro_batches: int) -> int:
    """Shard tasks of one optimizer step: the forward and the backward of every group of ``shard_blocks`` blocks,
    for every micro-batch."""
    return 2 * math.ceil(blocks / shard_blocks) * micro_batches
