"""Gradient reductions over the replica group for executors that hand over their gradients piece by piece (the
offload leaf reduces each chunk's as it completes) — and the Adasum exchange the replicate node uses for any child.

A reducer takes the tensors of one piece (and their names) in an order every replica shares and *launches* the
piece's collective, returning a :class:`Pending`: the executor goes on (the rest of its backward) while the
collective runs, and :meth:`Pending.finish` — bounded by the world's timeout — leaves the combined values in the
piece's tensors, equal on every replica. The collective works on a packed copy of the piece, so the executor's
tensors are neither read nor written by it until ``finish``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from stratum.dist.world import World
from stratum.offload.reductions import ChunkReducer
from stratum.parallel import adasum


@dataclass(kw_only=True)
class Pending:
    """One piece's reduction, launched."""

    works: list = field(default_factory=list)
    """The piece's collectives in flight (``torch.distributed`` work handles)."""
    wait: Callable[[object, str], None] = lambda work, what: None
    """How to wait for one of them, bounded by a timeout (``World.wait``)."""
    what: str = ""
    """What the collective is, for a peer-failure message."""
    then: Callable[[], None] = lambda: None
    """Writes the combined values into the piece's tensors, once every work has completed."""
    buffers: list[torch.Tensor] = field(default_factory=list)
    """The packed copies the collectives work on, held until :meth:`finish`."""

    @property
    def nbytes(self) -> int:
        """Bytes of :attr:`buffers`."""
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def ready(self) -> bool:
        """The collectives have completed: :meth:`finish` would not wait."""
        return all(w.is_completed() for w in self.works)

    def finish(self) -> None:
        """Wait for the collectives (each within the timeout), then write the combined values back."""
        for w in self.works:
            self.wait(w, self.what)
        self.then()


DONE = Pending()
"""A reduction with nothing to wait for or write (no replica group, or nothing in the piece)."""

Reducer = Callable[[list[str], list[torch.Tensor], str], Pending]
"""(canonical names, gradients of one piece, what it is for messages) → the piece's reduction, launched."""


def flat_copy(grads: list[torch.Tensor]) -> torch.Tensor:
    """The tensors of one piece packed into one buffer (one collective instead of one per tensor)."""
    return torch.cat([g.reshape(-1) for g in grads])


def copy_back(grads: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Write ``flat`` (as :func:`flat_copy` packed it) back into ``grads``."""
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


def sum_over(world: World) -> Reducer:
    """Sum over the replicas, one all-reduce per piece (its tensors packed into one buffer)."""

    def reduce(names: list[str], grads: list[torch.Tensor], what: str) -> Pending:
        group = world.group("replica")
        if group is None or not grads:
            return DONE
        flat = flat_copy(grads)
        return Pending(works=[dist.all_reduce(flat, group=group, async_op=True)], wait=world.wait,
                       what=f"the gradient all-reduce of {what}", then=lambda: copy_back(grads, flat),
                       buffers=[flat])
    return reduce


def adasum_over(world: World) -> Reducer:
    """Adasum over the replicas, tensor by tensor (a tensor is a layer's parameter).

    Every replica gathers every replica's gradients and combines them in the same order, so all get the same
    result. Gathering costs n× the bandwidth of Horovod's halving-doubling exchange; it keeps the arithmetic one
    function (:func:`adasum.tree`) for any number of replicas. The gather is the collective in flight; the
    combination runs in ``finish``, on the gathered copies."""
    n, group = world.size("replica"), world.group("replica")

    def reduce(names: list[str], grads: list[torch.Tensor], what: str) -> Pending:
        if group is None or not grads:
            return DONE
        flat = flat_copy(grads)
        gathered = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)

        def combine() -> None:
            per_rank = gathered.view(n, -1)
            off = 0
            for g in grads:
                g.copy_(adasum.tree([per_rank[r, off:off + g.numel()] for r in range(n)]).view_as(g))
                off += g.numel()
        return Pending(works=[dist.all_gather_single(gathered, flat, group=group, async_op=True)],
                       wait=world.wait, what=f"the Adasum gradient all-gather of {what}", then=combine,
                       buffers=[flat, gathered])
    return reduce


def in_turn(first: ChunkReducer | None, then: Reducer) -> Reducer:
    """A reducer that runs ``first`` (where there is one) to its end and then launches ``then`` on the same piece
    (``then`` reduces what ``first`` combined)."""

    def reduce(names: list[str], grads: list[torch.Tensor], what: str) -> Pending:
        if first is not None:
            first(names, grads, what).finish()
        return then(names, grads, what)
    return reduce
