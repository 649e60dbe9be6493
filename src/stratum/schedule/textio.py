"""Human-writable text format for schedules.

Example (1F1B, 2 ranks, 3 micro-batches)::

    # anything after '#' is a comment; blank lines are ignored
    name: 1f1b
    stages: 0 1          # stage -> rank map: stage 0 on rank 0, stage 1 on rank 1
    microbatches: 3
    rank 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2
    rank 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2

Header keys: ``name`` (one word, default ``custom``), ``stages`` (required: for each stage, the rank holding it),
``microbatches`` (required), ``ranks`` (optional; default 1 + the highest rank in ``stages``). Then one
``rank R:`` line per rank (a rank may span several lines; they are concatenated), listing actions in run order
as ``KIND STAGE.MB`` with KIND F (forward), B (backward), I (input-gradient backward) or W (weight-gradient
backward), separated by spaces or commas. :func:`load` validates the schedule before returning it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from stratum.atomic import atomic_write_text
from stratum.errors import StratumError
from stratum.schedule.ir import Action, Schedule
from stratum.schedule.validate import validate


def dumps(sched: Schedule) -> str:
    """The schedule in the text format (round-trips through :func:`loads`)."""
    lines = [
        f"# {sched.describe()}",
        f"name: {sched.name}",
        "stages: " + " ".join(str(r) for r in sched.stage_to_rank),
        f"microbatches: {sched.num_microbatches}",
        f"ranks: {sched.num_ranks}",
    ]
    lines += [f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(sched.actions)]
    return "\n".join(lines) + "\n"


def _int(val: str, key: str, where: str) -> int:
    try:
        return int(val)
    except ValueError:
        raise StratumError(f"{where}: {key} must be an integer, got {val!r}") from None


def loads(text: str, *, source: str = "<text>", check: bool = True) -> Schedule:
    """Parse the text format; with ``check`` (default) also :func:`validate` the result."""
    header: dict[str, str] = {}
    rank_actions: dict[int, list[Action]] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{n}"
        mt = re.fullmatch(r"rank\s+(\d+)\s*:(.*)", line)
        if mt:
            r = int(mt.group(1))
            try:
                acts = [Action.parse(tok) for tok in re.split(r"[,\s]+", mt.group(2).strip()) if tok]
            except StratumError as e:
                raise StratumError(f"{where}: {e}") from None
            rank_actions.setdefault(r, []).extend(acts)
            continue
        key, sep, val = line.partition(":")
        key = key.strip().lower()
        if not sep or key not in ("name", "stages", "microbatches", "ranks"):
            raise StratumError(f"{where}: cannot read {raw.strip()!r}; expected 'name:', 'stages:', "
                               "'microbatches:', 'ranks:' or 'rank N: actions...'")
        if key in header:
            raise StratumError(f"{where}: '{key}:' given twice")
        header[key] = val.strip()
    for key in ("stages", "microbatches"):
        if key not in header:
            raise StratumError(f"{source}: missing '{key}:' line")
    stages = [_int(x, "stages", source) for x in header["stages"].replace(",", " ").split()]
    if not stages:
        raise StratumError(f"{source}: 'stages:' lists no stage")
    n_ranks = _int(header["ranks"], "ranks", source) if "ranks" in header else max(stages) + 1
    extra = sorted(r for r in rank_actions if r >= n_ranks)
    if extra:
        raise StratumError(f"{source}: actions given for rank(s) {extra}, but there are {n_ranks} ranks")
    sched = Schedule(name=header.get("name") or "custom", stage_to_rank=stages,
                     num_microbatches=_int(header["microbatches"], "microbatches", source),
                     actions=[rank_actions.get(r, []) for r in range(n_ranks)])
    if check:
        validate(sched)
    return sched


def save(sched: Schedule, path: str | os.PathLike) -> None:
    """Write the schedule in the text format, atomically."""
    atomic_write_text(path, dumps(sched))


def load(path: str | os.PathLike) -> Schedule:
    """Read and validate a schedule file."""
    p = Path(path)
    if p.is_dir():
        raise StratumError(f"schedule file {p} is a directory; name the schedule's text file in it")
    if not p.is_file():
        raise StratumError(f"schedule file {p} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise StratumError(f"schedule file {p} is not UTF-8 text") from None
    return loads(text, source=str(p))
