"""The process world a Plan needs: this rank's place in the mesh and its process groups, every one with a timeout.

The default group (all ranks) comes from :func:`stratum.dist.launch.init_process_group`; on it this module
creates one group per slice of the mesh along each dimension (replicas, pipeline ranks, splits). ``new_group`` is
collective — every rank must create every group, in the same order — so all of them are created here, up front,
from the plan alone, and a rank keeps the ones it belongs to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import pickle
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from stratum.dist import launch, roles
from stratum.dist.launch import from_backend, short_reason, wait_until
from stratum.errors import PeerError, StratumError
from stratum.ir.plan import Coord, Plan, ranges_text

DIMS = ("replica", "stage_rank", "split")
GATHER_TAG = 1 << 29
"""Tag of :meth:`World.gather_to_first`'s messages: apart from the pipeline runtime's and burst's own tags (gloo
matches a receive to a send by peer and tag)."""
_T = TypeVar("_T")


@dataclass
class World:
    """This rank's view of the plan's processes (see the module docstring)."""

    plan: Plan
    rank: int
    coord: Coord
    device: torch.device
    backend: str
    timeout_s: float
    groups: dict[str, object] = field(default_factory=dict)
    """Dimension → this rank's process group along it (absent where the dimension has one process)."""
    members: dict[str, list[int]] = field(default_factory=dict)
    """Dimension → the global ranks of that group, in mesh order."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def size(self, dim: str) -> int:
        return len(self.members[dim])

    def group(self, dim: str):
        """The process group along ``dim``, or None when this rank is alone on it."""
        return self.groups.get(dim)

    def wait(self, work, what: str) -> None:
        """Wait for an async collective up to the timeout; a dead or stuck peer becomes a PeerError."""
        try:
            wait_until(work, backend=self.backend, deadline=time.monotonic() + self.timeout_s)
        except (TimeoutError, RuntimeError) as e:
            msg = short_reason(e) if str(e).strip() else "timed out"
            raise PeerError(f"rank {self.rank}: {what} failed ({msg}); a rank died or hung — stopping") from None

    def all_reduce(self, t: torch.Tensor, dim: str, what: str) -> torch.Tensor:
        """Sum ``t`` in place over this rank's group along ``dim`` (nothing to do when it is alone)."""
        grp = self.group(dim)
        if grp is not None:
            self.wait(dist.all_reduce(t, group=grp, async_op=True), what)
        return t

    def gather_floats(self, value: float) -> list[float]:
        """``value`` of every rank, in rank order (this rank's alone without a process group)."""
        if self.backend == "none":
            return [value]
        out = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=self.device)
        mine = torch.tensor([value], dtype=torch.float64, device=self.device)
        self.wait(dist.all_gather_single(out, mine, async_op=True), "gathering the ranks' speeds")
        return out.tolist()

    def agree(self, facts: Mapping[str, str],
              fix: str = "start every node with the same command, config and files") -> None:
        """Refuse, on every rank at once, a run whose ranks differ in any of ``facts`` (what each rank derived on
        its own: its config, the checkpoint it resumes from, its tokenizer). Under torchrun each node is started
        by its own command and reads its own files; a difference would train a mixed model silently (or fail
        later in a collective that names no cause). Each fact is hashed; the hashes are all-gathered. ``fix``: what
        to do, in the refusal."""
        if self.backend == "none":
            return
        keys = sorted(facts)
        n = dist.get_world_size()
        mine = torch.tensor([int(hashlib.sha256(facts[k].encode()).hexdigest()[:15], 16) for k in keys],
                            dtype=torch.int64, device=self.device)
        out = torch.zeros(n * len(keys), dtype=torch.int64, device=self.device)
        self.wait(dist.all_gather_single(out, mine, async_op=True), "comparing the ranks' settings")
        every = out.view(n, len(keys)).tolist()
        for j, key in enumerate(keys):
            same = [r for r in range(n) if every[r][j] == every[self.rank][j]]
            if len(same) < n:
                other = [r for r in range(n) if r not in same]
                raise StratumError(f"the ranks differ in {key}: rank(s) {ranges_text(same)} have {facts[key]} (this "
                                   f"is rank {self.rank}), rank(s) {ranges_text(other)} another; {fix}")

    def share_object(self, obj: _T, dim: str, what: str) -> _T:
        """The first member's ``obj`` along ``dim``, on every member (``obj`` itself when this rank is alone):
        what each rank derived from its own measurements (a plan, a cut) becomes one choice they all run."""
        grp = self.group(dim)
        if grp is None:
            return obj
        src = self.members[dim][0]
        data = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)  # (NCCL: device tensors only)
        self.wait(dist.broadcast(size, src=src, group=grp, async_op=True), f"sharing {what} (size)")
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device) if self.rank == src
               else torch.empty(int(size), dtype=torch.uint8, device=self.device))
        self.wait(dist.broadcast(buf, src=src, group=grp, async_op=True), f"sharing {what}")
        return obj if self.rank == src else pickle.loads(buf.cpu().numpy().tobytes())

    def gather_to_first(self, obj: _T, dim: str, what: str) -> list[_T] | None:
        """Every member's ``obj`` along ``dim`` (a structure of mappings and dataclasses holding CPU tensors, or
        None), in member order, on the first member; None on the others. The structure around the tensors is
        pickled; each tensor travels by itself, point to point, received into a tensor of its own — so the first
        member holds what it gathers once, not also as pickled bytes and their copies (which ``gather_object``
        makes). Every message is waited on up to the timeout."""
        grp = self.group(dim)
        if grp is None:
            return [obj]
        first = self.members[dim][0]
        if self.rank != first:
            tensors: list[torch.Tensor] = []
            skeleton = pickle.dumps(_strip(obj, tensors))
            size = torch.tensor([len(skeleton)], dtype=torch.int64)
            for t in (size, torch.frombuffer(bytearray(skeleton), dtype=torch.uint8), *tensors):
                self.wait(dist.isend(t.contiguous().to(self.device), dst=first, tag=GATHER_TAG), f"sending {what}")
            return None
        got: list = [obj]
        for src in self.members[dim][1:]:
            size = self._recv(torch.empty(1, dtype=torch.int64), src, what)
            skeleton = pickle.loads(self._recv(torch.empty(int(size), dtype=torch.uint8), src, what).numpy().tobytes())
            got.append(_fill(skeleton, functools.partial(self._recv_slot, src=src, what=what)))
        return got

    def _recv_slot(self, slot: _Slot, *, src: int, what: str) -> torch.Tensor:
        return self._recv(torch.empty(slot.shape, dtype=slot.dtype), src, what)

    def _recv(self, buf: torch.Tensor, src: int, what: str) -> torch.Tensor:
        """``buf`` filled by rank ``src``'s next message (on the CPU)."""
        dev = buf.to(self.device)
        self.wait(dist.irecv(dev, src=src, tag=GATHER_TAG), f"receiving {what} from rank {src}")
        return dev.cpu()

    def gathered_norm(self, norms: list[tuple[str, torch.Tensor]], order: list[str],
                      dims: tuple[str, ...]) -> torch.Tensor:
        """The plain engine's global gradient norm — ``torch.linalg.vector_norm`` over each parameter's norm, in
        ``order`` — from this rank's part of them (``norms``: (name, 0-d norm)), where every parameter's norm is
        on one rank of the ranks spanned by ``dims`` (a pipeline's stages, sharded replicas' chunks, both for
        sharded replicas of a pipeline). The parts are summed along each dim in turn into one
        vector (each entry plus zeros: exact) with a flag per parameter that has one, so every rank norms the plain
        engine's list and gets its number bit for bit — where a sum of squares over the ranks differs in the last
        bits, which a 16-bit working copy of a weight can turn into a whole bf16 step."""
        n = len(order)
        vec = torch.zeros(2 * n, dtype=torch.float32, device=self.device)
        if norms:  # (one scatter: no per-parameter copies, each a device sync on a GPU)
            pos = {name: i for i, name in enumerate(order)}
            at = torch.tensor([pos[name] for name, _ in norms], device=self.device)
            vec[at] = torch.stack([x for _, x in norms]).to(self.device, torch.float32)
            vec[at + n] = 1.0
        for dim in dims:
            vec = self.all_reduce(vec, dim, "the gradient norms' all-reduce")
        return torch.linalg.vector_norm(vec[:n][vec[n:] > 0], 2.0)

    def subgroup(self, dim: str, positions: list[int]):
        """A group of the ranks at ``positions`` along ``dim`` (e.g. the pipeline ranks holding a tied tensor),
        created for every slice of the mesh so that every rank takes part; this rank's, or None."""
        mine = None
        for g in self.plan.all_groups(dim):
            ranks = [g[i] for i in positions]
            grp = dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout_s))
            if self.rank in ranks:
                mine = grp
        return mine


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was in a structure :meth:`World.gather_to_first` sends: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _strip(obj, tensors: list[torch.Tensor]):
    """``obj`` with every tensor replaced by its _Slot (the tensors appended to ``tensors``, in order)."""
    def slot(t: torch.Tensor) -> _Slot:
        tensors.append(t)
        return _Slot(tuple(t.shape), t.dtype)
    return _replaced(obj, torch.Tensor, slot)


