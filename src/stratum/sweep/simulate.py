"""SIMULATED sweeps: the schedulers' choices over predicted step times, as a discrete-event simulation.

Nothing runs: each step of a job takes exactly its predicted seconds. Jobs run in segments of ``segment_steps``
(0 = whole jobs), as the real runner gives them out; the real runner's makespan is checked against this
prediction (benchmarks/sweep_bench.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from stratum.sweep.gang_plan import GangPlan
from stratum.sweep.schedulers import make_policy
from stratum.sweep.shard_lrtf import GiveBack, chain, makespan, sharded_lrtf


@dataclass(kw_only=True)
class SimResult:
    """A simulated sweep (SIMULATED: predicted times, not measurements)."""

    runs: list[tuple[float, int, str, float]]
    """Every segment as (start, slot, job, end) seconds, in start order."""
    makespan: float
    """End of the last segment."""
    utilisation: float
    """Busy slot-seconds over slots × makespan."""
    give_backs: int = 0
    """sharded-lrtf: the jobs' give-backs of their device memory."""


def plan_schedule(plan: GangPlan, slots: int) -> SimResult:
    """A makespan plan as a schedule on ``slots`` slots: its makespan is the prediction."""
    busy = sum((p.end - p.start) * len(p.slots) for p in plan.placed.values())
    runs = sorted((p.start, s, j, p.end) for j, p in plan.placed.items() for s in p.slots)
    return SimResult(runs=runs, makespan=plan.makespan, utilisation=busy / (slots * plan.makespan)
                     if plan.makespan else 0.0)


def simulate(scheduler: str, steps: dict[str, int], step_s: dict[str, float], *, slots: int,
             segment_steps: int = 0, time_limit_s: float = 10.0, gap: float = 0.0) -> SimResult:
    """Run ``scheduler`` over jobs (in sweep order: ``steps``' order) on ``slots`` identical slots."""
    remaining = dict(steps)
    policy = make_policy(scheduler, predict=lambda j: {"plain": remaining[j] * step_s[j]}, slots=slots,
                         time_limit_s=time_limit_s, gap=gap)
    pending = [j for j in steps if remaining[j] > 0]
    running: dict[int, tuple[str, float]] = {}
    runs: list[tuple[float, int, str, float]] = []
    now = 0.0
    while pending or running:
        free = [s for s in range(slots) if s not in running]
        for start in policy.starts(free, pending, running, now) if free and pending else []:
            job, (s,) = start.job, start.slots  # (one slot each: every strategy here is the job's step time)
            n = min(segment_steps or remaining[job], remaining[job])
            pending.remove(job)
            running[s] = (job, now + n * step_s[job])
            runs.append((now, s, job, now + n * step_s[job]))
            remaining[job] -= n
        if not running:
            raise RuntimeError(f"the policy left {len(pending)} job(s) unscheduled with every slot free")
        now = min(end for _, end in running.values())
        for s in [s for s, (_, end) in running.items() if end == now]:  # every segment ending now, then picks
            job = running.pop(s)[0]
            if remaining[job] > 0:
                pending.append(job)
                pending.sort(key=list(steps).index)
    makespan = max((e for *_, e in runs), default=0.0)
    busy = sum(e - b for b, _, _, e in runs)
    return SimResult(runs=runs, makespan=makespan, utilisation=busy / (slots * makespan) if makespan else 0.0)


def simulate_sharded(steps: dict[str, int], step_s: dict[str, float], tasks: dict[str, int], *,
                     slots: int, give_back: GiveBack | None = None) -> SimResult:
    """sharded-lrtf over jobs of ``tasks[j]`` shard tasks per step, each ``step_s[j] / tasks[j]`` seconds
    (:func:`stratum.sweep.shard_lrtf.sharded_lrtf`, with ``give_back`` its give-backs); runs are the tasks."""
    chains = {j: chain(n, tasks[j], step_s[j] / tasks[j]) for j, n in steps.items()}
    placed = sharded_lrtf(chains, slots, give_back)
    runs = [(t.start, t.slot, t.job, t.end) for t in placed]
    span = makespan(placed)
    busy = sum(t.end - t.start for t in placed)
    return SimResult(runs=runs, makespan=span, utilisation=busy / (slots * span) if span else 0.0,
                     give_backs=sum(t.gives_back for t in placed))
