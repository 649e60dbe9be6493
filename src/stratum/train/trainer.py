"""The training loop: the same for every engine.

It owns data order, the learning-rate schedule, evaluation, metrics and checkpoints; the engine owns where
tensors live and how a step's forward, backward and update run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from stratum.atomic import atomic_write_json, atomic_write_text, unwritable_dir
from stratum.config import Config, shared_settings, to_toml
from stratum.data.prepare import Dataset, prepare_data
from stratum.data.tokenizer import tokenizer_id
from stratum.data.tokens import TRAIN, VAL
from stratum.dist.world import World, join_world, leave_world, peers_checked
from stratum.errors import StratumError
from stratum.log import console_unless_configured
from stratum.model.blockseq import BlockSeq
from stratum.parallel.burst_setup import record_planned_widths
from stratum.parallel.compose import build_engine, rank_model, rank_speeds
from stratum.parallel.multiplex import apply_priority, priority_stream
from stratum.plan.fidelity import beside
from stratum.plan.fidelity import describe as describe_prediction
from stratum.runtime.device import describe, resolve_device, synchronize
from stratum.runtime.engine import Engine
from stratum.train.checkpoint import (
    check_compatible,
    check_recorded_settings,
    check_tokenizer,
    latest_checkpoint,
    load_checkpoint,
    remove_partial_writes,
    restore_rng,
    save_checkpoint,
)
from stratum.train.fit import check_fits
from stratum.train.lock import hold_out_dir
from stratum.train.lr import lr_at
from stratum.train.metrics import median
from stratum.train.progress import StepDisplay, make_console
from stratum.train.scalars import metrics_log
from stratum.train.stopping import CheckpointClock, Interrupted, StopSignals, agree, removes_new_empty_out_dir
from stratum.train.threads import apply_threads

logger = logging.getLogger(__name__)


def prepare_out_dir(out_dir: Path) -> None:
    """Create ``out_dir`` and prove it is writable before any work starts."""
    probe = out_dir / f".write-test-{os.getpid()}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            probe.write_text("ok")
        finally:  # a full filesystem creates the file, then refuses its bytes
            probe.unlink(missing_ok=True)
    except OSError as e:
        raise unwritable_dir("train.out_dir", out_dir, e) from None
    ckpts = out_dir / "checkpoints"
    if ckpts.exists() and not ckpts.is_dir():  # found here, not at the first checkpoint after the steps before it
        raise StratumError(f"{ckpts} is a file, where the run keeps its checkpoints; move it away or choose "
                           "another train.out_dir")


def _set_aside(path: Path) -> Path:
    """Rename an earlier run's file out of the way (never delete results)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
    aside = path.with_name(f"{path.stem}.{stamp}{path.suffix}")
    os.replace(path, aside)
    return aside


class _Quiet:
    """Metrics log and display of a non-main rank: records nothing, prints nothing."""

    records: list = []

    def write(self, rec: dict) -> None:
        pass

    def step(self, rec: dict) -> None:
        pass

    def close(self) -> None:
        pass


@removes_new_empty_out_dir
def train(cfg: Config, *, stop_at: int | None = None, console: Console | None = None,
          after_step: Callable[[int], None] | None = None) -> dict:
    """Run (or resume) the configured training; returns the summary also written to ``summary.json``.

    ``stop_at`` ends this invocation after that many completed steps, with a checkpoint, so the run can be
    resumed later (time-sliced jobs, tests of resume). ``after_step`` is called with each completed step's
    number once its checkpoint (if due) is written (a sweep's worker stops there at the end of a time slice).

    A plan over several processes (``parallel.plan``): every rank runs this same loop on the same batches (the
    process groups are joined here, from the launcher's environment); only rank 0 prints and writes metrics,
    summary and checkpoints, and every rank reads the checkpoint it resumes from.

    What the run says (its set-up, notes, summary) goes to the ``stratum.train.trainer`` logger, with a console
    on top where logging is left unconfigured (:mod:`stratum.log`); ``console`` is where the progress bar draws.
    """
    with console_unless_configured():
        world = join_world(cfg.plan, resolve_device(cfg.train.device), backend=cfg.parallel.backend,
                           timeout_s=cfg.parallel.timeout_s)
        if not world.is_main:
            console = Console(file=open(os.devnull, "w"), highlight=False)
        threads = apply_threads(cfg.train.threads)
        priority = apply_priority(cfg.train.priority, world.device)
        if world.is_main:
            logger.info(threads)
            if priority:
                logger.info(priority)
        out_dir = Path(cfg.train.out_dir).expanduser()
        if world.is_main:
            prepare_out_dir(out_dir)
        with hold_out_dir(out_dir) if world.is_main else contextlib.nullcontext(), peers_checked(world), \
                priority_stream(cfg.train.priority, world.device):
            summary = _train(cfg, stop_at=stop_at, console=console, world=world, after_step=after_step)
        leave_world(world)
    return summary


