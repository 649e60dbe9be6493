"""The makespan a sweep is predicted to take before it runs (SIMULATED), put beside the measured one at its end.

The prediction replays the sweep's own scheduler over the jobs that remain, on the simulators the benchmarks
check (:mod:`stratum.sweep.simulate`), from the same predicted job times the scheduler orders by (calibrated where
``sweep.calibration`` is set, else the profiles scaled as :func:`stratum.sweep.predict.make_predict` says): fifo
and lrtf one job (or lrtf slice) per slot, planned its makespan plan over each job's strategies, sharded-lrtf
every job's chain of shard tasks with the give-backs its devices' memory forces (each at its shape's calibrated
cost; with slots on several devices the give-backs are not predicted); lrtf's slices that end with a checkpoint
each pay the job's calibrated restart (a worker's start, the checkpoint loaded and the next one saved). Jobs ASHA
may stop are predicted to their ends, so under ASHA it is an upper bound. ``makespan.json`` in the sweep
directory keeps both figures.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stratum.atomic import atomic_write_text
from stratum.config import Config
from stratum.profile.profile import Profile
from stratum.sweep.gang import plan_jobs
from stratum.sweep.gang_plan import GangPlan, Option
from stratum.sweep.predict import give_back_s, job_seconds
from stratum.sweep.results import MAKESPAN_FILE
from stratum.sweep.setup import Sweep, sweep_profiles
from stratum.sweep.shape_cost import ShapeCalibration, shape_key
from stratum.sweep.shard_lrtf import GiveBack, tasks_per_step
from stratum.sweep.shard_run import device_memory
from stratum.sweep.shard_size import job_shard_blocks
from stratum.sweep.simulate import SimResult, plan_schedule, simulate, simulate_sharded
from stratum.sweep.slot_scheduler import DeviceMemory
from stratum.sweep.state import PAUSED, PENDING


@dataclass(frozen=True, kw_only=True)
class Predicted:
    """A sweep's predicted makespan (SIMULATED)."""

    sim: SimResult
    """The simulated schedule of what remains."""
    source: str
    """What the job times come from: "calibrated" or "profiles"."""
    plan: tuple[GangPlan, list[str]] | None = None
    """planned: its plan and the jobs it is over (sweep order), which the policy starts from."""

    def line(self) -> str:
        gives = f", {self.sim.give_backs} give-backs" if self.sim.give_backs else ""
        what = "calibrated job times" if self.source == "calibrated" else (
            "profiled job times (no sweep.calibration: it comes out short)")
        return f"predicted makespan: {self.sim.makespan:.1f} s (SIMULATED from {what}{gives})"


def predicted_makespan(sweep: Sweep, predict: Callable[[str], dict[str, float]],
                       options: Callable[[str], dict[str, Option]] | None) -> Predicted | None:
    """The sweep's scheduler replayed over its remaining jobs' predicted times (``options``: planned's strategies
    per job); None when no job is left to run."""
    s = sweep.spec.settings
    steps = {r.id: r.steps - r.step for r in sweep.state.jobs() if r.status in (PENDING, PAUSED) and r.steps > r.step}
    if not steps:
        return None
    step_s = {j: min(predict(j).values()) / n for j, n in steps.items()}
    if s.scheduler == "lrtf" and s.slice_by == "checkpoint" and sweep.calibration is not None:
        cal, profiles = sweep.calibration, sweep_profiles(sweep)
        step_s = {j: t + _restarts_s(cal, profiles[j], sweep.configs[j], steps[j], s.segment_steps) / steps[j]
                  for j, t in step_s.items()}
    source = "calibrated" if sweep.calibration is not None else "profiles"
    if s.scheduler == "planned" and options is not None:
        plan = plan_jobs({j: options(j) for j in steps}, [0.0] * s.slots, time_limit_s=s.plan_time_limit_s,
                         gap=s.plan_gap)
        return Predicted(sim=plan_schedule(plan, s.slots), source=source, plan=(plan, list(steps)))
    if s.scheduler == "sharded-lrtf":
        sim = _sharded(sweep, steps, step_s)
    else:
        sim = simulate(s.scheduler, steps, step_s, slots=s.slots,
                       segment_steps=s.segment_steps if s.scheduler == "lrtf" else 0,
                       time_limit_s=s.plan_time_limit_s, gap=s.plan_gap)
    return Predicted(sim=sim, source=source)


def _restarts_s(cal: ShapeCalibration, profile: Profile, cfg: Config, steps: int, slice_steps: int) -> float:
    """What a job's ``steps`` in time slices of ``slice_steps`` that end with a checkpoint add to its predicted
    time: each slice after its first starts a worker, builds the job, loads its checkpoint and saves the next one —
    its shape's calibrated restart (else its fixed part again)."""
    if slice_steps <= 0:
        return 0.0
    restart = cal.restart.get(shape_key(cfg))
    return (-(-steps // slice_steps) - 1) * (restart if restart is not None else job_seconds(profile, cfg, 0, cal))


def _sharded(sweep: Sweep, steps: dict[str, int], step_s: dict[str, float]) -> SimResult:
    s, profiles = sweep.spec.settings, sweep_profiles(sweep)
    configs = {j: sweep.configs[j] for j in steps}
    tasks = {j: tasks_per_step(len(profiles[j].blocks), job_shard_blocks(profiles[j], c, s.shard_blocks),
                               c.micro_batches_per_step) for j, c in configs.items()}
    cal = sweep.calibration
    seconds = {j: give_back_s(profiles[j], c, cal) if cal is not None else 0.0 for j, c in configs.items()}
    return simulate_sharded(steps, step_s, tasks, slots=s.slots,
                            give_back=give_back(device_memory(s, next(iter(configs.values()))), seconds))


def give_back(memory: DeviceMemory, seconds: dict[str, float]) -> GiveBack | None:
    """The simulator's give-back rule for slots of one device (None: slots on several devices, whose give-backs
    it does not play out)."""
    if len(set(memory.capacity)) > 1:
        return None
    return GiveBack(seconds=seconds, capacity=memory.capacity[0] if memory.capacity else None, budget=memory.budget)


def plan_sim(options: dict[str, dict[str, Option]], slots: int, time_limit_s: float) -> SimResult:
    """planned's plan (:func:`stratum.sweep.gang.plan_jobs`) over the jobs' strategies on ``slots`` free slots, as
    a schedule (:func:`stratum.sweep.simulate.plan_schedule`)."""
    return plan_schedule(plan_jobs(options, [0.0] * slots, time_limit_s=time_limit_s), slots)


def write_makespan(sweep_dir: Path, *, scheduler: str, predicted: Predicted | None,
                   measured_s: float | None) -> dict:
    """``makespan.json`` (atomically): the prediction, and the measured makespan once there is one; its document."""
    doc: dict = {"scheduler": scheduler, "measured_s": measured_s}
    if predicted is not None:
        doc |= {"predicted_s": predicted.sim.makespan, "predicted_from": predicted.source,
                "predicted_give_backs": predicted.sim.give_backs,
                "note": "predicted_s is SIMULATED: the scheduler replayed over the jobs' predicted times"}
    atomic_write_text(sweep_dir / MAKESPAN_FILE, json.dumps(doc, indent=1) + "\n")
    return doc
