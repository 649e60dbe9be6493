"""The replicate node over the offload leaf: data parallel where each replica's model lives in chunks over its
own device, host and disk tiers (Elixir and ColossalAI's Gemini replicate chunked models the same way).

The offload engine updates a chunk as soon as its gradient is complete, inside its backward, so the replicas'
gradients cannot be reduced after the backward as :class:`~stratum.parallel.replicate.ReplicateEngine` does for
its children: each chunk's gradient is reduced as it completes (one collective per chunk, the chunk as the bucket),
before its norm and update. Every replica then holds the same reduced gradients and applies the same update, so
the replicas stay equal without broadcasting parameters. The replicas run one offload plan: replica 0's, shared
at start-up, since each one's planner measures its own bandwidths and times and the chunk layout fixes the order
of the collectives.
"""

from __future__ import annotations

from stratum.data.tokens import Batch
from stratum.dist.world import World
from stratum.ir.plan import Replicate
from stratum.offload.engine import OffloadEngine
from stratum.parallel.reduce import adasum_over, sum_over
from stratum.parallel.replicate import my_part
from stratum.runtime.engine import Engine, StepResult, TrainState


class ReplicatedOffload(Engine):
    """Data parallel over ``world``'s replica group around an offload engine (see the module docstring)."""

    def __init__(self, child: OffloadEngine, *, node: Replicate, world: World, speeds: list[float] | None = None):
        self.child = child
        self.node = node
        self.world = world
        self.n, self.index = world.size("replica"), world.coord.replica
        self.speeds = speeds
        """Relative speed per replica (hardware-aware shares), or None for even shares."""
        child.reducer = adasum_over(world) if node.reduce == "adasum" else sum_over(world)

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult:
        mine = my_part(micro_batches, self.n, self.index, self.speeds)
        # mean: every loss over the whole step's count, so the replicas' sum is the plain engine's mean;
        # adasum: each replica's gradient is its own mean, the direction Adasum combines
        divisor = len(mine) if self.node.reduce == "adasum" else len(micro_batches)
        loss_sum, norm = self.child.train_share(mine, lr, divisor)
        total = self.world.all_reduce(loss_sum.double().reshape(1), "replica", "the loss all-reduce")
        return StepResult(loss=float(total) / len(micro_batches), grad_norm=float(norm))

    def describe(self) -> str:
        lines = [self.child.describe()]
        if self.speeds is not None:
            lines.append("replica speeds " + ", ".join(f"{s:.3g}" for s in self.speeds)
                         + ": micro-batch shares follow them")
        return "\n".join(x for x in lines if x)

    def eval_loss(self, batches: list[Batch]) -> float:
        return self.child.eval_loss(batches)

    def state(self) -> TrainState:
        return self.child.state()

    def load_state(self, state: TrainState) -> None:
        self.child.load_state(state)

    def memory_stats(self) -> dict[str, int]:
        return self.child.memory_stats()

    def step_io(self) -> dict[str, float]:
        return self.child.step_io()

    @property
    def predicted_step_s(self) -> float | None:
        return self.child.predicted_step_s

    def close(self) -> None:
        self.child.close()
