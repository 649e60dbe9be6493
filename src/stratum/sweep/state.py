"""The sweep's state in SQLite (``<sweep dir>/state.db``): jobs, attempts, status, results, ASHA rung metrics.

Every change is one transaction, so a sweep killed at any point (even ``kill -9``) finds on restart exactly what
had been recorded: finished jobs stay finished; a job recorded as running had its process die with the sweep and
goes back to pending, to resume from its own last checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stratum.errors import StratumError

PENDING, RUNNING, PAUSED, DONE, STOPPED, FAILED = "pending", "running", "paused", "done", "stopped", "failed"
FINAL = (DONE, STOPPED, FAILED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, idx INTEGER NOT NULL, label TEXT NOT NULL, status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0, step INTEGER NOT NULL DEFAULT 0, steps INTEGER NOT NULL,
    loss REAL, eval_loss REAL, tokens_per_s REAL, slot INTEGER, reason TEXT NOT NULL DEFAULT '',
    run_s REAL NOT NULL DEFAULT 0, pid INTEGER, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS rungs (
    job TEXT NOT NULL, step INTEGER NOT NULL, metric REAL NOT NULL, PRIMARY KEY (job, step));
"""


@dataclass(kw_only=True)
class JobRow:
    """One job's recorded state."""

    id: str
    """Job id (its directory under jobs/)."""
    idx: int
    """Position in the sweep."""
    label: str
    """The swept values, short."""
    status: str
    """pending, running, paused (at an ASHA rung), done, stopped (by ASHA) or failed."""
    attempts: int
    """Attempts that failed so far (retries used)."""
    step: int
    """Steps completed (as of its last recorded segment)."""
    steps: int
    """train.steps of the job."""
    loss: float | None
    """Last training loss."""
    eval_loss: float | None
    """Last eval loss."""
    tokens_per_s: float | None
    """Median training throughput of its last segment."""
    slot: int | None
    """Slot it runs (or last ran) on."""
    reason: str
    """Why it failed or stopped (empty otherwise)."""
    run_s: float
    """Wall seconds spent running it, over all attempts."""
    pid: int | None
    """Process id of its worker while it runs (to find it, and to wait for it after the sweep was killed)."""


class SweepState:
    """Open (or create) ``state.db`` in the sweep directory."""

    def __init__(self, sweep_dir: Path):
        self.path = sweep_dir / "state.db"
        try:
            sweep_dir.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: each `with self._tx()` is one explicit transaction; any thread may use it,
            # one at a time (a sharded-lrtf worker's job threads, under its rung board's lock)
            self._db = sqlite3.connect(self.path, isolation_level=None, timeout=30.0, check_same_thread=False)
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as e:
            if isinstance(e, sqlite3.OperationalError):  # (cannot open, read-only, locked: the place, not the file)
                raise StratumError(f"cannot open the sweep state {self.path} ({e}); choose a writable "
                                   "sweep.out_dir") from None
            raise StratumError(f"the sweep state {self.path} is damaged ({e}); restore it from a copy, or remove "
                               "it to start the sweep's bookkeeping afresh (the jobs' own checkpoints stay)") \
                from None
        except OSError as e:
            raise StratumError(f"cannot open the sweep state {self.path} ({e}); choose a writable sweep.out_dir") \
                from None

    @classmethod
    def read_only(cls, sweep_dir: Path) -> SweepState:
        """The state of an existing sweep, opened for reading (``stratum sweep status``: nothing is created or
        written); a file that is not a sweep's state is a one-line error."""
        path = sweep_dir / "state.db"
        state = cls.__new__(cls)
        state.path = path
        try:
            state._db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30.0,
                                        check_same_thread=False)
            tables = {r[0] for r in state._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except (OSError, sqlite3.Error) as e:
            raise StratumError(f"{path} is not a sweep's state ({e}); give the sweep's sweep.out_dir") from None
        if not {"meta", "jobs", "rungs"} <= tables:
            state.close()
            raise StratumError(f"{path} is not a sweep's state (no jobs table); give the sweep's sweep.out_dir")
        return state

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # ---- meta ---------------------------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    # ---- jobs ---------------------------------------------------------------------------------------------
    def add_jobs(self, jobs: list[tuple[str, int, str, int]]) -> None:
        """Record (id, index, label, steps) of every job as pending; jobs already recorded are left as they are."""
        now = time.time()
        with self._tx() as db:
            db.executemany("INSERT OR IGNORE INTO jobs (id, idx, label, status, steps, updated) "
                           "VALUES (?, ?, ?, 'pending', ?, ?)", [(*j, now) for j in jobs])

    def jobs(self) -> list[JobRow]:
        cols = ", ".join(JobRow.__dataclass_fields__)
        rows = self._db.execute(f"SELECT {cols} FROM jobs ORDER BY idx").fetchall()
        return [JobRow(**dict(zip(JobRow.__dataclass_fields__, r))) for r in rows]

    def job(self, job_id: str) -> JobRow:
        return next(j for j in self.jobs() if j.id == job_id)

    def update(self, job_id: str, **values) -> None:
        """Set some columns of one job, in one transaction."""
        bad = set(values) - set(JobRow.__dataclass_fields__)
        assert not bad, bad
        sets = ", ".join(f"{k} = ?" for k in values)
        with self._tx() as db:
            db.execute(f"UPDATE jobs SET {sets}, updated = ? WHERE id = ?", (*values.values(), time.time(), job_id))

    def requeue_interrupted(self) -> dict[str, int | None]:
        """Jobs recorded as running when the sweep process died: back to pending (they resume from their own
        checkpoints). Returns their ids and the pids their workers had."""
        with self._tx() as db:
            rows = dict(db.execute("SELECT id, pid FROM jobs WHERE status = 'running'").fetchall())
            db.execute("UPDATE jobs SET status = 'pending', slot = NULL, pid = NULL WHERE status = 'running'")
        return rows

    def reset_failed(self) -> list[str]:
        """Failed jobs back to pending with their retries restored (``stratum sweep --retry-failed``, after the
        cause is fixed); they resume from their last checkpoints. Returns their ids."""
        with self._tx() as db:
            ids = [r[0] for r in db.execute("SELECT id FROM jobs WHERE status = 'failed' ORDER BY idx").fetchall()]
            db.execute("UPDATE jobs SET status = 'pending', attempts = 0, reason = '' WHERE status = 'failed'")
        return ids

    # ---- ASHA rungs -----------------------------------------------------------------------------------------
    def add_rung(self, job_id: str, rung: int, metric: float, **job_values) -> None:
        """Record a job's metric at a rung and, in the same transaction, its new column values (status …)."""
        sets = "".join(f"{k} = ?, " for k in job_values)
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO rungs VALUES (?, ?, ?)", (job_id, rung, metric))
            db.execute(f"UPDATE jobs SET {sets}updated = ? WHERE id = ?", (*job_values.values(), time.time(), job_id))

    def rungs(self) -> list[tuple[str, int, float]]:
        return self._db.execute("SELECT job, step, metric FROM rungs ORDER BY rowid").fetchall()


def spec_fingerprint(job_overrides: dict[str, list[str]], base_overrides: list[str]) -> str:
    """What identifies a sweep's jobs: a resumed sweep must have the same ones."""
    return json.dumps({"jobs": job_overrides, "base": base_overrides}, sort_keys=True)
