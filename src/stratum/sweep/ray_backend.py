"""The ``ray`` backend: each slot is a Ray actor (``num_cpus`` = the job's threads, one GPU for a CUDA slot) that
runs segments with the same body as a local worker (:func:`~stratum.sweep.segment.run_segment`).

``ray.init()`` starts a local Ray instance, or joins ``sweep.ray_address``'s cluster — Ray is the distributed
engine; Stratum only asks it for actors. The sweep directory must be on a filesystem every node sees (jobs
write their run directories there). Ray is an optional extra (``pip install 'stratum[ray]'``), imported only
when this backend is chosen. The actors are owned by the sweep process: if it dies, Ray ends them.

A segment asked to stop gets SIGTERM when its actor runs on this machine (the trainer checkpoints after its step);
elsewhere its actor is killed and the job resumes from its last checkpoint. A dead actor is reported as a dead
worker and replaced at the slot's next segment.

A job runs on one slot here: the planned scheduler offers only ``local`` on Ray, and ``sweep.plans`` naming a
strategy over several slots is a one-line error before the sweep starts (a k-slot job would need a placement
group of k bundles and the plan's process group formed across actors).
"""

from __future__ import annotations

import importlib
import os
import signal
import time
from pathlib import Path
from typing import Any

from stratum.errors import StratumError
from stratum.sweep.segment import Segment, run_segment

PLACE_TIMEOUT_S = 120.0


class SlotActor:
    """The process behind one slot (made a Ray actor class by :class:`RayBackend`)."""

    def where(self) -> tuple[int, str]:
        """Its pid and Ray node id."""
        ray = importlib.import_module("ray")
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def run(self, config_path: str, stop_at: int, device: str | None, threads: int, log_path: str) -> int:
        return run_segment(config_path, stop_at, device, threads, log_path)


class RayWorker:
    """A segment running on a slot's actor (the runner's :class:`~stratum.sweep.segment.Worker`)."""

    def __init__(self, backend: RayBackend, slot: int, ref, pid: int | None):
        self.backend = backend
        self.slot = slot
        self.ref = ref
        self.pid = pid
        self._code: int | None = None

    def poll(self) -> int | None:
        ray = self.backend.ray
        if self._code is None:
            ready, _ = ray.wait([self.ref], timeout=0)
            if ready:
                try:
                    self._code = ray.get(self.ref)
                except ray.exceptions.RayError:  # the actor (its process) died
                    self._code = -signal.SIGKILL
                    self.backend.forget(self.slot)
        return self._code

    def terminate(self) -> None:
        if self.poll() is None:
            if self.pid is not None:
                os.kill(self.pid, signal.SIGTERM)
            else:
                self.kill()

    def kill(self) -> None:
        if self.poll() is None:
            self.backend.ray.kill(self.backend.actors[self.slot][0])

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)


class RayBackend:
    """Slots as Ray actors, on a local Ray instance or the cluster at ``address``."""

    def __init__(self, *, address: str, slots: int, threads: int, gpu_slots: set[int]):
        try:
            self.ray = importlib.import_module("ray")  # optional extra: only this backend needs it
        except ImportError:
            raise StratumError("sweep.backend = \"ray\" needs Ray: pip install 'stratum[ray]' (or use the local "
                               "backend)") from None
        self.address = address
        self.threads = threads
        self.gpu_slots = gpu_slots
        self.actors: dict[int, tuple[Any, int | None]] = {}  # (Ray's handles are untyped)
        self._actor_cls: Any = None
        self.slots = slots

    def warm_up(self) -> None:
        if not self.ray.is_initialized():
            kwargs = {"address": self.address} if self.address else {"include_dashboard": False}
            self.ray.init(log_to_driver=False, **kwargs)
        self._actor_cls = self.ray.remote(SlotActor)
        for slot in range(self.slots):
            self._actor(slot)

    def _actor(self, slot: int) -> tuple[Any, int | None]:
        """The slot's actor, (re)created if it has none; its pid where it runs on this machine."""
        if slot not in self.actors:
            gpus = 1 if slot in self.gpu_slots else 0
            actor = self._actor_cls.options(num_cpus=self.threads, num_gpus=gpus, max_restarts=0).remote()
            try:
                pid, node = self.ray.get(actor.where.remote(), timeout=PLACE_TIMEOUT_S)
            except self.ray.exceptions.GetTimeoutError:
                self.ray.kill(actor)
                raise StratumError(f"Ray could not place slot {slot}'s worker ({self.threads} CPU, {gpus} GPU) "
                                   f"within {PLACE_TIMEOUT_S:g} s: the cluster lacks the resources for "
                                   "sweep.slots; lower sweep.slots or sweep.threads_per_job") from None
            here = node == self.ray.get_runtime_context().get_node_id()
            self.actors[slot] = (actor, pid if here else None)
        return self.actors[slot]

    def forget(self, slot: int) -> None:
        """The slot's actor died: a new one serves its next segment."""
        self.actors.pop(slot, None)

    def start(self, *, job: str, slot: int, config_path: Path, start_step: int, stop_at: int, device: str | None,
              threads: int, log_path: Path, processes: int = 1) -> Segment:
        if processes > 1:  # spec.py refuses sweep.plans over several slots on Ray before the sweep starts
            raise StratumError(f"{job}: the ray backend runs one slot per job, not a plan of {processes} processes")
        actor, pid = self._actor(slot)
        if device is not None and device.startswith("cuda"):
            device = "cuda"  # Ray gives the actor its GPU as the only visible one
        ref = actor.run.remote(str(config_path), stop_at, device, threads, str(log_path))
        return Segment(job=job, slot=slot, start_step=start_step, stop_at=stop_at,
                       worker=RayWorker(self, slot, ref, pid), log_path=log_path, started=time.monotonic())

    def close(self) -> None:
        for actor, _ in self.actors.values():
            self.ray.kill(actor)
        self.actors.clear()
