"""Where a run's per-step scalars go besides ``metrics.jsonl``: TensorBoard event files, Weights & Biases.

Both are optional extras (``pip install 'stratum[tensorboard]'``, ``'stratum[wandb]'``), switched on by
``train.tensorboard`` and ``train.wandb_project``; config validation refuses either when its package is missing,
so a run never starts only to fail at its first step. Every number of a ``metrics.jsonl`` record becomes a scalar
at that record's step, under a tag grouping it (``train/loss``, ``eval/loss``, ``perf/tokens_per_s`` …).

A resumed run continues the same event stream: its TensorBoard file purges the events a killed run wrote past
the checkpoint (as ``metrics.jsonl`` drops its records), and W&B continues the run whose id the first start
stored in the out_dir.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Protocol

from stratum.atomic import atomic_write_text
from stratum.config import Config
from stratum.errors import StratumError
from stratum.extras import require
from stratum.train.metrics import MetricsLog

TENSORBOARD_DIR = "tensorboard"
"""Event files go to ``<out_dir>/tensorboard`` (point ``tensorboard --logdir`` at it or at the out_dir)."""
WANDB_ID_FILE = "wandb_run_id"
"""The W&B run id, in the out_dir: a resume logs into the same W&B run."""

EVENT_FILE_VERSION = "brain.Event:2"
"""The event-file format TensorBoard reads (what ``torch.utils.tensorboard`` writes too)."""

TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "eval_loss": "eval/loss",
        "loss_scale": "train/loss_scale", "skipped": "train/skipped"}
"""Tags of the records' main keys; every other number goes under ``perf/<key>``."""


class ScalarSink(Protocol):
    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a metrics record under their tags (the step is the x axis, not a scalar)."""
    return {TAGS.get(k, f"perf/{k}"): float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardSink:
    """Scalars as a TensorBoard event file, written in this thread: a full disk is a one-line error at the step
    that meets it (``torch.utils.tensorboard`` writes from a thread of its own, whose failure prints a
    traceback), and every step is on disk once written, for a run watched live."""

    def __init__(self, log_dir: Path, *, resume_step: int):
        require("tensorboard", "train.tensorboard")
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = Event, Summary
        stem = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = log_dir / f"{stem}.0"
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            # a resume within the same second of the same process must not reuse (and truncate) the file
            n = next(k for k in range(1 << 20) if not (log_dir / f"{stem}.{k}").exists())
            self.path = log_dir / f"{stem}.{n}"
            self._records = RecordWriter(self.path.open("wb"))
        except OSError as e:
            raise self._error(e) from None
        if resume_step:
            # TensorBoard hides the events a killed run wrote past the checkpoint (metrics.jsonl drops them too):
            # a file that starts at step s with a session START purges the earlier files' steps ≥ s
            self._add(Event(wall_time=time.time(), step=resume_step + 1, file_version=EVENT_FILE_VERSION))
            self._add(Event(wall_time=time.time(), step=resume_step + 1,
                            session_log=SessionLog(status=SessionLog.START)))
        else:
            self._add(Event(wall_time=time.time(), file_version=EVENT_FILE_VERSION))

    def write(self, record: dict) -> None:
        values = [self._summary.Value(tag=tag, simple_value=v) for tag, v in scalars(record).items()]
        self._add(self._event(wall_time=time.time(), step=record["step"], summary=self._summary(value=values)))

    def close(self) -> None:
        try:
            self._records.close()
        except OSError as e:
            raise self._error(e) from None

    def _add(self, event) -> None:
        try:
            self._records.write(event.SerializeToString())
            self._records.flush()
        except OSError as e:
            raise self._error(e) from None

    def _error(self, e: OSError) -> StratumError:
        return StratumError(f"cannot write TensorBoard events to {str(self.path)!r} ({e.strerror or e}); free "
                            "space or set train.tensorboard = false")


class WandbSink:
    """Scalars logged to a Weights & Biases run (``WANDB_MODE=offline`` logs without a network)."""

    def __init__(self, project: str, *, out_dir: Path, config: dict):
        require("wandb", "train.wandb_project")
        import wandb
        id_file = out_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
        self._run = wandb.init(project=project, id=run_id, resume="allow", dir=str(out_dir), config=config,
                               name=out_dir.name)
        if not id_file.is_file():
            atomic_write_text(id_file, run_id + "\n")

    def write(self, record: dict) -> None:
        self._run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self._run.finish()


def open_sinks(cfg: Config, out_dir: Path, *, resume_step: int) -> list[ScalarSink]:
    """The sinks ``cfg`` switches on, opened for a run continuing after ``resume_step`` completed steps."""
    sinks: list[ScalarSink] = []
    if cfg.train.tensorboard:
        sinks.append(TensorBoardSink(out_dir / TENSORBOARD_DIR, resume_step=resume_step))
    if cfg.train.wandb_project.strip():
        sinks.append(WandbSink(cfg.train.wandb_project.strip(), out_dir=out_dir, config=cfg.to_dict()))
    return sinks


class MetricsWithSinks:
    """A :class:`MetricsLog` whose records also go to ``sinks``: what the trainer writes a step's record to."""

    def __init__(self, log: MetricsLog, sinks: list[ScalarSink]):
        self.log = log
        self.sinks = sinks

    @property
    def records(self) -> list[dict]:
        return self.log.records

    def write(self, record: dict) -> None:
        self.log.write(record)
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        self.log.close()
        for sink in self.sinks:
            sink.close()


def metrics_log(cfg: Config, out_dir: Path, *, resume_step: int) -> MetricsWithSinks:
    """``<out_dir>/metrics.jsonl`` and the sinks ``cfg`` switches on, for a run continuing after
    ``resume_step`` completed steps."""
    log = MetricsLog(out_dir / "metrics.jsonl", resume_step=resume_step)
    try:
        return MetricsWithSinks(log, open_sinks(cfg, out_dir, resume_step=resume_step))
    except BaseException:
        log.close()
        raise
