"""Job traces: the CSV a cluster simulation replays, loaded with one-line errors, written atomically.

Format (UTF-8 CSV, a header row, one job a row, ``#`` lines are comments)::

    job,arrival_s,model,batch,steps,devices,priority,max_batch,seq_len
    fg,0,gpt2-1.5b,64,1000,64,foreground,,
    j1,12.5,gpt2-124m,32,2000,4,background,128,1024

=========== ======== ==============================================================================================
column      required meaning
=========== ======== ==============================================================================================
job         yes      a unique name
arrival_s   yes      seconds from the trace's start when the job is submitted (0 to 1e9)
model       yes      a GPT preset (``gpt2-124m`` … ``gpt2-1.5b``, ``gpt-2.7b`` …; ``stratum config`` lists them)
batch       yes      global batch, sequences per optimizer step (>= devices: data parallelism splits it)
steps       yes      optimizer steps at ``batch``; the job's work is batch × steps sequences
devices     yes      devices the job asks for (static-dp and burst give it exactly these)
priority    no       ``foreground`` or ``background`` (default); burst policies plan foreground jobs only
max_batch   no       the largest global batch the job accepts (default ``batch``); ``elastic`` may grow the batch
                     up to it, keeping the work (sequences) fixed, as Saxena et al. let the user bound it
seq_len     no       tokens per sequence (default 1024; at most the model's context)
=========== ======== ==============================================================================================
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from stratum.atomic import atomic_write_text
from stratum.errors import StratumError

REQUIRED = ("job", "arrival_s", "model", "batch", "steps", "devices")
MAX_ARRIVAL_S = 1e9
"""Later arrivals are refused: a float clock of 1e9 s still resolves microseconds; at 1e300 a job's whole run is
below its resolution and would end as it starts."""
OPTIONAL = ("priority", "max_batch", "seq_len")
PRIORITIES = ("foreground", "background")
DEFAULT_SEQ_LEN = 1024


@dataclass(frozen=True, kw_only=True)
class Job:
    """One training job of a trace (see the module for the columns)."""

    id: str
    """Unique name."""
    arrival_s: float
    """Submission time, seconds from the trace's start."""
    model: str
    """GPT preset."""
    batch: int
    """Global batch, sequences per step."""
    steps: int
    """Optimizer steps at ``batch``."""
    devices: int
    """Devices asked for."""
    priority: str = "background"
    """``foreground`` or ``background``."""
    max_batch: int = 0
    """Largest global batch accepted (0: ``batch``)."""
    seq_len: int = DEFAULT_SEQ_LEN
    """Tokens per sequence."""

    @property
    def work(self) -> int:
        """Sequences the job trains on: batch × steps."""
        return self.batch * self.steps

    @property
    def batch_limit(self) -> int:
        return self.max_batch or self.batch

    @property
    def foreground(self) -> bool:
        return self.priority == "foreground"


def _number(text: str, where: str, column: str, kind: type) -> float:
    try:
        val = kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise StratumError(f"{where}: {column} = {text!r} is not {what}") from None
    if isinstance(val, float) and not math.isfinite(val):
        raise StratumError(f"{where}: {column} = {text!r} is not finite")
    if val < 0:
        raise StratumError(f"{where}: {column} = {text!r} is negative")
    return val


