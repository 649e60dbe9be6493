"""Per-step metrics: ``metrics.jsonl`` (one JSON object per step) and what the terminal shows."""

from __future__ import annotations

import contextlib
import json
import math
import statistics
from pathlib import Path

from stratum.atomic import atomic_write_text, write_error


class MetricsLog:
    """Appends one JSON line per step. On resume, records past the checkpoint (from a killed run) are dropped,
    so the file always describes one consistent run. Lines are strict JSON (what jq, JavaScript and other
    parsers read): a number that is not finite — an fp16 step's gradient norm when its loss scaler skipped it — is
    written as null."""

    def __init__(self, path: Path, *, resume_step: int):
        self.path = path
        kept: list[str] = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= resume_step:
                        kept.append(line)
                except json.JSONDecodeError:
                    break  # a torn last line from a kill: everything before it stands
            atomic_write_text(path, "".join(k + "\n" for k in kept))
        self.records = [json.loads(k) for k in kept]
        try:
            self._fh = path.open("a")
        except OSError as e:
            raise write_error(path, e, "metrics") from None

    def write(self, record: dict) -> None:
        self.records.append(record)
        try:
            self._fh.write(json.dumps(_strict(record), allow_nan=False) + "\n")
            self._fh.flush()
        except OSError as e:
            raise write_error(self.path, e, "metrics") from None

    def close(self) -> None:
        # a failed write has been reported already; its torn line is dropped on resume
        with contextlib.suppress(OSError):
            self._fh.close()


def _strict(record: dict) -> dict:
    """``record`` with its non-finite numbers as None (JSON has no NaN or infinity)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def median(records: list[dict], key: str, skip_first: int = 1) -> float | None:
    """Median of ``key`` over records, leaving out the first ``skip_first`` (warm-up) when there are more, and
    the records where it is null."""
    vals = [r[key] for r in records if r.get(key) is not None]
    if len(vals) > skip_first:
        vals = vals[skip_first:]
    return statistics.median(vals) if vals else None
