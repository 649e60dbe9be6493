"""What became of the running segments: each one that ended, ran past sweep.job_timeout_s or stalled is
recorded in the state database — done, paused at an ASHA rung, pending (a time slice ended, or a signal stopped
it with a checkpoint) or failed with its reason (retried from its checkpoint while retries are left)."""

from __future__ import annotations

from pathlib import Path

from stratum.sweep.dispatch import ask_to_pause, paused_itself, record_pause, release, unique
from stratum.sweep.live import last_record
from stratum.sweep.segment import (
    INTERRUPTED_EXIT,
    PAUSE_FLAG,
    STOP_GRACE_S,
    Segment,
    checkpointed_values,
    diverged,
    failure_reason,
    segment_records,
    stop_segment,
)
from stratum.sweep.setup import Sweep
from stratum.sweep.state import DONE, FAILED, PAUSED, PENDING


def harvest(sweep: Sweep) -> None:
    """Record every segment that ended, ran past sweep.job_timeout_s or stalled, or paused itself at its slice's
    end; ask the others to pause at theirs where another job waits."""
    for seg in unique(sweep.running.values()):
        rc = seg.poll()
        if rc is None and paused_itself(sweep, seg):
            record_pause(sweep, seg)
            continue
        reason = _overdue(sweep, seg) if rc is None else None
        if rc is None and reason is None:
            continue
        release(sweep, seg)
        _record(sweep, seg, reason)
    ask_to_pause(sweep, unique(sweep.running.values()))
    for job, seg in list(sweep.resident.items()):
        if seg.poll() is not None:  # a paused worker was killed
            del sweep.resident[job]
            _record(sweep, seg, None)


def _overdue(sweep: Sweep, seg: Segment) -> str | None:
    """Stop a running segment past sweep.job_timeout_s (asked to checkpoint first) or without a new step for
    sweep.stall_timeout_s (killed: a hung worker answers no signal); the reason, or None if it may go on."""
    s = sweep.spec.settings
    rec = last_record(Path(sweep.configs[seg.job].train.out_dir) / "metrics.jsonl")
    step = rec["step"] if rec is not None else -1
    if step != seg.progress_step:
        seg.progress_step, seg.progress_run_s = step, seg.run_s()
    if s.job_timeout_s and seg.run_s() > s.job_timeout_s:
        stop_segment(seg, grace_s=STOP_GRACE_S)
        return f"timed out after {s.job_timeout_s:g} s (sweep.job_timeout_s)"
    if s.stall_timeout_s and seg.run_s() - seg.progress_run_s > s.stall_timeout_s:
        seg.worker.kill()
        seg.worker.join(STOP_GRACE_S)
        return f"no step for {s.stall_timeout_s:g} s: killed as hung (sweep.stall_timeout_s)"
    return None


def _record(sweep: Sweep, seg: Segment, forced_reason: str | None) -> None:
    sweep.state.update(seg.job, pid=None)
    out_dir = Path(sweep.configs[seg.job].train.out_dir)
    (out_dir / PAUSE_FLAG).unlink(missing_ok=True)
    row = sweep.state.job(seg.job)
    records = segment_records(sweep.configs[seg.job])
    run_s = row.run_s + seg.run_s()
    rc = seg.poll()
    reason = forced_reason or (failure_reason(rc, seg.log_path) if rc else diverged(records))  # (rc: it ended)
    last = _last_step(records)
    if reason is None and rc == 0 and last <= seg.start_step and last < row.steps:
        # not done, and relaunched it would end the same way, again and again (a job its worker finished just
        # before the sweep died is done, though this segment trained no step)
        reason = (f"the segment ended without training a step (at step {last} of {row.steps}); "
                  f"its log: {seg.log_path}")
    if rc == INTERRUPTED_EXIT and forced_reason is None:
        sweep.state.update(seg.job, status=PENDING, run_s=run_s, **checkpointed_values(out_dir, records))
        sweep.say(f"{seg.job}: stopped by a signal with a checkpoint; it resumes on the next run")
        return
    if reason is not None:
        attempts = row.attempts + 1
        retry = attempts <= sweep.spec.settings.retries
        # the job's progress is its last checkpoint's: the retry resumes from there, not from the failure
        sweep.state.update(seg.job, status=PENDING if retry else FAILED, attempts=attempts, reason=reason,
                           run_s=run_s, **checkpointed_values(out_dir, records))
        sweep.say(f"{seg.job}: failed: {reason}; " + (f"retry {attempts} of {sweep.spec.settings.retries} from "
                                                      "its last checkpoint" if retry else "no retries left"))
        return
    _record_success(sweep, seg, records, run_s)


def _record_success(sweep: Sweep, seg: Segment, records: list[dict], run_s: float) -> None:
    """The segment reached its stop: the job is done, at an ASHA rung, or at the end of a time slice."""
    row = sweep.state.job(seg.job)
    last = records[-1]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    seg_recs = [r["tokens_per_s"] for r in records if r["step"] > seg.start_step][1:] or [last["tokens_per_s"]]
    values = dict(step=last["step"], loss=last["loss"], eval_loss=evals[-1] if evals else None, run_s=run_s,
                  tokens_per_s=sorted(seg_recs)[len(seg_recs) // 2], reason="")
    if last["step"] >= row.steps:
        sweep.state.update(seg.job, status=DONE, **values)
        sweep.say(f"{seg.job}: done, loss {last['loss']:.4f}"
                  + (f", eval loss {evals[-1]:.4f}" if evals else ""))
        return
    rung = last["step"]
    if sweep.asha is None or sweep.asha.next_stop(seg.start_step, row.steps) != rung:  # a time slice ended
        sweep.state.update(seg.job, status=PENDING, **values)
        return
    if "eval_loss" not in last:
        raise RuntimeError(f"{seg.job}: no eval loss at rung {rung}")  # _check_asha makes eval steps cover rungs
    sweep.asha.report(seg.job, rung, last["eval_loss"])
    sweep.state.add_rung(seg.job, rung, last["eval_loss"], status=PAUSED, **values)
    sweep.say(f"{seg.job}: at rung {rung}, eval loss {last['eval_loss']:.4f}")


def _last_step(records: list[dict]) -> int:
    return records[-1]["step"] if records else 0

