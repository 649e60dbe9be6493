"""The shard worker's slot scheduler on its own: grants by longest remaining time, ties to sweep order, each job on
its own device's slots; a device holds its running tasks' memory, one staged job's, and what its capacity leaves
room for."""

from __future__ import annotations

import json
import threading
import time

import pytest

from stratum.sweep.shard_lrtf import pick_longest
from stratum.sweep.slot_scheduler import UNLIMITED, DeviceMemory, SlotScheduler


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
