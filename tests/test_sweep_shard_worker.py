"""The shard worker's slot scheduler on its own: grants by longest remaining time, ties to sweep order."""

from __future__ import annotations

import json
import threading

from stratum.sweep.shard_worker import SlotScheduler


def test_times_equal_to_the_microsecond_tie_to_sweep_order(tmp_path):
    sched = SlotScheduler(slots=1, order=["j000", "j001", "j002"], tasks_path=tmp_path / "tasks.jsonl")
    got: dict[str, int] = {}

    def wait(job: str, remaining: float) -> None:
        got[job] = sched.acquire(job, remaining)
        sched.release(job)

    # j001's time is j000's split into tasks with other float rounding; j002's is a microsecond shorter
    threads = [threading.Thread(target=wait, args=a) for a in
               [("j002", 0.2999990), ("j001", 0.30000000000000004), ("j000", 0.3)]]
    for t in threads:
        t.start()
    sched.open_when_waiting(3)
    for t in threads:
        t.join(timeout=10)
    sched.close()
    grants = [json.loads(ln) for ln in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert [g["job"] for g in grants] == ["j000", "j001", "j002"]
    assert grants[0]["remaining"] == {"j000": 0.3, "j001": 0.3, "j002": 0.299999}
    assert got == {"j000": 0, "j001": 0, "j002": 0}
