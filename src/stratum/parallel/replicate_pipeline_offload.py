"""The replicate node over a pipeline whose ranks run the offload leaf: ``replicate(n, pipeline(m, offload(…)))``.

Each replica is a whole pipeline (:class:`~stratum.parallel.pipeline_offload.OffloadPipelineEngine`); a pipeline
rank's chunks are reduced over the ranks holding the same stages in the other replicas as each chunk completes,
beside the rest of the schedule (launched then, settled later: :mod:`stratum.offload.reductions`), before its
norm and update — the offload leaf updates a chunk inside its backward, so the gradients cannot be
reduced after the backward as :class:`~stratum.parallel.replicate.ReplicateEngine` does. A chunk tied to another
pipeline rank is first summed inside its pipeline, then over the replicas (the two sums commute; both run when
the chunk completes).

The replica collectives cannot deadlock with the pipeline's point-to-point messages: every replica runs the same
schedule over the same chunk layout, so the ranks of one stage meet at each chunk's reduction in the same order,
and a rank waits there only for peers whose progress needs nothing from it. Settling a chunk after its launch
moves a rank's wait behind work it used to do after the wait, never before it, so it adds no dependency. The chunk
layout is replica 0's for
each stage (shared at start-up), since each rank's planner measures its own bandwidths.

With ``shard=true`` a stage's chunks are shared out over its replicas as under ``replicate(n, shard=true,
offload(…))``: replica ``i % n`` owns chunk i (its AdamW state and update), a chunk's gradient is reduced to its
owner, the norm gathers the owners' parameter norms over the replicas and the stages, and owners broadcast their chunks'
new parameters after the step.
"""

from __future__ import annotations

import torch

from stratum.data.tokens import Batch
from stratum.dist.world import World
from stratum.errors import StratumError
from stratum.ir.plan import Replicate
from stratum.parallel.pipeline_offload import OffloadPipelineEngine
from stratum.parallel.reduce import adasum_over, in_turn, sum_over
from stratum.parallel.replicate_offload import OverReplicas
from stratum.parallel.running_stats import RunningStats
from stratum.runtime.engine import StepResult, clip_coef


class ReplicatedOffloadPipeline(OverReplicas):
    """Data parallel over ``world``'s replica group around an offload pipeline (see the module docstring)."""

    def __init__(self, child: OffloadPipelineEngine, *, node: Replicate, world: World,
                 speeds: list[float] | None = None, stats: RunningStats | None = None):
        super().__init__(child, node=node, world=world, speeds=speeds, stats=stats)
        self.child: OffloadPipelineEngine = child
        self.leaf = child.leaf
        if node.shard and child.owns is None:
            raise StratumError("replicate(shard=true) needs its offload pipeline built owning every n-th chunk")
        across = (adasum_over(world) if node.reduce == "adasum" else
                  self._sum_to_owner if node.shard else sum_over(world))
        self.leaf.reducer = in_turn(self.leaf.reducer, across)
        if node.shard:
            child.gather_optim = self._gather_optim

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult:
        counts, mine = self._begin(micro_batches)
        # mean: every loss over the whole step's count, so the replicas' sum is the plain engine's mean;
        # adasum: each replica's gradient is its own mean, the direction Adasum combines
        divisor = len(mine) if self.node.reduce == "adasum" else len(micro_batches)
        child = self.child
        child.runner.begin_step(lr, len(mine))
        loss_sum = child.forward_backward(mine, divisor)
        self._end(counts)
        norm = self._grad_norm()
        child.update(lr, clip_coef(norm, child.spec.grad_clip))
        if self.node.shard:
            self._share_params()
        total = self.world.all_reduce(loss_sum.reshape(1).clone(), "replica", "the loss all-reduce")
        return StepResult(loss=float(total) / len(micro_batches), grad_norm=float(norm))

    def _grad_norm(self) -> torch.Tensor:
        """The global norm. Unsharded every replica holds the same reduced chunks, so the pipeline's norm is it;
        sharded, each parameter's norm is on its chunk's owner in its stage: gathered over the replicas and the
        stages, in the whole model's order, as the plain engine norms them."""
        if not self.node.shard:
            return self.child.grad_norm()
        child = self.child
        return self.world.gathered_norm(child.local_named_norms(), child.order, ("replica", "stage_rank"))
