"""The pipeline node over the offload leaf: each pipeline rank keeps its stages' training state in chunks over its
own device, host and disk tiers, under the leaf's budgets.

Each rank's blocks form a BlockSeq of their own (``blocks.<k>`` there is block ``blocks_of(rank)[k]`` of the
whole model) that the memory engine packs and plans; its blocks run through
:class:`~stratum.offload.stage_blocks.OffloadBlocks` when the schedule says. The plan comes from the whole
model's per-block profile (a block another rank holds is measured as a temporary copy), cut to this rank's
blocks (:func:`stage_profile`), with the micro-batches each block's stage holds at once under the schedule
(:func:`stage_inflight`, Placement.inflight): the planner prices the in-flight activations kept on the device,
checkpointed (each block's input kept, the block recomputed in the backward) or checkpointed and spilled to the
host tier, and takes the fastest that fits the leaf's budgets (the plan says which). A tensor tied to another pipeline
rank (the GPT embedding ↔ head) is summed with the other holders when the schedule has run, as the pipeline does
for its local leaf; the global gradient norm is the pipeline's (each rank's part of it, summed over the ranks).
Checkpoints use the whole model's names, so they move to and from every other plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from stratum.config import Config
from stratum.data.tokens import Batch
from stratum.errors import StratumError
from stratum.ir.plan import Offload
from stratum.model.blockseq import BlockSeq
from stratum.model.placement import stage_block_init
from stratum.offload.placement import Placement
from stratum.offload.planner import NoFit
from stratum.offload.setup import offload_engine, placement_for, quick_profile
from stratum.offload.stage_blocks import OffloadBlocks
from stratum.parallel.reduce import Pending, Reducer
from stratum.plan.partition import inflight_from_schedule
from stratum.profile.profile import BlockProfile, Profile
from stratum.runtime.engine import StepResult, TrainState, renamed
from stratum.runtime.optim import MakeOptimizer, Optimizer
from stratum.runtime.pipeline import PipelineEngine, PipelinePlan
from stratum.runtime.stage import StageBlocks
from stratum.schedule.ir import Schedule
from stratum.units import fmt_at_least


def leaf_config(cfg: Config, leaf: Offload) -> Config:
    """``cfg`` with the leaf's budgets in ``[offload]`` (an empty one keeps the section's)."""
    budgets = {k: v for k, v in dataclasses.asdict(leaf).items() if v}
    return dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, **budgets))


def stage_inflight(plan: PipelinePlan, mine: list[int]) -> tuple[int, ...]:
    """Per block of ``mine``: the micro-batches its stage holds at once under the plan's schedule."""
    inflight = inflight_from_schedule(plan.schedule)
    stage_of = {i: s for s, r in enumerate(plan.stages) for i in r}
    return tuple(inflight[stage_of[g]] for g in mine)


def stage_profile(prof: Profile, plan: PipelinePlan, mine: list[int], sub: BlockSeq) -> Profile:
    """A pipeline rank's blocks' costs from the whole model's profile (:func:`stage_block_costs`), with the
    ties of its own BlockSeq ``sub``."""
    return dataclasses.replace(prof, blocks=stage_block_costs(prof, plan, mine), tied=[list(t.names) for t in sub.tied])


