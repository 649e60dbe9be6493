"""Gradient reductions over the replica group for executors that hand over their gradients piece by piece (the
offload leaf reduces each chunk's as it completes) — and the Adasum exchange the replicate node uses for any child.

Both take the tensors of one piece (and their names) in an order every replica shares and leave the combined values in them, equal
on every replica; every wait is bounded by the world's timeout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from stratum.dist.world import World
from stratum.parallel import adasum

Reducer = Callable[[list[str], list[torch.Tensor], str], None]
"""(canonical names, gradients of one piece, what it is for messages) → combined in place over the replicas."""


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

    def reduce(names: list[str], grads: list[torch.Tensor], what: str) -> None:
        if world.group("replica") is None or not grads:
            return
        flat = flat_copy(grads)
        world.all_reduce(flat, "replica", f"the gradient all-reduce of {what}")
        copy_back(grads, flat)
    return reduce


def adasum_over(world: World) -> Reducer:
    """Adasum over the replicas, tensor by tensor (a tensor is a layer's parameter).

    Every replica gathers every replica's gradients and combines them in the same order, so all get the same
    result. Gathering costs n× the bandwidth of Horovod's halving-doubling exchange; it keeps the arithmetic one
    function (:func:`adasum.tree`) for any number of replicas."""
    n, group = world.size("replica"), world.group("replica")

    def reduce(names: list[str], grads: list[torch.Tensor], what: str) -> None:
        if group is None or not grads:
            return
        flat = flat_copy(grads)
        gathered = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
        world.wait(dist.all_gather_single(gathered, flat, group=group, async_op=True),
                   f"the Adasum gradient all-gather of {what}")
        per_rank = gathered.view(n, -1)
        off = 0
        for g in grads:
            g.copy_(adasum.tree([per_rank[r, off:off + g.numel()] for r in range(n)]).view_as(g))
            off += g.numel()
    return reduce
