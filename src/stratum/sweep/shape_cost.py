"""A sweep's calibration as data, and its one fit: what each of the sweep's job shapes was measured to hold a
slot for on this machine, and a line through them for a shape that was not measured.

A job's seconds follow its shape — model, sequence length, micro-batch and micro-batches per step — more than
anything a profile tells: start-up, data, the optimizer step, evaluation and checkpoint (and under sharded-lrtf
the offload engine's set-up, chunk copies and hand-overs) differ by shape, and so does how much a job slows when
the other slots are busy. So both calibrations measure the shapes the sweep runs, as it runs them, and the line
serves only the rest: :mod:`stratum.sweep.plain_calibrate` (fifo, lrtf, planned: each shape alone and with every
slot busy) and :mod:`stratum.sweep.shard_calibrate` (sharded-lrtf: the shapes in one shard worker, slots busy).
Both turn their runs into :class:`~stratum.sweep.calibrate.Sample` s and fit them here (:func:`fit`).

The file form: ``{"key", "kind", "calibration": <the line>, "shapes": {shape key: {"label", "fixed_s",
"step_s"}}, "alone": {…}, "give_back": {shape key: seconds}, "give_back_per_byte": seconds, "restart": {shape key:
seconds}}`` (``alone``, the give-back and the restart keys may be left out: none measured).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stratum.atomic import atomic_write_text
from stratum.config import Config
from stratum.profile.profile import Profile
from stratum.sweep.calibrate import Calibration, Sample, calibration_key, from_samples, load_cached, parse_calibration

PLAIN = "plain"
"""The kind of calibration fifo, lrtf and planned read (jobs as worker processes, one slot each)."""
SHARDED = "sharded-lrtf"
"""The kind sharded-lrtf reads (jobs as chains of shard tasks in one shard worker)."""
MAX_SHAPES = 6
"""The most job shapes one calibration trains (the others are priced by the line through these)."""
SHAPE_STEPS = 4
"""Optimizer steps of each calibration job (its first holds its warm-up: the median step leaves it out)."""


@dataclass(frozen=True, kw_only=True)
class ShapeCost:
    """What one job shape holds a slot for, measured."""

    label: str
    """The shape in words (preset, sequence length, micro-batches), for progress lines."""
    fixed_s: float
    """Seconds outside its steps: start-up and warm-up (sharded-lrtf: its set-up in its first task, with the wait
    for another job's set-up it holds its slot through) and the tail after its last step (evaluation,
    checkpoint)."""
    step_s: float
    """Seconds per optimizer step (the median over its steps)."""

    def seconds(self, steps: int) -> float:
        return max(0.0, self.fixed_s + steps * self.step_s)


@dataclass(frozen=True, kw_only=True)
class ShapeCalibration:
    """A sweep's per-shape costs on this machine and the line for other shapes."""

    kind: str
    """PLAIN or SHARDED: which scheduler family measured it (and which step the line is against)."""
    line: Calibration
    """Fitted through the measured samples against each job's profiled step (PLAIN) or the offload planner's
    predicted step at the budget (SHARDED), with the busy slots' contention; used for a shape not in
    ``shapes``."""
    shapes: dict[str, ShapeCost]
    """Shape key (:func:`shape_key`) → its cost with every slot busy (what a job beside others holds)."""
    alone: dict[str, ShapeCost] = field(default_factory=dict)
    """Shape key → its cost with the machine to itself (PLAIN only): the base of a strategy that holds all its
    slots, which no other job shares."""
    give_back: dict[str, float] = field(default_factory=dict)
    """Shape key → seconds one give-back of its device memory adds to its job's time on slots (SHARDED, measured
    where the devices' memory is limited: :mod:`stratum.sweep.shard_calibrate`); empty where nobody gives back."""
    give_back_per_byte: float = 0.0
    """Seconds a give-back costs per byte of a job's training state, for a shape not in ``give_back`` (the
    median over the measured shapes)."""
    restart: dict[str, float] = field(default_factory=dict)
    """Shape key → seconds a segment that resumes a job from its checkpoint spends beyond its steps (PLAIN:
    worker start, checkpoint load and save; what each lrtf checkpoint slice after a job's first pays)."""

    def describe(self) -> str:
        def one(key: str, c: ShapeCost) -> str:
            a = self.alone.get(key)
            return f"{c.label}: {c.fixed_s:.2f} s + steps × {c.step_s * 1e3:.0f} ms" + (
                f" (alone {a.fixed_s:.2f} s + {a.step_s * 1e3:.0f} ms)" if a else "")
        per_shape = "; ".join(one(k, c) for k, c in self.shapes.items())
        gave = ", ".join(f"{self.shapes[k].label if k in self.shapes else k} {s * 1e3:.1f} ms"
                         for k, s in self.give_back.items())
        return f"{per_shape}; other shapes: {self.line.describe()}" + (f"; a give-back: {gave}" if gave else "")


