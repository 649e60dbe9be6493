"""What the schedulers know of a job before it runs: its profile (per-block forward and backward times and
bytes, measured once per distinct model shape), its memory need, and its predicted remaining time — from the
profile, then from its own measured step times once it has run."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from stratum.atomic import atomic_write_text
from stratum.config import Config
from stratum.data.corpus import resolve_corpus
from stratum.data.prepare import make_tokenizer
from stratum.model.build import build_model
from stratum.offload.placement import Placement
from stratum.offload.setup import placement_for
from stratum.profile.profile import Profile
from stratum.profile.profiler import profile_from_config
from stratum.runtime.device import resolve_device
from stratum.sweep.segment import segment_records
from stratum.sweep.shape_cost import SHARDED, ShapeCalibration, shape_key
from stratum.sweep.state import SweepState
from stratum.train.metrics import median


def memory_need(profile: Profile) -> int:
    """Bytes a plain run holds on its device: training state (parameters, gradients, AdamW moments) and one
    micro-batch's saved activations."""
    return profile.train_state_bytes + profile.act_saved_bytes


def job_profiles(configs: dict[str, Config], *, threads: int, cache_dir: Path | None) -> dict[str, Profile]:
    """One profile per distinct (model, micro-batch, seq_len, precision, device) of the jobs, measured with the
    workers' thread count; kept in ``cache_dir`` if given (a resumed sweep plans with the same numbers)."""
    out: dict[str, Profile] = {}
    by_key: dict[str, Profile] = {}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for job_id, cfg in configs.items():
            key = json.dumps([cfg.to_dict()["model"], cfg.train.micro_batch_size, cfg.data.seq_len,
                              cfg.train.precision, cfg.train.device], sort_keys=True)
            if key not in by_key:
                by_key[key] = _cached_profile(cfg, key, cache_dir / f"p{len(by_key):03d}.json" if cache_dir else None)
            out[job_id] = by_key[key]
    finally:
        torch.set_num_threads(threads_before)
    return out


def _cached_profile(cfg: Config, key: str, path: Path | None) -> Profile:
    if path is not None and path.exists():
        doc = json.loads(path.read_text())
        if doc.get("key") == key:
            return Profile.from_dict(doc["profile"])
    prof = profile_from_config(cfg, runs=1)
    if path is not None:
        atomic_write_text(path, json.dumps({"key": key, "profile": prof.to_dict()}))
    return prof


def predicted_seconds(profile: Profile, cfg: Config, steps: int) -> float:
    """Compute time of ``steps`` optimizer steps from the profile: forward + backward of every micro-batch (no
    process start-up, data or optimizer time: a lower bound that orders jobs correctly)."""
    return profile.step_s * cfg.micro_batches_per_step * steps


def offload_placement(cfg: Config, profile: Profile) -> Placement:
    """The offload engine's plan for ``cfg`` at its ``offload`` budgets from ``profile`` (compute, recompute, chunk
    copies at this machine's measured bandwidths), a one-line StratumError naming the smallest budget that works
    where none fits; the model is built on the meta device (no memory)."""
    tok = make_tokenizer(cfg, resolve_corpus(cfg.data.corpus))
    model = build_model(cfg.model, tokenizer_vocab=tok.vocab_size, seq_len=cfg.data.seq_len, seed=cfg.train.seed,
                        device="meta")
    return placement_for(cfg, model, resolve_device(cfg.train.device), profile=profile)


def offload_step_s(cfg: Config, profile: Profile) -> float:
    """Seconds of one optimizer step of ``cfg`` under the offload engine, as its planner predicts them
    (:func:`offload_placement`)."""
    return offload_placement(cfg, profile).predicted_step_s


def line_step_s(profile: Profile, cfg: Config, cal: ShapeCalibration) -> float:
    """The step the calibration's line is against: the offload plan's predicted step (sharded-lrtf, ``cfg`` with
    its budget), else the profiled forward + backward of an optimizer step."""
    return offload_step_s(cfg, profile) if cal.kind == SHARDED else predicted_seconds(profile, cfg, 1)