def _job(row: dict[str, str], where: str, models: Collection[str], devices: int) -> Job:
    get = {k: (row.get(k) or "").strip() for k in REQUIRED + OPTIONAL}
    for k in REQUIRED:
        if not get[k]:
            raise StratumError(f"{where}: {k} is empty")
    if get["model"] not in models:
        raise StratumError(f"{where}: unknown model {get['model']!r}; choose one of: {', '.join(models)}")
    prio = get["priority"] or "background"
    if prio not in PRIORITIES:
        raise StratumError(f"{where}: priority {prio!r} is neither foreground nor background")
    ints = {k: int(_number(get[k], where, k, int)) for k in ("batch", "steps", "devices")}
    for k, v in ints.items():
        if v < 1:
            raise StratumError(f"{where}: {k} must be >= 1, got {v}")
    if ints["devices"] > devices:
        raise StratumError(f"{where}: job {get['job']!r} asks for {ints['devices']} devices but the cluster has "
                           f"{devices}")
    if ints["batch"] < ints["devices"]:
        raise StratumError(f"{where}: batch {ints['batch']} < devices {ints['devices']}: data parallelism needs "
                           "a sequence per device")
    max_batch = int(_number(get["max_batch"], where, "max_batch", int)) if get["max_batch"] else 0
    if max_batch and max_batch < ints["batch"]:
        raise StratumError(f"{where}: max_batch {max_batch} < batch {ints['batch']}")
    seq_len = int(_number(get["seq_len"], where, "seq_len", int)) if get["seq_len"] else DEFAULT_SEQ_LEN
    if seq_len < 1:
        raise StratumError(f"{where}: seq_len must be >= 1")
    arrival = _number(get["arrival_s"], where, "arrival_s", float)
    if arrival > MAX_ARRIVAL_S:
        raise StratumError(f"{where}: arrival_s = {get['arrival_s']} is past the simulator's horizon of "
                           f"{MAX_ARRIVAL_S:.0e} s (~30 years), where its clock loses whole steps")
    return Job(id=get["job"], arrival_s=arrival, model=get["model"],
               priority=prio, max_batch=max_batch, seq_len=seq_len, **ints)


def parse_trace(text: str, *, models: Collection[str], devices: int, name: str = "trace") -> list[Job]:
    """The jobs of a trace's CSV ``text`` in arrival order (ties keep file order); ``models`` are the names a row
    may use, ``devices`` the cluster's size."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    if not any(ln.strip() for ln in lines):
        raise StratumError(f"{name} is empty; it needs a header row ({','.join(REQUIRED)}) and a job a row")
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    header = [h.strip() for h in reader.fieldnames or []]
    if twice := sorted({h for h in header if header.count(h) > 1}):
        raise StratumError(f"{name}: column {twice[0]!r} appears twice in the header")
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise StratumError(f"{name}: missing column(s) {', '.join(missing)}; the header needs {','.join(REQUIRED)}")
    unknown = [c for c in header if c not in REQUIRED + OPTIONAL]
    if unknown:
        raise StratumError(f"{name}: unknown column(s) {', '.join(unknown)}; known: {','.join(REQUIRED + OPTIONAL)}")
    reader.fieldnames = header
    jobs, seen = [], set()
    for n, row in enumerate(reader, start=2):
        if None in row:
            raise StratumError(f"{name} row {n}: more fields than the header's {len(header)}")
        job = _job(row, f"{name} row {n}", models, devices)
        if job.id in seen:
            raise StratumError(f"{name} row {n}: job {job.id!r} appears twice")
        seen.add(job.id)
        jobs.append(job)
    if not jobs:
        raise StratumError(f"{name} has a header but no jobs")
    return sorted(jobs, key=lambda j: j.arrival_s)


def load_trace(path: str | os.PathLike, *, models: Collection[str], devices: int) -> list[Job]:
    """:func:`parse_trace` of the file at ``path``."""
    try:
        text = open(path, encoding="utf-8-sig").read()  # (-sig: the byte-order mark a spreadsheet's CSV starts with)
    except (OSError, UnicodeDecodeError) as e:
        raise StratumError(f"cannot read the trace {os.fsdecode(path)!r} ({getattr(e, 'strerror', None) or e})") \
            from None
    return parse_trace(text, models=models, devices=devices, name=f"trace {os.fsdecode(path)}")


def format_trace(jobs: Sequence[Job]) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(REQUIRED + OPTIONAL)
    for j in jobs:
        w.writerow([j.id, f"{j.arrival_s:.3f}", j.model, j.batch, j.steps, j.devices, j.priority,
                    j.max_batch or "", j.seq_len])
    return out.getvalue()


def write_trace(path: str | os.PathLike, jobs: Sequence[Job]) -> None:
    atomic_write_text(path, format_trace(jobs))