def _train(cfg: Config, *, stop_at: int | None, console: Console | None, world: World,
           after_step: Callable[[int], None] | None) -> dict:
    cfg = cfg.anchored()  # (what config.toml and every checkpoint record)
    t = cfg.train
    out_dir = Path(t.out_dir).expanduser()
    main, device = world.is_main, world.device
    ckpt_path = _checkpoint_to_resume(cfg, out_dir, main)
    if ckpt_path is not None:  # (another tokenizer or corpus is refused before a BPE is trained for it)
        check_recorded_settings(ckpt_path, cfg)
    # every rank prepares its data (caches are written atomically, so ranks sharing a cache directory are safe;
    # `stratum train` prepares it before it spawns the ranks, so they only read it)
    data = prepare_data(cfg)
    tok_id = tokenizer_id(data.tokenizer)  # checked on resume, recorded with every checkpoint
    world.agree({**shared_settings(cfg), "the checkpoint resumed": ckpt_path.name if ckpt_path else "none (a fresh "
                 "start)", "the tokenizer": tok_id})
    check_fits(cfg, device, tokenizer_vocab=data.tokenizer.vocab_size)  # before any allocation it would exceed
    torch.manual_seed(t.seed)
    speeds = rank_speeds(cfg, world)  # measured before any model work, on every rank at once
    model, stages = rank_model(cfg, world, tokenizer_vocab=data.tokenizer.vocab_size, speeds=speeds)
    fingerprint = model.fingerprint()

    ckpt = _resume_from(ckpt_path, cfg, fingerprint, tok_id)
    start = ckpt.step if ckpt is not None else 0
    if ckpt is not None:
        if start >= t.steps:
            logger.info(f"the run in {out_dir} is already complete ({start}/{t.steps} steps): nothing to do; "
                        "raise train.steps to continue it, or choose a new train.out_dir")
            return _saved_summary(out_dir, start)
        if stop_at is not None and start >= stop_at:  # nothing to run: the summary of the run so far stands
            logger.info(f"the run in {out_dir} is at step {start}, at or past --stop-at {stop_at}: nothing to do")
            return _saved_summary(out_dir, start)
    elif main and (out_dir / "metrics.jsonl").exists():
        aside = _set_aside(out_dir / "metrics.jsonl")
        logger.info(f"note: an earlier run's metrics without a checkpoint were moved to {aside.name}")

    engine = build_engine(cfg, model, world, stages, speeds, resuming=ckpt is not None)
    if main:
        record_planned_widths(cfg, model, engine)
    torch.manual_seed(t.seed)  # the steps' RNG streams start here, whatever the builds and set-up drew before
    if ckpt is not None:
        engine.load_state(ckpt.state)
        restore_rng(ckpt.rng)
    end = min(t.steps, stop_at) if stop_at is not None else t.steps
    if main:
        atomic_write_text(out_dir / "config.toml", to_toml(cfg))
    _log_start(cfg, model=model, engine=engine, world=world, stages=stages, data=data,
               start=start, end=end)
    run = _Run(cfg=cfg, engine=engine, model=model, data=data, world=world, out_dir=out_dir,
               fingerprint=fingerprint, tokenizer=tok_id, start=start, end=end, after_step=after_step)
    return _run_steps(run, console or make_console())