def _fill(obj, tensor: Callable[[_Slot], torch.Tensor]):
    """:func:`_strip`'s structure with each _Slot replaced by ``tensor(slot)``, in the order _strip met them."""
    return _replaced(obj, _Slot, tensor)


def _replaced(obj, kind: type, leaf: Callable):
    """``obj`` (mappings and dataclasses, nested) with every value of type ``kind`` replaced by ``leaf(value)``,
    depth first in the structure's order."""
    if isinstance(obj, kind):
        return leaf(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _replaced(getattr(obj, f.name), kind, leaf)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, Mapping):
        return {k: _replaced(v, kind, leaf) for k, v in obj.items()}
    return obj


@contextlib.contextmanager
def peers_checked(world: World) -> Iterator[None]:
    """Exchanges the engines do not wait on through :meth:`World.wait` — DTensor's collectives inside a split
    layer's forward and backward, posting point-to-point messages to a peer already gone — fail within the
    group's timeout (``parallel.timeout_s``) when a peer died or hung, but as the backend's bare error, with a
    traceback: here it becomes the PeerError every other wait raises. Any other error is this rank's own and
    passes unchanged."""
    try:
        yield
    except RuntimeError as e:
        if world.backend == "none" or not from_backend(e):
            raise
        raise PeerError(f"rank {world.rank}: an exchange with the other ranks failed ({short_reason(e)}); a rank "
                        "died or hung — stopping") from None


