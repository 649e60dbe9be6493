"""The shard worker's slot scheduler on its own: grants by longest remaining time, ties to sweep order; and its
job threads' dropout draws, each its own beside the others."""

from __future__ import annotations

import json
import threading
import time

import torch

from stratum.model.neutral import neutral
from stratum.model.streams import block_stream, thread_draws_nothing
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


def _draw_blocks(stream: int, blocks: int, quiet: bool, out: list, start: threading.Barrier | None) -> None:
    """A job thread's block forwards, each drawing twice with a thread switch between (``quiet``: a model without
    dropout, which draws nothing), and a recompute's fork after each."""
    if quiet:
        thread_draws_nothing()
    if start is not None:
        start.wait()
    for k in range(blocks):
        with block_stream(stream, k, torch.device("cpu")):
            a = torch.rand(3) if not quiet else torch.zeros(3)
            time.sleep(0)  # another thread runs here
            out.append(torch.cat([a, torch.rand(3) if not quiet else torch.zeros(3)]))
        with neutral():
            time.sleep(0)


def test_job_threads_draw_the_masks_they_draw_alone():
    """Two drawing threads and a quiet one inside their blocks at once: each drawing thread's numbers are those
    it draws alone (the lock makes their forks exclusive; the quiet one forks nothing), and the global RNG is
    left as it was."""
    alone: dict[int, list] = {7: [], 8: []}
    for stream in alone:
        _draw_blocks(stream, 20, False, alone[stream], None)
    before = torch.get_rng_state()
    got: dict[int, list] = {7: [], 8: [], 9: []}
    start = threading.Barrier(3)
    threads = [threading.Thread(target=_draw_blocks, args=(s, 20, s == 9, got[s], start)) for s in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for stream in alone:
        assert torch.equal(torch.stack(got[stream]), torch.stack(alone[stream])), stream
    assert torch.equal(torch.get_rng_state(), before)
