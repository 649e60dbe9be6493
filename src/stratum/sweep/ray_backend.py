"""The ``ray`` backend: each slot is a Ray actor (``num_cpus`` = the job's threads, one GPU for a CUDA slot) that
runs segments with the same body as a local worker (:func:`~stratum.sweep.segment.run_segment`).

``ray.init()`` starts a local Ray instance, or joins ``sweep.ray_address``'s cluster — Ray is the distributed
engine; Stratum only asks it for actors. The sweep directory must be on a filesystem every node sees (jobs
write their run directories there). Ray is an optional extra (``pip install 'stratum[ray]'``), imported only
when this backend is chosen. The actors are owned by the sweep process: if it dies, Ray ends them.

A segment asked to stop gets SIGTERM when its actor runs on this machine (the trainer checkpoints after its step);
elsewhere its actor is killed and the job resumes from its last checkpoint. A dead actor is reported as a dead
worker and replaced at the slot's next segment.

A job whose plan holds k slots (``replicate(k)``, ``pipeline(k)``) runs one rank on each of its slots' actors,
as Ray Train forms a process group: every actor starts ``stratum train --config job.toml`` with the torchrun
variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of rank 0's actor, which picks a free port
on its node), so the ranks may sit on different nodes and each uses the CPUs its slot reserved. A rank that
fails ends the others (their actors are killed; the attempt fails and is retried from its checkpoint, as on the
local backend); the plan's own time limits stop ranks that wait on a dead one.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stratum.dist.launch import rank_env
from stratum.errors import StratumError
from stratum.sweep.launched import device_kind, job_env, train_command
from stratum.sweep.segment import Segment, run_segment
from stratum.sweep.shard_worker import run_shard_worker

PLACE_TIMEOUT_S = 120.0
RELEASE_TIMEOUT_S = 30.0


def actor_devices(devices: list[str]) -> list[str]:
    """``devices`` as a process sees them that was given only their distinct GPUs, in order of first naming: the
    k-th distinct CUDA device becomes cuda:k (CPU slots stay)."""
    gpus = list(dict.fromkeys(d for d in devices if d.startswith("cuda")))
    return [f"cuda:{gpus.index(d)}" if d in gpus else d for d in devices]


class SlotActor:
    """The process behind one slot (made a Ray actor class by :class:`RayBackend`)."""

    def where(self) -> tuple[int, str]:
        """Its pid and Ray node id."""
        ray = importlib.import_module("ray")
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def run(self, config_path: str, stop_at: int, device: str | None, threads: int, log_path: str) -> int:
        return run_segment(config_path, stop_at, device, threads, log_path)

    def run_shards(self, spec_path: str) -> int:
        """sharded-lrtf's worker (an actor holding every slot's CPUs): its jobs' threads interleaved in it."""
        run_shard_worker(spec_path)
        return 0

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a port free on it: where rank 0 of a plan over several slots listens."""
        ray = importlib.import_module("ray")
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def run_rank(self, config_path: str, stop_at: int, threads: int, log_path: str, rank: int, world: int,
                 master: tuple[str, int], sets: list[str]) -> int:
        """Rank ``rank`` of ``world`` of the job's plan, as torchrun starts one (with ``--set`` ``sets``); its exit
        code. SIGTERM to this actor reaches the rank (it checkpoints after its step and exits). Its local rank is
        0: on a GPU slot its GPU is the actor's only visible one, cuda:0."""
        env = dict(job_env(threads), **rank_env(rank, world, local_rank=0, local_world=1, master=master))
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(train_command(config_path, stop_at, sets), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env)
        previous = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
        try:
            return proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
            if proc.poll() is None:  # (the actor is being killed: the rank goes with it)
                proc.kill()


