"""The shard worker's slot scheduler on its own: grants by longest remaining time, ties to sweep order, each job on
its own device's slots; a device holds its running tasks' memory, one staged job's, and what its capacity leaves
room for; and its job threads' dropout draws, each its own beside the others."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

import pytest
import torch

from stratum.model.neutral import neutral
from stratum.model.streams import block_stream, thread_draws_nothing
from stratum.sweep.ray_backend import actor_devices
from stratum.sweep.shard_lrtf import pick_longest
from stratum.sweep.shard_worker import UNLIMITED, DeviceMemory, SlotScheduler, job_stream


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


class _Device:
    """Which jobs hold slot memory on each device, checked on every change: at most its slots + 1 (one staged)."""

    def __init__(self, slots: dict[str, int]):
        self.slots, self.holding = slots, {d: set() for d in slots}
        self.lock, self.worst = threading.Lock(), dict.fromkeys(slots, 0)

    def hold(self, device: str, job: str, holds: bool) -> None:
        with self.lock:
            (self.holding[device].add if holds else self.holding[device].discard)(job)
            self.worst[device] = max(self.worst[device], len(self.holding[device]))


class _Turn:
    """An engine's turn as the scheduler sees it: vacate gives its slots back, a stage or a task takes them."""

    def __init__(self, job: str, ledger: _Device):
        self.job, self.ledger = job, ledger
        self.device = ""
        self.vacates = self.stages = 0

    def stage_next(self) -> int:
        self.stages += 1
        self.ledger.hold(self.device, self.job, True)
        time.sleep(0.001)
        return 1

    def vacate(self) -> int:
        self.vacates += 1
        self.ledger.hold(self.device, self.job, False)
        time.sleep(0.001)
        return 100

    def device_bytes(self) -> int:
        return 100 if self.job in self.ledger.holding[self.device] else 0


@pytest.mark.parametrize("room", [0, 1, None], ids=["no-room", "room-for-one", "no-limit"])
def test_a_training_job_keeps_to_its_device_and_a_device_holds_what_its_memory_allows(tmp_path, room):
    """Slots on devices a (1) and b (2): a job's training takes any device's slot first and that device's from then
    on; each job trains twice (an ASHA rung's end between), and may start its second training on the other device;
    every grant is the rule's among the jobs that may take that slot. Each job holds 100 bytes (its budget) while
    it has not given back, and a device may hold (its slots + 1 + ``room``) × 100: at most its slots + 1 jobs
    hold memory on it at any time with no room, one more with room for one, and without a limit nobody gives back."""
    devices = ["a", "b", "b"]
    tasks = {"j0": 6, "j1": 4, "j2": 3, "j3": 6, "j4": 5, "j5": 2, "j6": 4}
    order = list(tasks)
    ledger = _Device({"a": 1, "b": 2})
    memory = UNLIMITED if room is None else DeviceMemory(
        capacity=[(devices.count(d) + 1 + room) * 100 for d in devices], budget=100)
    sched = SlotScheduler(slots=3, order=order, tasks_path=tmp_path / "tasks.jsonl", devices=devices, memory=memory)
    turns = {j: _Turn(j, ledger) for j in tasks}
    ran: dict[str, list[list[str]]] = {j: [] for j in tasks}

    def training(j: str, n: int) -> None:
        turn = turns[j]
        turn.device = devices[sched.acquire(j, float(n))]
        ran[j].append([turn.device])
        for k in range(n - 1, -1, -1):
            ledger.hold(turn.device, j, True)  # its task runs: its slots in use
            time.sleep(0.002)
            if k:
                ran[j][-1].append(devices[sched.acquire(j, float(k), turn)])
        ledger.hold(turn.device, j, False)  # (its training ends: its engine is gone)

    def job(j: str) -> None:
        training(j, tasks[j])
        sched.release(j)  # (as at an ASHA rung)
        training(j, 2)
        sched.finish(j)

    threads = [threading.Thread(target=job, args=(j,)) for j in tasks]
    for t in threads:
        t.start()
    sched.open_when_waiting(len(tasks))
    for t in threads:
        t.join(timeout=30)
    sched.close()
    records = [json.loads(ln) for ln in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    grants = [r for r in records if "remaining" in r]
    assert len(grants) == sum(tasks.values()) + 2 * len(tasks)
    for j, trainings in ran.items():
        assert [len(t) for t in trainings] == [tasks[j], 2] and all(len(set(t)) == 1 for t in trainings), j
    for g in grants:
        assert g["job"] == pick_longest(g["remaining"], order)
    vacates = sum(t.vacates for t in turns.values())
    kept = [r for r in records if "keep" in r or "unstage_keep" in r]
    assert sum(t.stages for t in turns.values()) > 0
    if room is None:
        assert vacates == 0 and kept
        return
    assert ledger.worst["a"] <= 2 + room and ledger.worst["b"] <= 3 + room  # its slots, one staged, the room
    assert vacates > 0
    assert (room > 0) == any(r.get("keep", r.get("unstage_keep")) for r in kept)  # (with room: some kept 100)


DEV = torch.device(os.environ.get("STRATUM_TEST_DEVICE", "cpu"))


def test_each_job_thread_computes_on_a_stream_of_its_own():
    """On a GPU (STRATUM_TEST_DEVICE=cuda) two job threads' kernels go to two streams of their own, neither the
    default stream, and each thread's result is its own; on a CPU nothing changes."""
    if DEV.type != "cuda":
        assert isinstance(job_stream(DEV), contextlib.nullcontext)
        return
    seen: dict[int, tuple[int, float]] = {}

    def job(i: int) -> None:
        with job_stream(DEV):
            x = torch.full((256, 256), float(i + 1), device=DEV)
            seen[i] = (torch.cuda.current_stream(DEV).cuda_stream, float((x @ x).sum().item()))

    threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    default = torch.cuda.default_stream(DEV).cuda_stream
    assert seen[0][0] != seen[1][0] and default not in (seen[0][0], seen[1][0])
    assert [v for _, v in (seen[0], seen[1])] == [256.0 ** 3 * (i + 1) ** 2 for i in range(2)]


def test_a_ray_worker_knows_its_gpus_from_0_in_the_order_named():
    assert actor_devices(["cuda:2", "cuda:2", "cuda:5", "cpu"]) == ["cuda:0", "cuda:0", "cuda:1", "cpu"]
    assert actor_devices(["cpu", "cpu"]) == ["cpu", "cpu"]