def stage_block_costs(prof: Profile, plan: PipelinePlan, mine: list[int]) -> list[BlockProfile]:
    """A pipeline rank's blocks (``mine``) renumbered from 0, per micro-batch (the planner multiplies by
    :func:`stage_inflight`): a block's saved activations with its input (which the runner keeps) — a stage's last
    block also with the gradient of its output, which its backward receives (the last stage's: of the logits) —,
    its checkpoint (``out_bytes``: its input, and a stage's last block also its output, which the runtime holds
    until the backward) and of that what a spill moves to the host (``spill_bytes``: the input; token ids for
    block 0). Kept activations count a stage end's gradient once per micro-batch in flight, where only the one
    in its backward holds it: an over-estimate of a hidden state's bytes per extra micro-batch."""
    last = {r[-1] for r in plan.stages}
    tokens = prof.micro_batch * prof.seq_len * 8  # int64 token ids
    blocks = []
    for k, g in enumerate(mine):
        b, before = prof.blocks[g], prof.blocks[g - 1] if g else None
        # the model's last stage: its output is the logits (the runtime takes the loss over them)
        end = (b.logits_bytes or 0) if g == len(prof.blocks) - 1 else b.out_bytes
        act, out, spill = _stage_bytes(b.act_saved_bytes, before.out_bytes if before else tokens, end, g in last)
        cut = dataclasses.replace(b, index=k, act_saved_bytes=act, out_bytes=out, spill_bytes=spill)
        if b.half_act_saved_bytes is not None:  # the same columns measured on 16-bit chunks (Placement.half_params)
            inp = (before.half_out_bytes or before.out_bytes) if before else tokens
            end = (b.logits_bytes or 0) if g == len(prof.blocks) - 1 else (b.half_out_bytes or 0)
            act, out, spill = _stage_bytes(b.half_act_saved_bytes, inp, end, g in last)
            cut = dataclasses.replace(cut, half_act_saved_bytes=act, half_out_bytes=out, half_spill_bytes=spill)
        blocks.append(cut)
    return blocks


def _stage_bytes(saved: int, inp: int, out: int, last: bool) -> tuple[int, int, int]:
    """(saved activations, checkpoint, spilled) of a stage's block whose own saved tensors are ``saved``, its
    input ``inp`` and its output ``out`` bytes; ``last``: the stage's last block (its output is held, and its
    output's gradient arrives for its backward)."""
    end = out if last else 0
    return saved + inp + end, inp + end, inp


def rank_placement(cfg: Config, model: BlockSeq, plan: PipelinePlan, mine: list[int], device: torch.device,
                   prof: Profile) -> Placement:
    """The placement of a pipeline rank's blocks ``mine`` under ``cfg.offload``, from the whole model's profile:
    its in-flight micro-batches' activations kept, checkpointed or spilled, as the planner finds fastest within
    the budgets (Placement.inflight)."""
    sub = model.part(mine)
    return placement_for(handoff_config(cfg, plan, mine), sub, device, profile=stage_profile(prof, plan, mine, sub),
                         inflight=stage_inflight(plan, mine))


def several_stages(plan: PipelinePlan, mine: list[int]) -> bool:
    """The rank holding blocks ``mine`` runs several of the plan's stages (interleaved, wave)."""
    held = set(mine)
    return sum(r[0] in held for r in plan.stages) > 1


def handoff_config(cfg: Config, plan: PipelinePlan, mine: list[int]) -> Config:
    """``cfg`` for a rank holding blocks ``mine``: on a rank running several stages (interleaved, wave) 16-bit
    gradients go home a tensor at a time. The per-chunk hand-off gathers one micro-batch's gradients of a chunk
    from its last block's backward to its first's, and such a rank runs other micro-batches' backwards in
    between (a chunk, or the tied embedding and head, spanning two of its stages)."""
    if not several_stages(plan, mine):
        return cfg
    if cfg.offload.grad_handoff == "chunk":
        raise StratumError("offload.grad_handoff = 'chunk' does not run on a pipeline rank holding several stages "
                           f"(schedule {plan.schedule.name}); use 'auto' or 'tensor' there, or a schedule with one "
                           "stage per rank (gpipe, 1f1b)")
    return dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, grad_handoff="tensor"))


def check_schedule(schedule: Schedule) -> None:
    """Refuse a schedule the offload leaf cannot run: one that splits the backward (its W would need the chunks
    of a block whose gradient the engine has already handed home)."""
    if any(a.kind in "IW" for acts in schedule.actions for a in acts):
        raise StratumError(f"schedule {schedule.name} splits the backward (I/W), which the offload leaf does not "
                           "run; use gpipe, 1f1b, interleaved or wave under pipeline(…, offload(…))")