def shape_key(cfg: Config) -> str:
    """What a job's seconds on a slot follow besides its steps: its model, sequence length, micro-batch size and
    count, engine, precision and device."""
    return json.dumps([cfg.to_dict()["model"], cfg.data.seq_len, cfg.train.micro_batch_size,
                       cfg.micro_batches_per_step, cfg.train.engine, cfg.train.precision, cfg.train.device],
                      sort_keys=True)


def shape_label(cfg: Config) -> str:
    return (f"{cfg.model.preset} seq {cfg.data.seq_len} batch {cfg.train.micro_batch_size}"
            + (f"×{cfg.micro_batches_per_step}" if cfg.micro_batches_per_step > 1 else ""))


def shapes_key(configs: list[Config], *, threads: int, slots: int, kind: str, extra: tuple = ()) -> str:
    """What a calibration of ``configs`` depends on: the machine's key (of the first config), its kind, what else
    its measurement follows (``extra``: sharded-lrtf's budget and shard size) and the jobs' distinct shapes."""
    first = configs[0]
    return json.dumps([calibration_key(first, threads=threads, slots=slots), kind, *extra,
                       sorted({shape_key(c) for c in configs})])


def pick_shapes(configs: list[Config], profiles: list[Profile]) -> list[tuple[Config, Profile]]:
    """One config per distinct shape (the first of each), at most MAX_SHAPES of them spread evenly over their
    profiled step times (the smallest and the largest among them)."""
    by_shape: dict[str, tuple[Config, Profile]] = {}
    for cfg, prof in zip(configs, profiles):
        by_shape.setdefault(shape_key(cfg), (cfg, prof))
    shapes = sorted(by_shape.values(), key=lambda cp: cp[1].step_s * cp[0].micro_batches_per_step)
    if len(shapes) <= MAX_SHAPES:
        return shapes
    return [shapes[round(i * (len(shapes) - 1) / (MAX_SHAPES - 1))] for i in range(MAX_SHAPES)]


@dataclass(frozen=True, kw_only=True)
class Measured:
    """One calibration job's figures, with its shape."""

    shape: str
    """Its shape key."""
    label: str
    """Its shape in words."""
    sample: Sample
    """What it took."""


def shape_costs(measured: list[Measured]) -> dict[str, ShapeCost]:
    """Each shape's cost: the mean of its jobs' fixed and step seconds (shapes in first-measured order)."""
    out: dict[str, ShapeCost] = {}
    for shape in dict.fromkeys(m.shape for m in measured):
        mine = [m for m in measured if m.shape == shape]
        out[shape] = ShapeCost(label=mine[0].label, fixed_s=sum(m.sample.fixed_s for m in mine) / len(mine),
                               step_s=sum(m.sample.step_s for m in mine) / len(mine))
    return out


def fit(kind: str, busy: list[Measured], alone: list[Measured] | None = None) -> ShapeCalibration:
    """The calibration of jobs measured with every slot busy (and, if measured, alone): each shape's costs
    (:func:`shape_costs`), and the line through the samples — fitted to the alone samples with the busy ones'
    contention over them (:func:`~stratum.sweep.calibrate.from_samples`; without alone samples, to the busy ones
    with contention 1)."""
    base = alone if alone else busy
    line = from_samples([m.sample for m in base], [m.sample for m in busy_matching(base, busy)])
    return ShapeCalibration(kind=kind, line=line, shapes=shape_costs(busy),
                            alone=shape_costs(alone) if alone else {})


