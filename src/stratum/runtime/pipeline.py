"""The pipeline engine: a BlockSeq cut into stages over processes, driven by any valid :class:`Schedule`.

One process per pipeline rank (see :mod:`stratum.dist.launch` for how they start). Each rank materialises only
the blocks of its own stages (GPT blocks are initialised from (seed, block index) alone; other sources are built
whole with the seed, then the other ranks' blocks are dropped to the ``meta`` device) and runs its action list
with :class:`~stratum.runtime.stage.StageRuntime`. A training step then:

1. runs the schedule over the step's micro-batches (``train.grad_accum`` is the number of micro-batches m);
   the last stage computes each micro-batch's loss and back-propagates ``loss / m``, exactly like the plain engine;
2. sums the gradients of tied parameters held by several ranks (the GPT embedding ↔ head) in a sub-group, so
   every copy sees the full gradient and all copies stay identical;
3. all-reduces the squared gradient norms (tied tensors counted once) together with the loss, clips every local
   gradient by the global norm like ``torch.nn.utils.clip_grad_norm_``, and steps a per-rank AdamW
   (:func:`~stratum.runtime.optim.make_adamw`) over the rank's parameters.

State crosses the seam in placement-independent form: :meth:`PipelineEngine.state` gathers every rank's
parameters and AdamW state to rank 0 (other ranks get an empty TrainState), :meth:`PipelineEngine.load_state`
takes a full TrainState and keeps its own part, so checkpoints move freely between the plain and pipeline
engines and between pipeline layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from stratum.config import PIPELINE_PARTITIONS as PARTITIONS
from stratum.data.tokens import Batch
from stratum.dist.world import World
from stratum.errors import StratumError
from stratum.ir.plan import Pipeline
from stratum.model.blockseq import BlockSeq
from stratum.model.neutral import buffers_to_cpu, evaluating, load_buffers
from stratum.model.placement import localize
from stratum.plan.partition import balanced_partition, even_partition, partition
from stratum.profile.profile import Profile
from stratum.runtime.device import peak_memory_bytes
from stratum.runtime.engine import GradEngine, OptimSpec, TrainState, merge_states
from stratum.runtime.optim import MakeOptimizer, Optimizer, leaf_optimizer, load_params
from stratum.runtime.stage import StageBlocks, StageRuntime
from stratum.runtime.tensors import full_tensor, grad_norms
from stratum.schedule.generators import KINDS, generate, is_kind
from stratum.schedule.ir import Action, Schedule
from stratum.schedule.textio import load
from stratum.schedule.validate import channel_order_mismatches


# ---- planning: schedule + partition, checked before any process starts ----------------------------------------
@dataclass(frozen=True)
class PipelinePlan:
    schedule: Schedule
    stages: list[range]
    """Blocks of each stage (contiguous, in order)."""

    def blocks_of(self, rank: int) -> list[int]:
        return sorted(i for s in self.schedule.stages_of(rank) for i in self.stages[s])


def make_schedule(p: Pipeline, microbatches: int) -> Schedule:
    """The schedule the pipeline node names (a generator kind or a text file) for ``microbatches``."""
    if is_kind(p.schedule):
        try:
            return generate(p.schedule, ranks=p.ranks, microbatches=microbatches, virtual=p.virtual,
                            waves=p.waves)
        except StratumError as e:
            raise StratumError(f"pipeline.schedule = {p.schedule!r} with pipeline.ranks = {p.ranks} and "
                               f"{microbatches} micro-batches (train.grad_accum): {e}") from None
    path = Path(p.schedule).expanduser()
    if not path.is_file():
        raise StratumError(f"pipeline.schedule = {p.schedule!r} is neither a schedule kind ({', '.join(KINDS)}, "
                           "torch:NAME) nor an existing schedule file")
    sched = load(path)  # validated
    if sched.num_ranks != p.ranks:
        raise StratumError(f"schedule file {path} has {sched.num_ranks} ranks but pipeline.ranks = {p.ranks}")
    if sched.num_microbatches != microbatches:
        raise StratumError(f"schedule file {path} has {sched.num_microbatches} micro-batches but "
                           f"train.grad_accum = {microbatches}; set train.grad_accum = {sched.num_microbatches}")
    return sched


def plan_pipeline(p: Pipeline, model: BlockSeq, microbatches: int,
                  speeds: list[float] | None = None) -> PipelinePlan:
    """Schedule and stage partition for ``model`` (may live on ``meta``) with ``microbatches`` per step on each
    pipeline; ``speeds`` (one per pipeline rank) makes the balanced and profiled cuts give faster ranks more.
    One-line errors for what cannot run."""
    if p.partition == "profiled":  # how `stratum plan --parallel` shows the cut it made from its profile
        raise StratumError("pipeline partition 'profiled' names a cut from a profile: give the profile's file "
                           "(partition=p.json, from `stratum profile --out p.json`), or set parallel.plan = \"auto\" "
                           "to train the search's choice")
    if p.partition not in PARTITIONS and not p.partition.endswith(".json"):
        raise StratumError(f"pipeline partition {p.partition!r} is not one of: {', '.join(PARTITIONS)}, or a "
                           "profile .json file")
    sched = make_schedule(p, microbatches)
    S, n = sched.num_stages, len(model)
    if S > n:
        raise StratumError(
            f"pipeline.schedule = {p.schedule!r} on {p.ranks} ranks needs {S} stages but the model has only {n} "
            f"blocks; lower pipeline.ranks (or pipeline.waves / pipeline.virtual) or use a deeper model")
    if p.partition == "even":
        stages = even_partition(n, S)
    elif p.partition == "balanced":
        weights = [float(sum(q.numel() for q in b.parameters())) or 1.0 for b in model.blocks]
        stages = balanced_partition(weights, S, [speeds[r] for r in sched.stage_to_rank] if speeds else None)
    else:  # a Profile JSON: every rank reads the same file, so every rank computes the same cut
        prof = Profile.load(p.partition)
        if len(prof.blocks) != n:
            raise StratumError(f"pipeline.partition: profile {p.partition} has {len(prof.blocks)} blocks but the "
                               f"model has {n}; profile this model with `stratum profile`")
        _check_same_blocks(prof, model, p.partition)
        stages = list(partition(prof, sched.stage_to_rank, speeds=speeds).stages)
    return PipelinePlan(schedule=sched, stages=stages)


def _check_same_blocks(prof: Profile, model: BlockSeq, path: str) -> None:
    """A profile of another model with as many blocks would cut this one by the other's times: each block must own
    as many parameters as it did when profiled."""
    for i, b in enumerate(prof.blocks):
        mine = model.owned_numel(i)
        if b.n_params != mine:
            raise StratumError(f"pipeline.partition: profile {path} is of another model (its {b.name} has "
                               f"{b.n_params:,} parameters, this model's block {i} {mine:,}); profile this model "
                               "with `stratum profile` and the run's settings")


# ---- the engine ---------------------------------------------------------------------------------------------
class PipelineEngine(GradEngine):
    """Runs this rank's stages of ``model`` under ``plan`` (see the module docstring) inside ``world``'s pipeline
    group: with replicas or splits around it, each (replica, split) slice of the mesh runs its own pipeline."""

    name = "pipeline"

    def __init__(self, model: BlockSeq, *, plan: PipelinePlan, optim: OptimSpec, world: World,
                 precision: str = "fp32", schedule_for: Callable[[int], Schedule] | None = None,
                 make_optimizer: MakeOptimizer | None = None):
        self.rank, self.world = world.coord.stage_rank, world.size("stage_rank")
        sched = plan.schedule
        if sched.num_ranks != self.world:
            raise StratumError(f"schedule {sched.name} has {sched.num_ranks} ranks but the pipeline has "
                               f"{self.world} processes")
        self.mesh = world
        self.group = world.group("stage_rank")
        self.peers = tuple(world.members["stage_rank"])
        self.plan = plan
        self.schedule_for = schedule_for
        self.schedules = {sched.num_microbatches: sched}
        self.device = device = world.device
        self.precision = precision
        self.spec = optim
        self.timeout_s = world.timeout_s
        self.backend = world.backend
        self.model = model
        if self.backend == "nccl":
            bad = channel_order_mismatches(sched)
            if bad:  # NCCL ignores tags and pairs the messages of a channel first-in-first-out
                raise StratumError(f"schedule {sched.name} receives messages in another order than it sends "
                                   f"them ({bad[0]}); NCCL cannot run it: use parallel.backend = 'gloo'")
        # one collective before any point-to-point (NCCL wants every rank in the group's first call) that also
        # proves every rank is alive
        world.all_reduce(torch.zeros(1, device=device), "stage_rank", "the start-up all-reduce")
        where = sched.stage_to_rank
        stage_of_block = {i: s for s, r in enumerate(plan.stages) for i in r}
        self.my_blocks = plan.blocks_of(self.rank)
        localize(model, set(self.my_blocks), device)

        # canonical name -> parameter, for this rank's blocks (a tied tensor once, under its owner's name)
        alias = {n: g.owner for g in model.tied for n in g.names}
        named: dict[str, nn.Parameter] = {}
        for i in self.my_blocks:
            for name, p in model.blocks[i].named_parameters(remove_duplicate=False):
                named.setdefault(alias.get(f"blocks.{i}.{name}", f"blocks.{i}.{name}"), p)
        self.named = list(named.items())
        self.order = [n for n, _ in model.named_parameters()]
        """Every parameter's canonical name in the whole model's order (the plain engine's, for the norm)."""

        # tied tensors spread over several pipeline ranks: a sub-group each
        self.tied_sync: list[tuple[nn.Parameter, object]] = []
        self.not_counted: set[str] = set()
        for g in model.tied:
            holders = sorted({where[stage_of_block[int(n.split(".")[1])]] for n in g.names})
            if len(holders) < 2:
                continue
            grp = world.subgroup("stage_rank", holders)
            if self.rank in holders:
                self.tied_sync.append((named[g.owner], grp))
                if self.rank != holders[0]:
                    self.not_counted.add(g.owner)  # its norm is counted on the first holder only
        self.opt = self._leaf_optimizer(make_optimizer)
        self.runtime = StageRuntime(blocks=list(model.blocks), stages=plan.stages, stage_to_rank=where,
                                    loss_fn=model.loss_fn, rank=self.rank, peers=self.peers, device=device,
                                    precision=precision, timeout_s=self.timeout_s, backend=self.backend,
                                    runner=self._stage_runner())

    # ---- the leaf: what runs this rank's blocks and updates their parameters ---------------------------------
    def _leaf_optimizer(self, make_optimizer: MakeOptimizer | None) -> Optimizer | None:
        """The optimizer over this rank's parameters (the plan's, or the local AdamW)."""
        return leaf_optimizer(make_optimizer, self.named, self.spec, self.device)

    def _opt(self) -> Optimizer:
        """``opt``, there wherever these methods run (a leaf that carries its own AdamW overrides them)."""
        assert self.opt is not None
        return self.opt

    def _stage_runner(self) -> StageBlocks | None:
        """How this rank's blocks run (None: as modules on the device)."""
        return None

    def _sync_tied(self) -> None:
        """Sum the gradients of tensors tied across pipeline ranks, after the schedule has run."""
        for p, grp in self.tied_sync:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.mesh.wait(dist.all_reduce(p.grad, group=grp, async_op=True), "summing a tied gradient")

    def _schedule(self, m: int) -> Schedule:
        sched = self.schedules.get(m)
        if sched is None:
            if self.schedule_for is None:
                raise StratumError(f"the pipeline schedule is for {self.plan.schedule.num_microbatches} "
                                   f"micro-batches per step, got {m}")
            sched = self.schedule_for(m)
            if tuple(sched.stage_to_rank) != tuple(self.plan.schedule.stage_to_rank):
                raise StratumError(f"schedule for {m} micro-batches places stages differently")
            self.schedules[m] = sched
        return sched

    # ---- Engine ---------------------------------------------------------------------------------------
    def forward_backward(self, micro_batches: list[Batch], divisor: int) -> torch.Tensor:
        loss_sum = self.runtime.run(self._schedule(len(micro_batches)), micro_batches, training=True,
                                    scale=1.0 / divisor)
        self._sync_tied()
        return self.mesh.all_reduce(loss_sum.to(torch.float64), "stage_rank", "the loss all-reduce")

    def grad_params(self) -> list[tuple[str, nn.Parameter]]:
        return self.named

    def norm_counted(self) -> set[str]:
        return {n for n, _ in self.named if n not in self.not_counted}

    def local_named_norms(self) -> list[tuple[str, torch.Tensor]] | None:
        """(canonical name, norm) of this rank's counted gradients; None where a stage's gradients are split
        (DTensor: their norms are collectives of their own)."""
        counted = self.norm_counted()
        live = [(n, p) for n, p in self.grad_params() if n in counted and p.grad is not None]
        if any(isinstance(p.grad, DTensor) for _, p in live):
            return None
        norms = grad_norms([p for _, p in live])  # (one zero entry where there are none: zip drops it)
        return [(n, x) for (n, _), x in zip(live, norms)]

    def grad_norm(self) -> torch.Tensor:
        """The plain engine's norm, bit for bit: each counted parameter's norm gathered over the pipeline ranks in
        the whole model's order (World.gathered_norm) — except where a stage's gradients are split, summed as
        squares over the ranks."""
        named = self.local_named_norms()
        if named is None:
            return super().grad_norm()
        return self.mesh.gathered_norm(named, self.order, ("stage_rank",))

    def reduce_norm(self, norms: torch.Tensor) -> torch.Tensor:
        sq = norms.to(self.device, torch.float64).pow(2).sum()
        return self.mesh.all_reduce(sq, "stage_rank", "the gradient-norm all-reduce").sqrt().float()

    def update(self, lr: float, coef: torch.Tensor) -> None:
        self._opt().step(lr, coef)

    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> float:
        n = len(batches)
        where = self.plan.schedule.stage_to_rank
        acts = [[Action("F", s, mb) for s in range(len(where)) if where[s] == r for mb in range(n)]
                for r in range(self.world)]
        sched = Schedule(name="forward", stage_to_rank=where, num_microbatches=n, actions=acts)
        with evaluating(self.model.blocks[i] for i in self.my_blocks):
            loss_sum = self.runtime.run(sched, batches, training=False, scale=1.0)
        red = self.mesh.all_reduce(loss_sum.reshape(1).clone(), "stage_rank", "the eval-loss all-reduce")
        return float(red[0]) / n

    def _local_state(self) -> TrainState:
        """This rank's parameters, optimizer state and its own blocks' buffers, under canonical names."""
        return TrainState(params={n: full_tensor(p) for n, p in self.named}, optim=self._opt().export(),
                          buffers=buffers_to_cpu(self.model, self.my_blocks))

    def _local_parts(self) -> Iterable[TrainState]:
        """:meth:`_local_state` in parts (one here; the memory engine's leaf gives a chunk at a time)."""
        return [self._local_state()]

    def state(self) -> TrainState:
        return merge_states(self.state_parts())

    def state_parts(self) -> Iterator[TrainState]:
        """Every rank's parts, gathered a part from each rank at a time to the first rank of this pipeline (each
        replica's pipeline holds a whole copy), which yields them; the others yield nothing. Collective: every
        rank of the pipeline runs it to its end, so the first rank holds one part of each rank at a time."""
        mine = iter(self._local_parts())
        if self.group is None:
            yield from mine
            return
        while True:
            part = next(mine, None)
            more = torch.tensor([float(part is not None)], device=self.device)
            if not self.mesh.all_reduce(more, "stage_rank", "the checkpoint's parts count").item():
                return
            got = self.mesh.gather_to_first(part, "stage_rank", "a part of the training state")
            yield from (p for p in got or [] if p is not None)

    def load_state(self, state: TrainState) -> None:
        load_params(self.named, state)
        self._opt().load(state.optim)
        load_buffers(self.model, state.buffers)  # other ranks' blocks are on meta here: skipped

    def memory_stats(self) -> dict[str, int]:
        return {"peak_device_bytes": peak_memory_bytes(self.device), "optim_state_bytes": self._opt().state_bytes()}
