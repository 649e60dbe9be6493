"""The replicate node over the offload leaf: data parallel where each replica's model lives in chunks over its
own device, host and disk tiers (Elixir and ColossalAI's Gemini replicate chunked models the same way).

The offload engine updates a chunk as soon as its gradient is complete, inside its backward, so the replicas'
gradients cannot be reduced after the backward as :class:`~stratum.parallel.replicate.ReplicateEngine` does for
its children: each chunk's gradient is reduced as it completes (one collective per chunk, the chunk as the bucket),
before its norm and update. The reduction overlaps the rest of the backward: the reducers here launch the
chunk's collective and return a :class:`~stratum.parallel.reduce.Pending`; the engine goes on with the next
blocks and settles the chunk — waits for the collective, then its norm and update — later, all before its
backward returns (:mod:`stratum.offload.reductions`). Every replica then holds the same reduced gradients and
applies the same update, so the replicas stay equal without broadcasting parameters. The replicas run one offload
plan: replica 0's, shared
at start-up, since each one's planner measures its own bandwidths and times and the chunk layout fixes the order
of the collectives.

With ``shard=true`` the chunks are shared out as Gemini shards them: replica ``i % n`` owns chunk i — holds its
AdamW state and updates it. A chunk's gradient is reduced to its owner alone; the global norm sums the owners'
parts; after the step each owner broadcasts its chunks' new parameters to the other replicas. Each replica holds
1/n of the optimizer state (its m and v), at the cost of one broadcast of the parameters per step. A replica
that does not own a chunk drops its gradient when the reduction to the owner is settled (not before: the
collective's packed copy is what it sends).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from stratum.data.tokens import Batch
from stratum.dist.world import World
from stratum.ir.plan import Replicate
from stratum.offload.engine import OffloadEngine
from stratum.offload.tiers import aligned_empty
from stratum.parallel.reduce import DONE, Pending, adasum_over, copy_back, flat_copy, sum_over
from stratum.parallel.replicate import my_part, shares
from stratum.parallel.running_stats import RunningStats
from stratum.runtime.engine import AroundChild, Engine, StepResult, TrainState


class OverReplicas(AroundChild):
    """What every replicate node around a memory-engine child shares: the replica group, the shares by speed, and
    the Engine calls that are the child's."""

    def __init__(self, child: Engine, *, node: Replicate, world: World, speeds: list[float] | None,
                 stats: RunningStats | None):
        self.child = child
        self.stats = stats
        """The running statistics of the child's layers, kept as the plain engine's (None: none to keep)."""
        self.node = node
        self.world = world
        self.n, self.index = world.size("replica"), world.coord.replica
        self.speeds = speeds
        """Relative speed per replica (hardware-aware shares), or None for even shares."""
        self.group = world.group("replica")

    def _begin(self, micro_batches: list[Batch]) -> tuple[list[int], list[Batch]]:
        """A step begins: the replicas' shares of ``micro_batches`` and this replica's run of them."""
        counts = shares(len(micro_batches), self.n, self.speeds)
        if self.stats is not None:
            self.stats.begin()
        return counts, my_part(micro_batches, counts, self.index)

    def _end(self, counts: list[int]) -> None:
        """The step's forwards are done on every replica: the running statistics combined."""
        if self.stats is not None:
            self.stats.combine(counts, self.index)

    def describe(self) -> str:
        lines = [self.child.describe()]
        if self.speeds is not None:
            lines.append("replica speeds " + ", ".join(f"{s:.3g}" for s in self.speeds)
                         + ": micro-batch shares follow them")
        return "\n".join(x for x in lines if x)

    # ---- shard=true: chunk i belongs to replica i mod n ------------------------------------------------------
    leaf: OffloadEngine
    """The memory engine whose chunks the replicas share out (the child, or a pipeline rank's leaf)."""

    def _owner(self, chunk: int) -> int:
        """The process that updates ``chunk``."""
        return self.world.members["replica"][chunk % self.n]

    def _sum_to_owner(self, names: list[str], grads: list[torch.Tensor], what: str) -> Pending:
        """One chunk's gradients summed on its owner, launched (the others' copies are left as they were,
        unused)."""
        if self.group is None or not grads:
            return DONE
        owner = self._owner(self.leaf.where[names[0]][0].i)
        flat = flat_copy(grads)
        work = dist.reduce(flat, dst=owner, group=self.group, async_op=True)
        mine = self.world.rank == owner
        return Pending(works=[work], wait=self.world.wait, what=f"the gradient reduction of {what}",
                       then=(lambda: copy_back(grads, flat)) if mine else lambda: None, buffers=[flat])

    def _share_params(self) -> None:
        """After the updates: every chunk's parameters from its owner to the other replicas."""
        leaf = self.leaf
        leaf.drain()
        for c in leaf.chunks:
            src = self._owner(c.i)
            flat = leaf.master_params(c) if self.world.rank == src else aligned_empty(c.cap)
            buf = flat.to(self.world.device)  # (NCCL moves device tensors only)
            self.world.wait(dist.broadcast(buf, src=src, group=self.group, async_op=True),
                            f"sharing chunk {c.i}'s parameters")
            if self.world.rank != src:
                leaf.set_params(c, buf.cpu())

    def _gather_optim(self, optim: Mapping) -> Mapping:
        """Every replica's AdamW state of its own chunks, merged on replica 0 (the others keep their part)."""
        if self.group is None:
            return optim
        got = self.world.gather_to_first(optim, "replica", "the optimizer state")
        if got is None:
            return optim
        merged: dict = {}
        for part in got or []:
            merged.update(part)
        return merged


class ReplicatedOffload(OverReplicas):
    """Data parallel over ``world``'s replica group around an offload engine (see the module docstring)."""

    def __init__(self, child: OffloadEngine, *, node: Replicate, world: World, speeds: list[float] | None = None,
                 stats: RunningStats | None = None):
        super().__init__(child, node=node, world=world, speeds=speeds, stats=stats)
        self.child: OffloadEngine = child
        self.leaf = child
        child.reducer = (adasum_over(world) if node.reduce == "adasum" else
                         self._sum_to_owner if node.shard else sum_over(world))
        if node.shard:
            child.combine_norm = self._global_norm

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult:
        counts, mine = self._begin(micro_batches)
        # mean: every loss over the whole step's count, so the replicas' sum is the plain engine's mean;
        # adasum: each replica's gradient is its own mean, the direction Adasum combines
        divisor = len(mine) if self.node.reduce == "adasum" else len(micro_batches)
        loss_sum, norm = self.child.train_share(mine, lr, divisor)
        self._end(counts)
        if self.node.shard:
            self._share_params()
        total = self.world.all_reduce(loss_sum.double().reshape(1), "replica", "the loss all-reduce")
        return StepResult(loss=float(total) / len(micro_batches), grad_norm=float(norm))

    def _global_norm(self, norms: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
        """The norm over every replica's owned chunks from this replica's per-parameter norms, as one engine of
        every chunk computes it."""
        return self.world.gathered_norm(norms, self.leaf.names, ("replica",))

    # ---- Engine -------------------------------------------------------------------------------------------
    def state(self) -> TrainState:
        """The child's state; sharded, each replica's AdamW state of its own chunks gathered to replica 0."""
        st = self.child.state()
        if self.node.shard:
            st.optim = self._gather_optim(st.optim)
        return st

    def state_parts(self) -> Iterator[TrainState]:
        """The child's parts; sharded, each part's AdamW state gathered from every replica (collective over the
        replicas: every rank runs it to its end). Replica 0's parts alone are the checkpoint's."""
        if not self.node.shard and self.index != 0:
            return  # every replica holds the same state: replica 0's is the checkpoint
        for part in self.child.state_parts():
            if self.node.shard:
                part.optim = self._gather_optim(part.optim)
            if self.index == 0:
                yield part


def chunk_owner(n: int, index: int):
    """Whether replica ``index`` of ``n`` owns a chunk (by its index), as ``replicate(shard=true)`` shares them."""
    return lambda chunk: chunk % n == index
