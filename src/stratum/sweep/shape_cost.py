"""sharded-lrtf's calibration as data: what each of a sweep's job shapes was measured to hold a slot for, and a
line fitted through them for a shape that was not measured (:mod:`stratum.sweep.shard_calibrate` measures it).

A job's seconds on a slot under sharded-lrtf follow its shape — model, sequence length, micro-batch and
micro-batches per step — more than anything a profile tells: the offload engine's set-up, chunk copies and
host-side optimizer step, and the hand-overs, differ by shape in ways the offload planner's predicted step does
not follow closely. So the shapes the sweep runs are measured as they are, and the line serves only the rest.

The file form extends the plain calibration's (``{"key", "calibration"}``) with ``"shapes"``: shape key →
``{"label", "fixed_s", "step_s"}``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from stratum.atomic import atomic_write_text
from stratum.config import Config
from stratum.sweep.calibrate import Calibration, load_cached, parse_calibration


@dataclass(frozen=True, kw_only=True)
class ShapeCost:
    """What one job shape holds a slot for under sharded-lrtf, measured."""

    label: str
    """The shape in words (preset, sequence length, micro-batches), for progress lines."""
    fixed_s: float
    """Seconds outside its steps: its set-up in its first task (with the wait for another job's set-up it holds
    its slot through) and the tail after its last step (optimizer step, evaluation, checkpoint)."""
    step_s: float
    """Seconds per optimizer step (its tasks' sum, median over the steps)."""


@dataclass(frozen=True, kw_only=True)
class ShardCalibration:
    """sharded-lrtf's per-shape costs and the line for other shapes."""

    line: Calibration
    """Fitted through the measured shapes against the offload planner's predicted step (contention 1: measured
    under it); used for a shape not in ``shapes``."""
    shapes: dict[str, ShapeCost]
    """Shape key (:func:`shape_key`) → its measured cost."""

    def describe(self) -> str:
        per_shape = "; ".join(f"{c.label}: {c.fixed_s:.2f} s + steps × {c.step_s * 1e3:.0f} ms"
                              for c in self.shapes.values())
        return f"{per_shape}; other shapes: {self.line.describe()}"


def shape_key(cfg: Config) -> str:
    """What a job's seconds on a slot follow besides its steps: its model, sequence length, micro-batch size and
    count, precision and device."""
    return json.dumps([cfg.to_dict()["model"], cfg.data.seq_len, cfg.train.micro_batch_size,
                       cfg.micro_batches_per_step, cfg.train.precision, cfg.train.device], sort_keys=True)


def shape_label(cfg: Config) -> str:
    return (f"{cfg.model.preset} seq {cfg.data.seq_len} batch {cfg.train.micro_batch_size}"
            + (f"×{cfg.micro_batches_per_step}" if cfg.micro_batches_per_step > 1 else ""))


def parse_shard_calibration(doc: object) -> ShardCalibration:
    """The sharded calibration in a file's JSON document; ValueError (what is wrong) if it holds none."""
    line = parse_calibration(doc)
    shapes = doc.get("shapes") if isinstance(doc, dict) else None
    if not isinstance(shapes, dict):
        raise ValueError("it has no \"shapes\" table (a plain calibration: sharded-lrtf needs its own, "
                         "calibration.sharded.json)")
    out = {}
    for key, v in shapes.items():
        ok = isinstance(v, dict) and set(v) == {"label", "fixed_s", "step_s"} and isinstance(v["label"], str) \
            and all(isinstance(v[n], (int, float)) and not isinstance(v[n], bool) for n in ("fixed_s", "step_s"))
        if not ok:
            raise ValueError(f"its shape {key!r} needs label (text), fixed_s and step_s (numbers)")
        out[key] = ShapeCost(label=v["label"], fixed_s=float(v["fixed_s"]), step_s=float(v["step_s"]))
    return ShardCalibration(line=line, shapes=out)


def load_shard_calibration(path: Path, key: str) -> ShardCalibration | None:
    """The cached sharded calibration of ``key`` at ``path`` (None: see :func:`load_cached`)."""
    return load_cached(path, key, parse_shard_calibration)


def save_shard_calibration(path: Path, key: str, cal: ShardCalibration) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"key": key, "calibration": asdict(cal.line),
                                        "shapes": {k: asdict(c) for k, c in cal.shapes.items()}}, indent=1))