class OffloadPipelineEngine(PipelineEngine):
    """A pipeline whose ranks run their blocks through the memory engine (see the module docstring)."""

    def __init__(self, model: BlockSeq, *, cfg: Config, leaf: Offload, owns: Callable[[int], bool] | None = None,
                 **kw):
        self.cfg = leaf_config(cfg, leaf)
        self.owns = owns
        """The chunks whose AdamW state and update are this rank's (a sharding parent's choice); None: all."""
        self.gather_optim: Callable[[Mapping], Mapping] | None = None
        """A sharding parent's merge of the replicas' optimizer states before the pipeline gathers its ranks'."""
        super().__init__(model, **kw)
        check_schedule(self.plan.schedule)

    # ---- the leaf ---------------------------------------------------------------------------------------------
    def _leaf_optimizer(self, make_optimizer: MakeOptimizer | None) -> Optimizer | None:
        if make_optimizer is not None:
            raise StratumError("a sharded optimizer cannot run over the offload leaf; its chunks carry AdamW")
        return None  # every chunk carries its own AdamW state

    def _stage_runner(self) -> StageBlocks:
        model, plan = self.model, self.plan
        mine = self.my_blocks
        sub = self.sub = model.part(mine)
        if model.block_init is not None:  # built lazily: each block gets its values as the engine packs it
            sub.block_init = stage_block_init(model, mine)
        alias = {n: g.owner for g in model.tied for n in g.names}
        self.to_global: dict[str, str] = {}
        """Canonical name in this rank's BlockSeq → canonical name in the whole model."""
        for k, g in enumerate(mine):
            for name, _ in model.blocks[g].named_parameters(remove_duplicate=False):
                self.to_global.setdefault(f"blocks.{k}.{name}", alias.get(f"blocks.{g}.{name}", f"blocks.{g}.{name}"))
            for name, _ in model.blocks[g].named_buffers():
                self.to_global[f"blocks.{k}.{name}"] = f"blocks.{g}.{name}"
        self.to_local = {self.to_global[n]: n for n, _ in [*sub.named_parameters(), *sub.named_buffers()]}
        cfg = self.cfg
        placement = self._agreed(lambda: rank_placement(cfg, model, plan, mine, self.device, self._profile(cfg)))
        # a split group's ranks re-run a recomputed block's collectives together: they run split rank 0's placement
        placement = self.mesh.share_object(placement, "split", "the offload placement")
        # replicas reduce chunk by chunk in layout order, so a stage's replicas run one layout: replica 0's
        placement = self.mesh.share_object(placement, "replica", "the offload placement")
        title = f"pipeline rank {self.rank} (blocks {mine[0]}–{mine[-1]}), process {self.mesh.rank}:"
        self.leaf = offload_engine(cfg, sub, self.device, placement, self.owns, title)
        tied = {id(p): grp for p, grp in self.tied_sync}
        groups = {ln: tied[id(p)] for ln, p in sub.named_parameters() if id(p) in tied}
        self.leaf.reducer = self._tied_reducer(groups)
        late = {self.leaf.where[ln][0].i for ln in groups}
        local = {g: k for k, g in enumerate(mine)}
        stages = {s: list(plan.stages[s]) for s in plan.schedule.stages_of(self.rank)}
        order = [(a.stage, a.mb) for a in plan.schedule.actions[self.rank] if a.kind == "B"]
        self.runner = OffloadBlocks(self.leaf, stage_blocks=stages, local=local, late=late, order=order)
        return self.runner

    def _agreed(self, make_placement):
        """``make_placement()`` on every rank. Where some rank's budget cannot fit, every rank stops with one line,
        the same on each where only the device budget is short: the smallest device budget that fits every rank
        (each rank's planner finds its own; the largest of them fits them all) — rather than each rank its own
        figure, or the others waiting for it."""
        try:
            placement, failure = make_placement(), None
        except StratumError as e:
            placement, failure = None, e
        # per rank: 0 fits, else the smallest device budget it needs (-1: not known, or another error)
        need = 0.0 if failure is None else float(failure.smallest_device or -1) if isinstance(failure, NoFit) \
            else -1.0
        needs = self.mesh.gather_floats(need)
        failed = [r for r, x in enumerate(needs) if x]
        if not failed:
            return placement
        if all(needs[r] > 0 for r in failed):
            low, o = int(max(needs)), self.cfg.offload
            raise StratumError(f"offload: no placement fits the stages of rank(s) {', '.join(map(str, failed))} under "
                               f"device_budget = {o.device_budget or 'unlimited'} and host_budget = "
                               f"{o.host_budget or 'unlimited'}; the smallest device budget that fits every rank "
                               f"at this host budget is {fmt_at_least(low, None)} ({low:,} bytes; per rank: "
                               + ", ".join(f"{r}: {int(needs[r]):,}" for r in failed) + ")")
        if failure is not None:
            raise failure
        raise StratumError(f"process(es) {', '.join(map(str, failed))} found no offload placement for their "
                           "pipeline stages (their message says why); stopping")

    def _profile(self, cfg: Config) -> Profile:
        return quick_profile(self.model, micro_batch=cfg.train.micro_batch_size, seq_len=cfg.data.seq_len,
                             device=self.device, precision=cfg.train.precision, seed=cfg.train.seed)

    def _tied_reducer(self, groups: dict[str, object]) -> Reducer:
        """Sum the gradients of tensors tied to other pipeline ranks (``groups``: local name → its group), in
        place: the chunks holding them complete after the schedule (:meth:`OffloadBlocks.finish`)."""

        def reduce(names: list[str], grads: list[torch.Tensor], what: str) -> Pending:
            works, tied = [], []
            for name, g in zip(names, grads):
                grp = groups.get(name)
                if grp is not None:
                    works.append(torch.distributed.all_reduce(g, group=grp, async_op=True))
                    tied.append(self.to_global[name])
            return Pending(works=works, wait=self.mesh.wait, what=f"summing the tied gradient(s) {', '.join(tied)}")
        return reduce

    def _sync_tied(self) -> None:
        self.runner.finish()

    # ---- GradEngine ---------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult:
        self.runner.begin_step(lr, len(micro_batches))
        return super().train_step(micro_batches, lr)

    def local_named_norms(self) -> list[tuple[str, torch.Tensor]]:
        """(whole model's name, norm) of this rank's counted gradients, from its memory engine (of the chunks it
        owns, under a sharding parent)."""
        counted = self.norm_counted()
        return [(self.to_global[ln], n) for ln, n in self.leaf.grad_norms_now() if self.to_global[ln] in counted]

    def update(self, lr: float, coef: torch.Tensor) -> None:
        self.leaf.apply_updates(coef if self.leaf._deferred else None)
        self.leaf.end_step()

    def grad_params(self) -> list[tuple[str, nn.Parameter]]:
        return self.named

    # ---- Engine -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> float:
        self.leaf.ready_for_eval()
        return super().eval_loss(batches)

    def _local_parts(self) -> Iterator[TrainState]:
        """The leaf's state a chunk at a time under the whole model's names (a sharding parent's replicas'
        AdamW state merged part by part: every replica's rank runs the same layout's parts)."""
        for st in self.leaf.state_parts():
            optim = {self.to_global[n]: s for n, s in st.optim.items()}
            yield TrainState(params={self.to_global[n]: t for n, t in st.params.items()},
                             optim=self.gather_optim(optim) if self.gather_optim is not None else optim,
                             buffers={self.to_global[n]: t for n, t in st.buffers.items()})

    def load_state(self, state: TrainState) -> None:
        # views under this rank's names: a checkpoint's tensors are read as the leaf asks for them
        mine = TrainState(params=renamed(state.params, self.to_local), optim=renamed(state.optim, self.to_local),
                          buffers=renamed(state.buffers, self.to_local))
        self.leaf.load_state(mine)

    def memory_stats(self) -> dict[str, int]:
        return self.leaf.memory_stats()

    def step_io(self) -> dict[str, float]:
        return self.leaf.step_io()

    def close(self) -> None:
        self.leaf.close()
        super().close()