def _checkpoint_to_resume(cfg: Config, out_dir: Path, main: bool) -> Path | None:
    """The checkpoint this run resumes from (None: a fresh run); refused where resuming was not asked for."""
    if main:
        remove_partial_writes(out_dir)  # this run holds out_dir: any temp file in it is a killed run's
    ckpt_path = latest_checkpoint(out_dir)
    if ckpt_path is not None and not cfg.train.resume:
        raise StratumError(f"train.out_dir {str(out_dir)!r} already holds checkpoints; set train.resume = true "
                           "to continue that run, or choose a new train.out_dir")
    return ckpt_path


@dataclass(frozen=True, kw_only=True)
class _Run:
    """What the step loop of one invocation works with, set up by :func:`_train`."""

    cfg: Config
    engine: Engine
    model: BlockSeq
    data: Dataset
    world: World
    out_dir: Path
    fingerprint: dict
    tokenizer: str
    """The tokenizer's identity (:func:`~stratum.data.tokenizer.tokenizer_id`), recorded with every checkpoint."""
    start: int
    """The first step this invocation runs (the checkpoint's, or 0)."""
    end: int
    """The step it stops after (train.steps, or --stop-at)."""
    after_step: Callable[[int], None] | None = None
    """Called with each completed step (see :func:`train`)."""


def _run_steps(run: _Run, console: Console) -> dict:
    """Run the steps start..end with metrics, display and checkpoints; write and return the summary."""
    cfg, main, out_dir = run.cfg, run.world.is_main, run.out_dir
    log = metrics_log(cfg, out_dir, resume_step=run.start) if main else _Quiet()
    display = StepDisplay(console, total=cfg.train.steps, start=run.start,
                          log_interval=cfg.train.log_interval) if main else _Quiet()
    signals = StopSignals()
    run_start = time.perf_counter()
    try:
        signals.install()
        end, stopped, last_ckpt = _step_loop(run, log, display, signals)
    finally:
        signals.restore()
        display.close()
        log.close()
        run.engine.close()

    summary = _summary(log.records, model=run.model, engine=run.engine, world=run.world, cfg=cfg, start=run.start,
                       end=end, wall=time.perf_counter() - run_start, checkpoint=last_ckpt)
    if main:
        atomic_write_json(out_dir / "summary.json", summary)
        _log_summary(summary)
    if stopped and end < cfg.train.steps:
        logger.info(f"stopped by {signals.received or 'a signal to another rank'} at step {end} of "
                    f"{cfg.train.steps}, with a checkpoint: run the same command to resume")
        raise Interrupted(f"stopped at step {end}")
    return summary


def _step_loop(run: _Run, log, display, signals: StopSignals) -> tuple[int, bool, Path | None]:
    """The steps themselves: (the step it ended after, whether a signal stopped it, the last checkpoint)."""
    cfg, t, engine, device = run.cfg, run.cfg.train, run.engine, run.world.device
    data, end = run.data, run.end
    flops_per_token = run.model.flops_per_token(cfg.data.seq_len)
    eval_batches = [b for i in range(t.eval_batches) if cfg.data.val_fraction > 0  # no split: no evaluation
                    for b in data.sampler.micro_batches(VAL, i, t.micro_batch_size, 1)]
    per_step, tokens = cfg.micro_batches_per_step, cfg.tokens_per_step  # from the plan: once, not every step
    clock = CheckpointClock(t.ckpt_minutes)
    last_ckpt = None
    for step in range(run.start, end):
        rec = _one_step(cfg, engine, data, step, per_step=per_step, tokens=tokens,
                        flops_per_token=flops_per_token, eval_batches=eval_batches, device=device)
        done = step + 1
        if broken := _non_finite(rec):  # this step's update may have spoilt the state: it is not saved
            raise StratumError(f"the {broken} became {rec[broken]} at step {done}; lower optim.lr or raise "
                               "optim.warmup_fraction — no checkpoint of this state was written (last good "
                               f"checkpoint: {latest_checkpoint(run.out_dir) or 'none'})")
        log.write(rec)
        display.step(rec)
        # a signal or the clock may differ between ranks; the checkpoint is a collective: decide together
        by_time, stop = agree([clock.due(), signals.requested() is not None], run.world)
        if done == end or stop or by_time or (t.ckpt_interval and done % t.ckpt_interval == 0):
            # the parts come as the checkpoint writes them (rank 0's), a part of every rank at a time
            parts = engine.state_parts()
            if run.world.is_main:
                last_ckpt = save_checkpoint(run.out_dir, step=done, parts=parts, cfg=cfg,
                                            fingerprint=run.fingerprint, keep=t.keep_checkpoints,
                                            tokenizer=run.tokenizer)
            else:
                for _ in parts:  # a multi-process engine's parts are collectives every rank takes part in
                    pass
            clock.saved()
        if stop:
            return done, True, last_ckpt
        if run.after_step is not None:
            run.after_step(done)
    return end, False, last_ckpt