def single_world(plan: Plan, device: torch.device) -> World:
    """The world of a one-process plan without a process group."""
    coord = plan.coord(0)
    return World(plan=plan, rank=0, coord=coord, device=device, backend="none", timeout_s=0.0,
                 members={d: [0] for d in DIMS})


def mesh_world(plan: Plan, device: torch.device, timeout_s: float) -> World:
    """This rank's world on the existing default group, its slice groups created (collectively)."""
    rank = dist.get_rank()
    w = World(plan=plan, rank=rank, coord=plan.coord(rank), device=device, backend=dist.get_backend(),
              timeout_s=timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    for dim in DIMS:
        w.members[dim] = plan.group_ranks(dim, rank)
        for ranks in plan.all_groups(dim):
            if len(ranks) < 2:
                continue
            try:
                grp = dist.new_group(ranks, timeout=timeout)
            except RuntimeError as e:
                raise PeerError(f"rank {rank}: creating the {dim} groups failed ({short_reason(e)}); a rank died or "
                                "hung — stopping") from None
            if rank in ranks:
                w.groups[dim] = grp
    return w


def join_world(plan: Plan, device: torch.device, *, backend: str, timeout_s: float) -> World:
    """The world ``plan`` runs in: one process without a group, or this process's place among the launched ones
    (the default group joined from the launcher's environment, the slice groups created)."""
    if plan.world_size() == 1 and not roles.under_torchrun():
        return single_world(plan, device)
    device = launch.local_device(device)
    launch.init_process_group(world=plan.world_size(), plan=str(plan), backend=backend, device=device,
                              timeout_s=timeout_s)
    return mesh_world(plan, device, timeout_s)


def leave_world(world: World) -> None:
    """Tear the process groups down after a clean run (after a failure they are left alone: tearing them down
    could wait on a dead peer)."""
    if world.backend != "none":
        launch.destroy_process_group()