def job_seconds(profile: Profile, cfg: Config, steps: int, cal: ShapeCalibration) -> float:
    """A job's calibrated seconds for ``steps`` steps beside other jobs (under sharded-lrtf: on a slot): its
    shape's measured cost (:mod:`stratum.sweep.shape_cost`), or for a shape not measured the calibration's line."""
    cost = cal.shapes.get(shape_key(cfg))
    if cost is not None:
        return cost.seconds(steps)
    return cal.line.job_seconds(profiled_step_s=line_step_s(profile, cfg, cal),
                                state_bytes=profile.train_state_bytes, steps=steps)


def give_back_s(profile: Profile, cfg: Config, cal: ShapeCalibration) -> float:
    """Seconds one give-back of a sharded-lrtf job's device memory adds to its time on slots: its shape's measured
    cost, or for a shape not measured the calibration's seconds per byte of training state (0: nobody gives back
    where the calibration ran)."""
    measured = cal.give_back.get(shape_key(cfg))
    return measured if measured is not None else cal.give_back_per_byte * profile.train_state_bytes


def alone_share(profile: Profile, cfg: Config, steps: int, cal: ShapeCalibration | None) -> float:
    """A job's calibrated seconds with the machine to itself over its seconds beside other jobs (1 without a
    calibration): its shape's measured alone cost over its busy cost, or for a shape not measured 1 over the
    line's contention."""
    busy = job_seconds(profile, cfg, steps, cal) if cal is not None else 0.0
    if cal is None or busy <= 0.0:
        return 1.0
    alone = cal.alone.get(shape_key(cfg))
    return min(1.0, alone.seconds(steps) / busy) if alone is not None else 1.0 / cal.line.contention


def make_predict(state: SweepState, configs: dict[str, Config], profiles: dict[str, Profile], *,
                 calibration: ShapeCalibration | None = None,
                 slot_step_s: Mapping[str, float] | None = None) -> Callable[[str], dict[str, float]]:
    """Job → its candidate strategies' predicted seconds for what remains of it: its own measured median step
    time once it has run, else its calibrated time (given a calibration) or its profiled time scaled by how far
    measured jobs ran from their profiles (so started and unstarted jobs are compared in the same units).
    ``slot_step_s`` (sharded-lrtf): the measured seconds a job's step held slots, which stand for its measured
    step time — there a step's wall time also holds the other jobs' tasks run between its own."""
    def step_s(job_id: str) -> tuple[float, float | None]:
        profiled = predicted_seconds(profiles[job_id], configs[job_id], 1)
        if slot_step_s is not None:
            return profiled, slot_step_s.get(job_id)
        recs = segment_records(configs[job_id])
        return profiled, (median(recs, "step_s") if len(recs) > 1 else None)

    def predict(job_id: str) -> dict[str, float]:
        row = state.job(job_id)
        profiled, measured = step_s(job_id)
        if measured is None and calibration is not None:
            return {"plain": job_seconds(profiles[job_id], configs[job_id], row.steps - row.step, calibration)}
        if measured is None:
            ratios = [m / p for p, m in map(step_s, configs) if m is not None and p > 0]
            measured = profiled * (sorted(ratios)[len(ratios) // 2] if ratios else 1.0)
        return {"plain": measured * (row.steps - row.step)}
    return predict


def make_alone_share(state: SweepState, configs: dict[str, Config], profiles: dict[str, Profile],
                     calibration: ShapeCalibration | None) -> Callable[[str], float]:
    """Job → :func:`alone_share` for what remains of it: what a strategy holding all its slots (no job beside it)
    takes of the job's predicted time beside others."""
    def share(job_id: str) -> float:
        row = state.job(job_id)
        return alone_share(profiles[job_id], configs[job_id], row.steps - row.step, calibration)
    return share