def _non_finite(rec: dict) -> str | None:
    """The first of a step record's loss and gradient norm that is NaN or infinite; None when both are finite.
    A step fp16's loss scaler skipped for an overflowing gradient changed nothing: its norm is not a failure."""
    keys = ("loss",) if rec.get("skipped") else ("loss", "grad_norm")
    return next((k for k in keys if not math.isfinite(rec[k])), None)


def _saved_summary(out_dir: Path, steps_done: int) -> dict:
    """The summary an earlier invocation wrote (a minimal one where it is missing or unreadable)."""
    try:
        return json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {"steps_done": steps_done}


def _one_step(cfg: Config, engine, data, step: int, *, per_step: int, tokens: int, flops_per_token: float,
              eval_batches: list, device: torch.device) -> dict:
    """Train step ``step`` (0-based) and return its metrics record (with the eval loss where one is due)."""
    t = cfg.train
    lr = lr_at(step, lr=cfg.optim.lr, min_lr=cfg.optim.min_lr, warmup_steps=cfg.warmup_steps, total_steps=t.steps)
    t0 = time.perf_counter()
    res = engine.train_step(data.sampler.micro_batches(TRAIN, step, t.micro_batch_size, per_step), lr)
    synchronize(device)
    dt = time.perf_counter() - t0
    rec = {"step": step + 1, "loss": res.loss, "lr": lr, "grad_norm": res.grad_norm, "tokens": tokens,
           "step_s": dt, "tokens_per_s": tokens / dt, "tflops": flops_per_token * tokens / dt / 1e12,
           **engine.memory_stats(), **engine.step_io()}
    if res.loss_scale is not None:  # fp16: the scale the step ran with, and whether it was skipped (0/1)
        rec.update(loss_scale=res.loss_scale, skipped=int(res.skipped))
    done = step + 1
    if ((t.eval_interval and done % t.eval_interval == 0) or done == t.steps) and cfg.data.val_fraction > 0:
        rec["eval_loss"] = engine.eval_loss(eval_batches)
    return rec


def _resume_from(ckpt_path: Path | None, cfg: Config, fingerprint: dict, tokenizer: str):
    """The checkpoint a run continues from (refused if it is another model's, or another tokenizer's), noting
    settings that changed."""
    if ckpt_path is None:
        return None
    ckpt = load_checkpoint(ckpt_path)
    check_tokenizer(ckpt, tokenizer)
    for change in check_compatible(ckpt, cfg, fingerprint):
        logger.info(f"note: resuming with changed setting {change}")
    return ckpt


def _log_start(cfg: Config, *, model, engine, world: World, stages, data, start: int,
               end: int) -> None:
    """What the run is about to do: model, engine, data, derived values, the plan's processes, the step range."""
    t = cfg.train
    logger.info(f"model {model.info.name} ({cfg.model.source}): {model.num_params():,} parameters, {len(model)} "
                f"blocks; engine {engine.name} on {describe(world.device)}, {t.precision}")
    logger.info(f"data {cfg.data.corpus!r}: {data.corpus.files_text}, {data.n_tokens:,} tokens "
                f"({data.tokenizer.name} tokenizer, vocab {data.tokenizer.vocab_size})")
    logger.info(cfg.derived_summary())
    if engine.describe():
        logger.info(engine.describe())
    if world.plan.world_size() > 1:
        logger.info(world.plan.table(stages.blocks_of if stages else lambda _: list(range(len(model)))))
    logger.info(("resuming at" if start else "starting at") + f" step {start}, running to {end} of {t.steps}; "
                f"output in {Path(t.out_dir).expanduser()}")


