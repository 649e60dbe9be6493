"""SIMULATED sweeps: the schedulers' choices over predicted job times, as a discrete-event simulation.

Nothing runs: each job takes exactly its predicted seconds. The runner's real makespan is checked against this
prediction (benchmarks/sweep_bench.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from stratum.sweep.schedulers import Policy


@dataclass(kw_only=True)
class SimResult:
    """A simulated sweep (SIMULATED: predicted times, not measurements)."""

    runs: dict[str, tuple[int, float, float]]
    """Job → (slot, start, end) in seconds."""
    makespan: float
    """End of the last job."""
    utilisation: float
    """Busy slot-seconds over slots × makespan."""


def simulate(seconds: dict[str, float], order: list[str], slots: int, policy: Policy) -> SimResult:
    """Run ``policy`` over jobs of known duration (``order``: sweep order) on ``slots`` identical slots."""
    pending = list(order)
    running: dict[int, tuple[str, float]] = {}
    runs: dict[str, tuple[int, float, float]] = {}
    now = 0.0
    while pending or running:
        for s in range(slots):
            if s not in running and pending:
                job = policy.pick(s, pending, running, now)
                if job is not None:
                    pending.remove(job)
                    running[s] = (job, now + seconds[job])
                    runs[job] = (s, now, now + seconds[job])
        if not running:
            raise RuntimeError(f"the policy left {len(pending)} job(s) unscheduled with every slot free")
        s_done = min(running, key=lambda s: (running[s][1], s))
        now = running.pop(s_done)[1]
    makespan = max((e for _, _, e in runs.values()), default=0.0)
    busy = sum(e - b for _, b, e in runs.values())
    return SimResult(runs=runs, makespan=makespan, utilisation=busy / (slots * makespan) if makespan else 0.0)
