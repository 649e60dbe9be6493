"""The replicate node: data parallel over the plan's replicas, wrapping whatever executor its child is.

Every replica draws the step's whole list of micro-batches (``grad_accum × replicas``, the same on every rank)
and runs its share through the child. With ``reduce=mean`` every micro-batch's loss is divided by the total
count and the replicas' gradients are summed, so the step equals the plain engine's on the whole batch —
also when shares are unequal (hardware-aware balance gives faster replicas more micro-batches). With
``reduce=adasum`` each replica's gradient is its own mean and the replicas' gradients combine by Adasum, layer by
layer. With ``shard=true`` the gradients are reduce-scattered and each replica updates its own slice
(:mod:`stratum.parallel.shard`).

The mean reduction sums gradients in buckets whose all-reduces start during the child's backward where they can
(:mod:`stratum.parallel.buckets`); every wait is bounded by the world's timeout.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from stratum.data.tokens import Batch
from stratum.dist.world import World
from stratum.errors import StratumError
from stratum.ir.plan import Replicate
from stratum.parallel import presence
from stratum.parallel.buckets import GradBuckets
from stratum.parallel.reduce import adasum_over
from stratum.parallel.running_stats import RunningStats
from stratum.parallel.shard import ShardedAdamW
from stratum.runtime.engine import GradEngine, TrainState


def even_shares(total: int, n: int) -> list[int]:
    """``total`` micro-batches over ``n`` replicas as evenly as possible (earlier replicas take the rest)."""
    return [total // n + (i < total % n) for i in range(n)]


def speed_shares(total: int, speeds: list[float]) -> list[int]:
    """``total`` micro-batches over replicas in proportion to ``speeds`` (largest remainders), at least one
    each (taken from the largest share)."""
    n = len(speeds)
    if total < n:
        raise StratumError(f"{total} micro-batches cannot give each of {n} replicas one; raise train.grad_accum")
    exact = [total * s / sum(speeds) for s in speeds]
    shares = [int(e) for e in exact]
    for i in sorted(range(n), key=lambda i: exact[i] - shares[i], reverse=True)[:total - sum(shares)]:
        shares[i] += 1
    for i in range(n):
        if shares[i] == 0:
            shares[max(range(n), key=lambda j: shares[j])] -= 1
            shares[i] = 1
    return shares


def shares(total: int, n: int, speeds: list[float] | None) -> list[int]:
    """Micro-batches per replica for a step of ``total``: in proportion to ``speeds`` where given, else even."""
    if speeds is not None:
        return speed_shares(total, speeds)
    if total < n:
        raise StratumError(f"{total} micro-batches per step cannot give each of {n} replicas one")
    return even_shares(total, n)


def my_part(micro_batches: list[Batch], counts: list[int], index: int) -> list[Batch]:
    """Replica ``index``'s consecutive run of the step's micro-batches, replica i taking ``counts[i]``."""
    start = sum(counts[:index])
    return micro_batches[start:start + counts[index]]


class ReplicateEngine(GradEngine):
    """Data parallel over ``world``'s replica group, around ``child`` (see the module docstring)."""

    name = "replicate"

    def __init__(self, child: GradEngine, *, node: Replicate, world: World, speeds: list[float] | None = None,
                 rebalance: bool = False, stats: RunningStats | None = None):
        self.child = child
        self.stats = stats
        """The running statistics of the child's layers, kept as the plain engine's (None: none to keep)."""
        self.node = node
        self.world = world
        self.spec = child.spec
        self.n, self.index = world.size("replica"), world.coord.replica
        self.group = world.group("replica")
        self.speeds = speeds
        """Relative speed per replica (hardware-aware shares), or None for even shares."""
        self.rebalance = rebalance
        """Re-measure the speeds every step from the replicas' own compute time (``parallel.speeds = auto``)."""
        self.pace: list[list[float]] = [[] for _ in range(self.n)]
        opt = getattr(child, "opt", None)
        self.sharded = opt if isinstance(opt, ShardedAdamW) else None
        if node.shard and self.sharded is None:
            raise StratumError("replicate(shard=true) needs its child built with a sharded optimizer")
        self.adasum = adasum_over(world)
        self.buckets = None if node.shard or node.reduce != "mean" else \
            GradBuckets([p for _, p in self._trained()], world, overlap=child.grads_final_in_backward)

    def share(self, total: int) -> list[int]:
        """Micro-batches per replica for a step of ``total``."""
        return shares(total, self.n, self.speeds)

    # ---- GradEngine -----------------------------------------------------------------------------------
    def forward_backward(self, micro_batches: list[Batch], divisor: int) -> torch.Tensor:
        counts = self.share(len(micro_batches))
        mine = my_part(micro_batches, counts, self.index)
        if self.stats is not None:
            self.stats.begin()
        if self.buckets is not None:
            self.buckets.arm(len(mine))
        own_divisor = len(mine) if self.node.reduce == "adasum" else divisor
        t0 = time.perf_counter()
        loss_sum = self.child.forward_backward(mine, own_divisor)
        busy = time.perf_counter() - t0
        if self.sharded is not None:
            self.sharded.reduce_scatter()
        elif self.node.reduce == "adasum":
            self._adasum()
        else:
            assert self.buckets is not None  # (a mean reduction without shard has its buckets)
            self.buckets.finish()
        if self.stats is not None:
            self.stats.combine(counts, self.index)
        loss_sum = self.world.all_reduce(loss_sum.clone(), "replica", "the loss all-reduce")
        if self.rebalance:
            self._measure(busy / len(mine))
        return loss_sum

    def _measure(self, seconds_per_micro_batch: float) -> None:
        """Speeds from the replicas' compute time per micro-batch over the last three steps (a replica at its
        slowest process's pace): the next step's shares follow the machine as it is now. Every rank gathers the
        same numbers, so every rank computes the same shares."""
        times = self.world.gather_floats(seconds_per_micro_batch)
        plan = self.world.plan
        for i in range(self.n):
            slowest = max(times[r] for r in range(plan.world_size()) if plan.coord(r).replica == i)
            self.pace[i] = (self.pace[i] + [slowest])[-3:]
        self.speeds = [1.0 / statistics.median(p) for p in self.pace]

    def grad_params(self) -> list[tuple[str, nn.Parameter]]:
        return self.child.grad_params()

    def norm_counted(self) -> set[str]:
        return self.child.norm_counted()

    def reduce_norm(self, norms: torch.Tensor) -> torch.Tensor:
        return self.child.reduce_norm(norms)

    def grad_norm(self) -> torch.Tensor:
        if self.sharded is None:  # every replica holds the same reduced gradients: the child's norm is the norm
            return self.child.grad_norm()
        local = self.sharded.local_sq_norm(self.child.norm_counted()).to(self.world.device)
        sq = self.world.all_reduce(local, "replica", "the gradient-norm all-reduce")
        return self.child.reduce_norm(sq.sqrt().float().reshape(1))  # the replicas' slices as one entry

    def update(self, lr: float, coef: torch.Tensor) -> None:
        self.child.update(lr, coef)

    # ---- reductions -----------------------------------------------------------------------------------
    def _trained(self) -> list[tuple[str, nn.Parameter]]:
        """The child's parameters that take gradients (a frozen one is never reduced, never updated)."""
        return [(n, p) for n, p in self.child.grad_params() if p.requires_grad]

    def _adasum(self) -> None:
        """Every replica's gradients combined by Adasum, after the backward (the gather is waited at once). A
        parameter no replica's micro-batches reached ends without a gradient, as under the plain engine; one
        that some replicas lack takes zeros there (Adasum leaves the others' as they are)."""
        named = self._trained()
        params = [p for _, p in named]
        present = torch.ones(len(params), device=self.world.device)
        present[presence.fill_missing(params)] = 0
        self.adasum([n for n, _ in named], presence.grads_of(params), "the replicas' gradients").finish()
        self.world.all_reduce(present, "replica", "the gradient-presence all-reduce")  # (every replica joins)
        for p, had in zip(params, present.tolist()):
            if had == 0:
                p.grad = None

    # ---- Engine ---------------------------------------------------------------------------------------
    def describe(self) -> str:
        if self.speeds is None:
            return self.child.describe()
        speeds = ", ".join(f"{s:.3g}" for s in self.speeds)
        how = ", re-measured every step" if self.rebalance else ""
        return "\n".join(x for x in (f"replica speeds {speeds}: micro-batch shares follow them{how}",
                                     self.child.describe()) if x)

    def eval_loss(self, batches: list[Batch]) -> float:
        return self.child.eval_loss(batches)

    def state(self) -> TrainState:
        return self.child.state()

    def load_state(self, state: TrainState) -> None:
        self.child.load_state(state)

    def memory_stats(self) -> dict[str, int]:
        return self.child.memory_stats()

    def close(self) -> None:
        self.child.close()