def _summary(recs: list[dict], *, model, engine, world: World, cfg: Config, start: int, end: int, wall: float,
             checkpoint: Path | None) -> dict:
    """The run's summary (``summary.json``) from its metrics records: the losses the whole run's, its speed,
    memory and data movement this invocation's steps' (``start`` on) — a resumed run may run another engine or
    plan, whose figures its name must not be put beside."""
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r]
    mine = [r for r in recs if r["step"] > start]
    summary = {
        "model": model.info.name, "params": model.num_params(), "engine": engine.name,
        "device": describe(world.device), "steps_done": end, "steps_total": cfg.train.steps,
        "steps_this_run": end - start,
        "first_loss": recs[0]["loss"] if recs else None, "final_loss": recs[-1]["loss"] if recs else None,
        "final_eval_loss": evals[-1] if evals else None,
        "median_tokens_per_s": median(mine, "tokens_per_s"), "median_tflops": median(mine, "tflops"),
        "peak_device_bytes": max((r.get("peak_device_bytes", 0) for r in mine), default=0),
        "wall_s": wall, "checkpoint": str(checkpoint) if checkpoint else None,
        "out_dir": str(Path(cfg.train.out_dir).expanduser()),
    }
    summary.update(_io_summary(mine, engine.predicted_step_s))
    searched = beside(Path(cfg.train.out_dir).expanduser(), str(world.plan), median(mine, "step_s"),
                      summary["peak_device_bytes"])
    if searched is not None:  # the plan search chose this tree: its prediction beside the measurement
        summary["plan_search"] = searched
    return summary


def _io_summary(recs: list[dict], predicted_step_s: float | None) -> dict:
    """Medians of the per-step data movement (engines that report it) and, where the engine has a plan, of the
    step time beside the plan's prediction (``median`` leaves out the first step, which records the offload
    engine's access sequence without prefetch)."""
    keys = [k for k in ("moved_h2d_bytes", "moved_d2h_bytes", "moved_disk_read_bytes", "moved_disk_write_bytes",
                        "wait_s") if any(k in r for r in recs)]
    out = {f"median_{k}": median(recs, k) for k in keys}
    if predicted_step_s is not None:
        out["predicted_step_s"] = predicted_step_s
        out["median_step_s"] = median(recs, "step_s")
    return out


def _log_summary(s: dict) -> None:
    def fmt(v, spec):
        return format(v, spec) if v is not None else "-"

    logger.info(
        f"done: {s['steps_done']}/{s['steps_total']} steps ({s['steps_this_run']} this run) in {s['wall_s']:.1f} s; "
        f"loss {fmt(s['first_loss'], '.4f')} → {fmt(s['final_loss'], '.4f')}, eval loss "
        f"{fmt(s['final_eval_loss'], '.4f')}; median {fmt(s['median_tokens_per_s'], ',.0f')} tokens/s, "
        f"{fmt(s['median_tflops'], '.3f')} TFLOP/s; peak memory {s['peak_device_bytes'] / 2**20:,.0f} MiB"
    )
    if "median_moved_h2d_bytes" in s:
        mib = {k: s[f"median_moved_{k}_bytes"] / 2**20 for k in ("h2d", "d2h", "disk_read", "disk_write")}
        logger.info(f"moved per step (median): host→device {mib['h2d']:,.1f} MiB, device→host "
                    f"{mib['d2h']:,.1f} MiB, disk read {mib['disk_read']:,.1f} MiB, disk write "
                    f"{mib['disk_write']:,.1f} MiB; waiting for data {s['median_wait_s'] * 1e3:.1f} ms")
    if "predicted_step_s" in s:
        logger.info(f"step time: {fmt(s['median_step_s'], '.3f')} s measured (median), {s['predicted_step_s']:.3f} s "
                    "predicted by the plan")
    if "plan_search" in s:
        logger.info(describe_prediction(s["plan_search"]))
    logger.info(f"metrics: {s['out_dir']}/metrics.jsonl  checkpoint: {s['checkpoint']}")


def read_metrics(out_dir: str | Path) -> list[dict]:
    """The metrics records of a run directory (for tests and tools)."""
    p = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []
