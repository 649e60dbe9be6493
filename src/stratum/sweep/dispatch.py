"""Giving the free slots work: an ASHA promotion first, else the scheduler's starts — a new segment of a job on
its slot (or its k slots, for a strategy over several), or a paused worker continued — and pausing a worker
whose time slice is over (slice_by = pause)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from stratum.sweep.job_strategy import job_toml, pin, pinned, strategy_config, write_job_config
from stratum.sweep.live import last_record
from stratum.sweep.local import LocalWorker
from stratum.sweep.schedulers import Policy, Start
from stratum.sweep.segment import PAUSE_FLAG, Segment, checkpoint_step
from stratum.sweep.setup import Sweep, slot_devices
from stratum.sweep.spec import job_threads, plan_slots
from stratum.sweep.state import PENDING, RUNNING

Expect = Callable[[Start], float]
"""A start → its predicted seconds (the planned scheduler's busy-until for its slots)."""


def pending(sweep: Sweep) -> list[str]:
    return [j.id for j in sweep.state.jobs() if j.status == PENDING]


def unique(segments) -> list[Segment]:
    """Each segment once (a job over k slots sits on each of them), in slot order."""
    out: list[Segment] = []
    for seg in segments:
        if not any(seg is s for s in out):
            out.append(seg)
    return out


def fill(sweep: Sweep, policy: Policy, expect: Expect | None, now: float) -> None:
    """Start work on the free slots: ASHA promotions first (a promotion needing more slots than are free holds
    them until it has its slots), then the scheduler's starts."""
    free = [s for s in range(sweep.spec.settings.slots) if s not in sweep.running]
    while free and (promo := _next_promotion(sweep)) is not None:
        job_id, rung, why = promo
        plan = pinned(sweep.state, job_id) or "local"
        if plan_slots(plan) > len(free):
            return
        assert sweep.asha is not None  # (a promotion is ASHA's)
        sweep.asha.promote(job_id, rung)
        sweep.say(f"{job_id}: promoted at step {rung} ({why})")
        start = Start(job=job_id, slots=tuple(free[:plan_slots(plan)]), strategy=plan)
        launch(sweep, start, expect, now)
        free = free[len(start.slots):]
    if not free:
        return
    running = {sl: (seg.job, sweep.predicted_end.get(sl, now)) for sl, seg in sweep.running.items()}
    for start in policy.starts(free, pending(sweep), running, now):
        launch(sweep, start, expect, now)


def _next_promotion(sweep: Sweep) -> tuple[str, int, str] | None:
    """The next ASHA promotion (job, rung, why); once nothing runs and nothing is left to start, by the rungs'
    final counts (:meth:`~stratum.sweep.asha.Asha.promotable_at_end`)."""
    asha = sweep.asha
    if asha is None:
        return None
    if (promo := asha.promotable()) is not None:
        return *promo, f"among the best 1/{asha.eta} there"
    if sweep.running or pending(sweep) or (promo := asha.promotable_at_end()) is None:
        return None
    return *promo, asha.why_at_end(promo[1])


def launch(sweep: Sweep, start: Start, expect: Expect | None, now: float) -> None:
    """Run ``start``: continue its paused worker, or start a segment from its last checkpoint as its strategy
    (recorded at its first start, with its job.toml)."""
    if start.job in sweep.resident:
        _continue(sweep, start, expect, now)
        return
    if pinned(sweep.state, start.job) is None:
        _pin(sweep, start.job, start.strategy)
    row = sweep.state.job(start.job)
    out = Path(sweep.configs[start.job].train.out_dir)
    from_step = checkpoint_step(out)
    stop_at = _stop_at(sweep, from_step, row.steps)
    assert sweep.backend is not None  # (run_sweep starts one before it schedules)
    seg = sweep.backend.start(job=start.job, slots=start.slots, config_path=out / "job.toml", start_step=from_step,
                              stop_at=stop_at, devices=slot_devices(sweep, start.slots),
                              threads=job_threads(sweep.spec.settings), log_path=out / "worker.log",
                              slice_steps=_slice_steps(sweep))
    _occupy(sweep, start, seg, expect, now)
    sweep.state.update(start.job, status=RUNNING, slot=start.slots[0], pid=seg.worker.pid)
    seg.slice_from = from_step
    where = f"slot {start.slots[0]}" if len(start.slots) == 1 else f"slots {','.join(map(str, start.slots))}"
    sweep.say(f"{start.job}: started on {where} ({sweep.jobs[start.job].label})"
              + (f" as {start.strategy}" if start.strategy != "local" else "") + f", steps {from_step} → {stop_at}"
              + (f", attempt {row.attempts + 1}" if row.attempts else "")
              + (f", {expect(start):.4g} s predicted" + (f" to its end (step {row.steps})" if stop_at < row.steps
                                                         else "") if expect is not None else ""))


def _pin(sweep: Sweep, job_id: str, plan: str) -> None:
    """Record the job's strategy; over several slots its config becomes that plan's, and so does its job.toml."""
    if plan != "local":
        job = sweep.jobs[job_id]
        sweep.configs[job_id] = strategy_config(sweep.spec, job, sweep.configs[job_id], plan, sweep.dir)
        write_job_config(job_toml(sweep.dir, job), sweep.configs[job_id])
    pin(sweep.state, job_id, plan)


def _occupy(sweep: Sweep, start: Start, seg: Segment, expect: Expect | None, now: float) -> None:
    for slot in start.slots:
        sweep.running[slot] = seg
        if expect is not None:
            sweep.predicted_end[slot] = now + expect(start)


def _continue(sweep: Sweep, start: Start, expect: Expect | None, now: float) -> None:
    """Continue a paused worker on its slot (slice_by = pause): its state never left its memory."""
    job = start.job
    seg = sweep.resident.pop(job)
    seg.slot = start.slots[0]
    seg.slice_from = current_step(sweep, seg)
    assert seg.paused_at is not None  # (set by pause)
    seg.paused_s += time.monotonic() - seg.paused_at
    seg.paused_at = None
    (Path(sweep.configs[job].train.out_dir) / PAUSE_FLAG).unlink(missing_ok=True)  # (until the next poll asks)
    paused_worker(seg).resume()
    _occupy(sweep, start, seg, expect, now)
    sweep.state.update(job, status=RUNNING, slot=seg.slot)
    sweep.say(f"{job}: continued on slot {seg.slot} at step {seg.slice_from}")


def current_step(sweep: Sweep, seg: Segment) -> int:
    rec = last_record(Path(sweep.configs[seg.job].train.out_dir) / "metrics.jsonl")
    return rec["step"] if rec is not None else seg.start_step


def _stop_at(sweep: Sweep, step: int, steps: int) -> int:
    """Where a job's next segment ends: its end, its next ASHA rung or (slice_by = checkpoint) the end of a time
    slice, whichever first."""
    s = sweep.spec.settings
    stop = sweep.asha.next_stop(step, steps) if sweep.asha is not None else steps
    seg = s.segment_steps if s.slice_by == "checkpoint" else 0
    return min(stop, step + seg) if seg else stop


def _slice_steps(sweep: Sweep) -> int:
    """The steps of a time slice its worker stops itself after (slice_by = pause), or 0."""
    s = sweep.spec.settings
    return s.segment_steps if s.slice_by == "pause" else 0


def ask_to_pause(sweep: Sweep, segs: list[Segment]) -> None:
    """slice_by = pause: the flag that stops a running segment's worker at its next slice end is there exactly
    while another job waits for a slot (a pending job, or an ASHA promotion); the state read once for all."""
    if not _slice_steps(sweep) or not segs:
        return
    waiting = pending(sweep)
    promotion = sweep.asha is not None and sweep.asha.promotable() is not None
    for seg in segs:
        flag = Path(sweep.configs[seg.job].train.out_dir) / PAUSE_FLAG
        if promotion or any(j != seg.job for j in waiting):
            flag.touch()
        else:
            flag.unlink(missing_ok=True)


def paused_itself(sweep: Sweep, seg: Segment) -> bool:
    """``seg``'s worker stopped itself at a slice end (:class:`~stratum.sweep.segment.SliceGate`)."""
    return bool(_slice_steps(sweep)) and paused_worker(seg).stopped()


def paused_worker(seg: Segment) -> LocalWorker:
    """``seg``'s worker, which slice_by = pause stops and continues: a local process (spec.py refuses pause on
    another backend, and with strategies over several slots)."""
    assert isinstance(seg.worker, LocalWorker)
    return seg.worker


def record_pause(sweep: Sweep, seg: Segment) -> None:
    """``seg``'s worker stopped at its slice's end: its slot is free, its job pending with its state resident."""
    seg.paused_at = time.monotonic()
    release(sweep, seg)
    sweep.resident[seg.job] = seg
    step = current_step(sweep, seg)
    sweep.state.update(seg.job, status=PENDING, step=step)
    sweep.say(f"{seg.job}: paused at step {step}, its state kept in its worker's memory")


def release(sweep: Sweep, seg: Segment) -> None:
    """Free the slots ``seg`` holds."""
    for slot in [s for s, x in sweep.running.items() if x is seg]:
        del sweep.running[slot]
        sweep.predicted_end.pop(slot, None)