def _join(worker: RayWorker | RayRanks, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for ``worker`` to end (Ray reports it through polls)."""
    deadline = time.monotonic() + timeout_s
    while worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


class RayWorker:
    """A call running on an actor — a segment on a slot's actor, or sharded-lrtf's worker on its own (the runner's
    :class:`~stratum.sweep.segment.Worker`). A stop request reaches an actor on this machine as SIGTERM (the
    trainer, or every job of the shard worker, checkpoints and exits); one elsewhere is killed, and its jobs
    resume from their last checkpoints."""

    def __init__(self, ray, actor, ref, pid: int | None, on_death: Callable[[], None] | None = None):
        self.ray, self.actor, self.ref, self.pid = ray, actor, ref, pid
        self.sentinel: int | None = None  # (a call's end is known by asking Ray: polled)
        self.on_death = on_death
        """What the backend does when the actor (its process) died: forget a slot's actor, to replace it."""
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is None and self.ray.wait([self.ref], timeout=0)[0]:
            try:
                self._code = self.ray.get(self.ref)
            except self.ray.exceptions.RayError:  # the actor (its process) died
                self._code = -signal.SIGKILL
                if self.on_death is not None:
                    self.on_death()
        return self._code

    def terminate(self) -> None:
        if self.poll() is None:
            if self.pid is not None:
                os.kill(self.pid, signal.SIGTERM)
            else:
                self.kill()

    def kill(self) -> None:
        if self.poll() is None:
            self.ray.kill(self.actor)

    def join(self, timeout_s: float) -> None:
        _join(self, timeout_s)


class RayRanks:
    """The ranks of a plan over several slots, one on each slot's actor (the runner's
    :class:`~stratum.sweep.segment.Worker`): its exit code is the first failing rank's, 0 when all succeed; a
    failing rank ends the others."""

    def __init__(self, backend: RayBackend, slots: tuple[int, ...], refs: list, pids: list[int | None]):
        self.ranks = [backend.slot_call(slot, ref, pid) for slot, ref, pid in zip(slots, refs, pids)]
        self.pid: int | None = pids[0]
        self.sentinel: int | None = None

    def poll(self) -> int | None:
        codes = [r.poll() for r in self.ranks]
        failed = next((c for c in codes if c not in (None, 0)), None)
        if failed is not None:
            self.kill()  # the others would wait for it until the plan's time limits
            return failed
        return None if None in codes else 0

    def terminate(self) -> None:
        for r in self.ranks:
            r.terminate()

    def kill(self) -> None:
        for r in self.ranks:
            r.kill()

    def join(self, timeout_s: float) -> None:
        _join(self, timeout_s)


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
        self.shard: tuple[Any, int] | None = None
        """sharded-lrtf's worker actor and its CPUs, while it holds them."""
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
            pid = self._placed(actor, f"slot {slot}'s worker ({self.threads} CPU, {gpus} GPU)", "the cluster lacks "
                               "the resources for sweep.slots")
            self.actors[slot] = (actor, pid)
        return self.actors[slot]

    def _placed(self, actor, what: str, why: str) -> int | None:
        """Wait until Ray has placed ``actor``; its pid where it runs on this machine, None elsewhere."""
        try:
            pid, node = self.ray.get(actor.where.remote(), timeout=PLACE_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            self.ray.kill(actor)
            raise StratumError(f"Ray could not place {what} within {PLACE_TIMEOUT_S:g} s: {why}; lower sweep.slots "
                               "or sweep.threads_per_job") from None
        return pid if node == self.ray.get_runtime_context().get_node_id() else None

    def slot_call(self, slot: int, ref, pid: int | None) -> RayWorker:
        """``ref``, a call on the slot's actor, as a worker; the actor is replaced if it dies."""
        return RayWorker(self.ray, self.actors[slot][0], ref, pid, on_death=lambda: self.forget(slot))

    def forget(self, slot: int) -> None:
        """The slot's actor died: a new one serves its next segment."""
        self.actors.pop(slot, None)

    def start(self, *, job: str, slots: tuple[int, ...], config_path: Path, start_step: int, stop_at: int,
              devices: tuple[str, ...] | None, threads: int, log_path: Path, slice_steps: int) -> Segment:
        assert not slice_steps  # (spec.py refuses slice_by = pause on Ray: a paused actor holds its slot)
        worker: RayWorker | RayRanks
        if len(slots) > 1:
            worker = self._start_ranks(slots, config_path, stop_at, threads, log_path, devices)
        else:
            actor, pid = self._actor(slots[0])
            device = devices[0] if devices else None
            if device is not None and device.startswith("cuda"):
                device = "cuda"  # Ray gives the actor its GPU as the only visible one
            ref = actor.run.remote(str(config_path), stop_at, device, threads, str(log_path))
            worker = self.slot_call(slots[0], ref, pid)
        return Segment(job=job, slot=slots[0], start_step=start_step, stop_at=stop_at, worker=worker,
                       log_path=log_path, started=time.monotonic())

    def _start_ranks(self, slots: tuple[int, ...], config_path: Path, stop_at: int, threads: int,
                     log_path: Path, devices: tuple[str, ...] | None) -> RayRanks:
        """One rank of the job's plan on each slot's actor (on its slot's device where ``devices`` name them),
        joined at rank 0's actor's node."""
        sets = device_kind(devices) if devices else []
        actors = [self._actor(slot) for slot in slots]
        try:
            master = self.ray.get(actors[0][0].rendezvous.remote(), timeout=PLACE_TIMEOUT_S)
        except self.ray.exceptions.RayError as e:
            raise StratumError(f"slot {slots[0]}'s Ray worker did not answer ({type(e).__name__}); the sweep "
                               "stops") from None
        refs = [a.run_rank.remote(str(config_path), stop_at, threads, str(log_path), rank, len(slots), master, sets)
                for rank, (a, _) in enumerate(actors)]
        return RayRanks(self, slots, refs, [pid for _, pid in actors])

    def start_shard_worker(self, spec_path: Path, cpus: int, gpus: int) -> RayWorker:
        """sharded-lrtf's worker as one actor with ``cpus`` CPUs and ``gpus`` GPUs (the slots' actors are released
        first: the worker takes their CPUs)."""
        self.close()
        actor = self._actor_cls.options(num_cpus=cpus, num_gpus=gpus, max_restarts=0).remote()
        self.shard = (actor, cpus)
        pid = self._placed(actor, f"sharded-lrtf's worker ({cpus} CPUs, {gpus} GPUs on one node)", "it runs every "
                           "slot in one process")
        return RayWorker(self.ray, actor, actor.run_shards.remote(str(spec_path)), pid)

    def worker_devices(self, devices: list[str]) -> list[str]:
        """Ray gives the worker's actor its GPUs as the only visible ones, numbered from 0: the k-th CUDA device
        named in ``devices`` is its cuda:k (:func:`actor_devices`)."""
        return actor_devices(devices)

    def close(self) -> None:
        """Kill the actors and wait (bounded) until Ray has their CPUs back: a sweep started next in this
        process asks for them at once, and an actor asked for while its resources are still held waits for
        Ray's retry of pending placements, far longer than the release takes."""
        held = self.threads * len(self.actors) + (self.shard[1] if self.shard else 0)
        for actor, _ in self.actors.values():
            self.ray.kill(actor)
        self.actors.clear()
        if self.shard:
            self.ray.kill(self.shard[0])
            self.shard = None
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        while self.ray.available_resources().get("CPU", 0.0) < held and time.monotonic() < deadline:
            time.sleep(0.1)