def busy_matching(base: list[Measured], busy: list[Measured]) -> list[Measured]:
    """For each of ``base``'s jobs, a busy job of its shape (the mean of its shape's busy samples), so the
    contention compares like with like."""
    costs = shape_costs(busy)
    return [Measured(shape=m.shape, label=m.label,
                     sample=Sample(profiled_step_s=m.sample.profiled_step_s, state_bytes=m.sample.state_bytes,
                                   step_s=costs[m.shape].step_s, fixed_s=costs[m.shape].fixed_s))
            for m in base]


def _parse_costs(table: object, what: str) -> dict[str, ShapeCost]:
    if not isinstance(table, dict):
        raise ValueError(f"its \"{what}\" is not a table")
    out = {}
    for key, v in table.items():
        ok = isinstance(v, dict) and set(v) == {"label", "fixed_s", "step_s"} and isinstance(v["label"], str) \
            and all(isinstance(v[n], (int, float)) and not isinstance(v[n], bool) for n in ("fixed_s", "step_s"))
        if not ok:
            raise ValueError(f"its shape {key!r} needs label (text), fixed_s and step_s (numbers)")
        out[key] = ShapeCost(label=v["label"], fixed_s=float(v["fixed_s"]), step_s=float(v["step_s"]))
    return out


def parse_shape_calibration(doc: object, kind: str) -> ShapeCalibration:
    """The ``kind`` calibration in a file's JSON document; ValueError (what is wrong) if it holds none."""
    line = parse_calibration(doc)
    assert isinstance(doc, dict)  # (parse_calibration read a table from it)
    if doc.get("kind") not in (PLAIN, SHARDED):
        raise ValueError(f"its \"kind\" must be \"{PLAIN}\" or \"{SHARDED}\", got {doc.get('kind')!r}")
    if doc["kind"] != kind:
        raise ValueError(f"it holds a {doc['kind']} calibration; the scheduler reads a {kind} one")
    if "shapes" not in doc:
        raise ValueError("it has no \"shapes\" table")
    gave, per_byte, restart = doc.get("give_back", {}), doc.get("give_back_per_byte", 0.0), doc.get("restart", {})
    if not isinstance(gave, dict) or not all(_seconds(v) for v in gave.values()) or not _seconds(per_byte):
        raise ValueError("its \"give_back\" must map shapes to seconds and \"give_back_per_byte\" be seconds (≥ 0)")
    if not isinstance(restart, dict) or not all(_seconds(v) for v in restart.values()):
        raise ValueError("its \"restart\" must map shapes to seconds (≥ 0)")
    return ShapeCalibration(kind=kind, line=line, shapes=_parse_costs(doc["shapes"], "shapes"),
                            alone=_parse_costs(doc.get("alone", {}), "alone"),
                            give_back={k: float(v) for k, v in gave.items()}, give_back_per_byte=float(per_byte),
                            restart={k: float(v) for k, v in restart.items()})


def _seconds(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def load_shape_calibration(path: Path, key: str, kind: str) -> ShapeCalibration | None:
    """The cached ``kind`` calibration of ``key`` at ``path`` (None: see :func:`load_cached`)."""
    return load_cached(path, key, lambda doc: parse_shape_calibration(doc, kind))


def save_shape_calibration(path: Path, key: str, cal: ShapeCalibration) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"key": key, "kind": cal.kind, "calibration": asdict(cal.line),
                                        "shapes": {k: asdict(c) for k, c in cal.shapes.items()},
                                        "alone": {k: asdict(c) for k, c in cal.alone.items()},
                                        "give_back": cal.give_back, "give_back_per_byte": cal.give_back_per_byte,
                                        "restart": cal.restart},
                                       indent=1))
