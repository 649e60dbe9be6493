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

import datetime
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from stratum.config import Config, PipelineConfig
from stratum.data.tokens import Batch
from stratum.dist.launch import PeerError, resolve_backend, short_reason, wait_until
from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq
from stratum.model.neutral import buffers_to_cpu, load_buffers
from stratum.runtime.device import peak_memory_bytes
from stratum.runtime.engine import Engine, OptimSpec, StepResult, TrainState
from stratum.runtime.optim import export_state, load_train_state, make_adamw
from stratum.runtime.stage import StageRuntime
from stratum.schedule.ir import Action, Schedule


# ---- planning: schedule + partition, checked before any process starts ----------------------------------------
@dataclass(frozen=True)
class PipelinePlan:
    schedule: Schedule
    stages: list[range]
    """Blocks of each stage (contiguous, in order)."""

    def blocks_of(self, rank: int) -> list[int]:
        return sorted(i for s in self.schedule.stages_of(rank) for i in self.stages[s])


def make_schedule(p: PipelineConfig, microbatches: int) -> Schedule:
    """The schedule ``pipeline.schedule`` names (a generator kind or a text file) for ``microbatches``."""
    from stratum.schedule.generators import KINDS, generate

    if p.schedule in KINDS:
        try:
            return generate(p.schedule, ranks=p.ranks, microbatches=microbatches, virtual=p.virtual,
                            waves=p.waves)
        except StratumError as e:
            raise StratumError(f"pipeline.schedule = {p.schedule!r} with pipeline.ranks = {p.ranks} and "
                               f"{microbatches} micro-batches (train.grad_accum): {e}") from None
    path = Path(p.schedule).expanduser()
    if not path.is_file():
        raise StratumError(f"pipeline.schedule = {p.schedule!r} is neither a schedule kind ({', '.join(KINDS)}) "
                           "nor an existing schedule file")
    from stratum.schedule.textio import load
    sched = load(path)  # validated
    if sched.num_ranks != p.ranks:
        raise StratumError(f"schedule file {path} has {sched.num_ranks} ranks but pipeline.ranks = {p.ranks}")
    if sched.num_microbatches != microbatches:
        raise StratumError(f"schedule file {path} has {sched.num_microbatches} micro-batches but "
                           f"train.grad_accum = {microbatches}; set train.grad_accum = {sched.num_microbatches}")
    return sched


def balanced_partition(weights: list[float], num_stages: int) -> list[range]:
    """Contiguous cut of blocks with ``weights`` into ``num_stages`` non-empty stages minimising the heaviest
    stage (dynamic programming; ties go to the earliest cut)."""
    n = len(weights)
    if num_stages < 1 or num_stages > n:
        raise StratumError(f"cannot cut {n} blocks into {num_stages} non-empty stages")
    pre = [0.0]
    for w in weights:
        pre.append(pre[-1] + w)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], pre[j] - pre[i])
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    out, j = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        out.append(range(i, j))
        j = i
    return out[::-1]


def plan_pipeline(cfg: Config, model: BlockSeq) -> PipelinePlan:
    """Schedule and stage partition for ``model`` (may live on ``meta``); one-line errors for what cannot run."""
    p = cfg.pipeline
    sched = make_schedule(p, cfg.train.grad_accum)
    S, n = sched.num_stages, len(model)
    if S > n:
        raise StratumError(
            f"pipeline.schedule = {p.schedule!r} on {p.ranks} ranks needs {S} stages but the model has only {n} "
            f"blocks; lower pipeline.ranks (or pipeline.waves / pipeline.virtual) or use a deeper model")
    if p.partition == "even":
        from stratum.sim.pipeline import even_partition
        stages = even_partition(n, S)
    elif p.partition == "balanced":
        weights = [float(sum(q.numel() for q in b.parameters())) or 1.0 for b in model.blocks]
        stages = balanced_partition(weights, S)
    else:  # a Profile JSON: every rank reads the same file, so every rank computes the same cut
        from stratum.plan.partition import partition
        from stratum.profile.profile import Profile
        prof = Profile.load(p.partition)
        if len(prof.blocks) != n:
            raise StratumError(f"pipeline.partition: profile {p.partition} has {len(prof.blocks)} blocks but the "
                               f"model has {n}; profile this model with `stratum profile`")
        stages = list(partition(prof, sched.stage_to_rank).stages)
    return PipelinePlan(schedule=sched, stages=stages)


# ---- materialising only this rank's blocks ------------------------------------------------------------------
def _replace_tensors(model: BlockSeq, make: Callable[[nn.Parameter | torch.Tensor, bool], torch.Tensor | None]
                     ) -> None:
    """Swap every parameter/buffer ``t`` for ``make(t, is_param)`` (None keeps it), the same object for all
    occurrences of one tensor so ties survive."""
    memo: dict[int, torch.Tensor] = {}
    keep_alive = []
    for mod in model.modules():
        for store, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in list(store.items()):
                if t is None:
                    continue
                if id(t) not in memo:
                    keep_alive.append(t)
                    new = make(t, is_param)
                    memo[id(t)] = t if new is None else new
                store[name] = memo[id(t)]


def _param_like(t: torch.Tensor, data: torch.Tensor, is_param: bool) -> torch.Tensor:
    return nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data


def localize(model: BlockSeq, keep: set[int], device: torch.device) -> BlockSeq:
    """Keep blocks ``keep`` on ``device`` and move every tensor used only by other blocks to ``meta`` (freed)."""
    keep_ids = {id(t) for i in keep for t in [*model.blocks[i].parameters(), *model.blocks[i].buffers()]}

    def make(t, is_param):
        if id(t) in keep_ids:
            if t.device == device:
                return None
            return _param_like(t, t.detach().to(device), is_param)
        if t.device.type == "meta":
            return None
        return _param_like(t, torch.empty_like(t, device="meta"), is_param)

    with torch.no_grad():
        _replace_tensors(model, make)
    return model


def materialize_gpt(model: BlockSeq, keep: set[int], seed: int, device: torch.device) -> BlockSeq:
    """A GPT built on ``meta``: allocate and initialise blocks ``keep`` (from (seed, i) alone) on ``device``.

    The owner block of a tied parameter a kept block uses is initialised too (that is where the tensor's values
    come from), then everything not kept goes back to ``meta``.
    """
    from stratum.model.gpt import init_gpt_block

    owner_block = {}
    for g in model.tied:
        blocks = {int(n.split(".")[1]) for n in g.names}
        if blocks & keep:
            owner_block[int(g.owner.split(".")[1])] = True
    init = set(keep) | set(owner_block)
    ids = {id(t) for i in init for t in [*model.blocks[i].parameters(), *model.blocks[i].buffers()]}

    def make(t, is_param):
        if id(t) in ids and t.device.type == "meta":
            return _param_like(t, torch.empty(t.shape, dtype=t.dtype), is_param)
        return None

    with torch.no_grad():
        _replace_tensors(model, make)
    for i in sorted(init):
        init_gpt_block(model, i, seed)
    return localize(model, keep, device)


def build_local_model(cfg: Config, *, rank: int, tokenizer_vocab: int, seq_len: int, seed: int,
                      device: torch.device) -> tuple[BlockSeq, PipelinePlan]:
    """The configured model with only ``rank``'s blocks materialised (on ``device``), and the pipeline plan."""
    from stratum.model.build import build_model

    meta = build_model(cfg.model, tokenizer_vocab=tokenizer_vocab, seq_len=seq_len, seed=seed, device="meta")
    plan = plan_pipeline(cfg, meta)
    keep = set(plan.blocks_of(rank))
    if cfg.model.source == "gpt":
        return materialize_gpt(meta, keep, seed, device), plan
    del meta
    full = build_model(cfg.model, tokenizer_vocab=tokenizer_vocab, seq_len=seq_len, seed=seed)
    return localize(full, keep, device), plan


def check_pipeline(cfg: Config, *, tokenizer_vocab: int = 1) -> PipelinePlan:
    """Everything about a pipeline config that can be checked without processes (the CLI runs this first)."""
    from stratum.model.build import build_model

    if cfg.train.engine != "pipeline":
        raise StratumError("check_pipeline needs train.engine = 'pipeline'")
    dev = torch.device("cuda" if cfg.train.device.startswith("cuda") or
                       (cfg.train.device == "auto" and torch.cuda.is_available()) else "cpu")
    resolve_backend(cfg.pipeline.backend, dev)
    if dev.type == "cuda" and torch.cuda.is_available() and cfg.pipeline.ranks > torch.cuda.device_count():
        raise StratumError(f"pipeline.ranks = {cfg.pipeline.ranks} but this machine has "
                           f"{torch.cuda.device_count()} GPU(s); start the other ranks on other machines with "
                           "torchrun, or lower pipeline.ranks")
    meta = build_model(cfg.model, tokenizer_vocab=tokenizer_vocab, seq_len=cfg.data.seq_len,
                       seed=cfg.train.seed, device="meta")
    return plan_pipeline(cfg, meta)


# ---- the engine ---------------------------------------------------------------------------------------------
class PipelineEngine(Engine):
    """Runs this rank's stages of ``model`` under ``plan`` (see the module docstring)."""

    name = "pipeline"

    def __init__(self, model: BlockSeq, *, plan: PipelinePlan, optim: OptimSpec, device: torch.device,
                 precision: str = "fp32", timeout_s: float = 30.0,
                 schedule_for: Callable[[int], Schedule] | None = None):
        if not dist.is_initialized():
            raise StratumError("the pipeline engine needs a process group (stratum.dist.launch)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        sched = plan.schedule
        if sched.num_ranks != self.world:
            raise StratumError(f"schedule {sched.name} has {sched.num_ranks} ranks but {self.world} processes run")
        self.plan = plan
        self.schedule_for = schedule_for
        self.schedules = {sched.num_microbatches: sched}
        self.device = device
        self.precision = precision
        self.spec = optim
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.backend = dist.get_backend()
        self.model = model
        if self.backend == "nccl":
            from stratum.schedule.validate import channel_order_mismatches
            bad = channel_order_mismatches(sched)
            if bad:  # NCCL ignores tags and pairs the messages of a channel first-in-first-out
                raise StratumError(f"schedule {sched.name} receives messages in another order than it sends "
                                   f"them ({bad[0]}); NCCL cannot run it: use pipeline.backend = 'gloo'")
        # one collective before any point-to-point (NCCL wants every rank in the group's first call) that also
        # proves every rank is alive
        self._collective(dist.all_reduce(torch.zeros(1, device=device), async_op=True), "the start-up all-reduce")
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

        # tied tensors spread over several ranks: a sub-group each (new_group is collective: every rank calls it)
        self.tied_sync: list[tuple[nn.Parameter, object]] = []
        not_counted: set[str] = set()
        for g in model.tied:
            holders = sorted({where[stage_of_block[int(n.split(".")[1])]] for n in g.names})
            if len(holders) < 2:
                continue
            grp = dist.new_group(holders, timeout=self.timeout)
            if self.rank in holders:
                self.tied_sync.append((named[g.owner], grp))
                if self.rank != holders[0]:
                    not_counted.add(g.owner)  # its norm is counted on the first holder only
        self.norm_params = [p for n, p in self.named if n not in not_counted]
        self.opt = make_adamw(self.named, optim, device)
        self.runtime = StageRuntime(blocks=list(model.blocks), stages=plan.stages, stage_to_rank=where,
                                    loss_fn=model.loss_fn, rank=self.rank, device=device, precision=precision,
                                    timeout_s=timeout_s, backend=self.backend)

    # ---- collectives with deadlines -------------------------------------------------------------------
    def _collective(self, work, what: str) -> None:
        try:
            wait_until(work, backend=self.backend, deadline=time.monotonic() + self.timeout_s)
        except (TimeoutError, RuntimeError) as e:
            msg = short_reason(e) if str(e).strip() else "timed out"
            raise PeerError(f"rank {self.rank}: {what} failed ({msg}); a pipeline rank died or hung — "
                            "stopping") from None

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

    def _set_mode(self, training: bool) -> None:
        for i in self.my_blocks:
            self.model.blocks[i].train(training)

    # ---- Engine ---------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult:
        self._set_mode(True)
        n = len(micro_batches)
        loss_sum = self.runtime.run(self._schedule(n), micro_batches, training=True, scale=1.0 / n)
        for p, grp in self.tied_sync:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._collective(dist.all_reduce(p.grad, group=grp, async_op=True), "summing a tied gradient")
        grads = [p.grad for p in self.norm_params if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if grads:
            norms = torch._foreach_norm(grads, 2.0)
            sq = torch.stack([x.double() for x in norms]).pow(2).sum()
        red = torch.stack([sq, loss_sum.to(torch.float64)])
        self._collective(dist.all_reduce(red, async_op=True), "the gradient-norm all-reduce")
        total_norm = red[0].sqrt().float()
        clip = self.spec.grad_clip if self.spec.grad_clip > 0 else math.inf
        coef = torch.clamp(clip / (total_norm + 1e-6), max=1.0)
        all_grads = [p.grad for _, p in self.named if p.grad is not None]
        if all_grads:
            torch._foreach_mul_(all_grads, coef.to(all_grads[0].device))
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return StepResult(loss=float(red[1]) / n, grad_norm=float(total_norm))

    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> float:
        self._set_mode(False)
        n = len(batches)
        where = self.plan.schedule.stage_to_rank
        acts = [[Action("F", s, mb) for s in range(len(where)) if where[s] == r for mb in range(n)]
                for r in range(self.world)]
        sched = Schedule(name="forward", stage_to_rank=where, num_microbatches=n, actions=acts)
        loss_sum = self.runtime.run(sched, batches, training=False, scale=1.0)
        red = loss_sum.reshape(1).clone()
        self._collective(dist.all_reduce(red, async_op=True), "the eval-loss all-reduce")
        return float(red[0]) / n

    def state(self) -> TrainState:
        mine = TrainState(params={n: p.detach().to("cpu", copy=True) for n, p in self.named},
                          optim=export_state(self.opt, self.named),
                          buffers=buffers_to_cpu(self.model, self.my_blocks))  # each rank its own blocks'
        got: list = [None] * self.world if self.rank == 0 else None
        try:
            dist.gather_object(mine, got, dst=0)
        except RuntimeError as e:
            raise PeerError(f"rank {self.rank}: gathering the training state failed ({short_reason(e)}); "
                            "a pipeline rank died or hung — stopping") from None
        if self.rank != 0:
            return TrainState(params={}, optim={})
        full = TrainState(params={}, optim={})
        for st in got:
            full.params.update(st.params)
            full.optim.update(st.optim)
            full.buffers.update(st.buffers)
        return full

    def load_state(self, state: TrainState) -> None:
        load_train_state(self.opt, self.named, state)
        load_buffers(self.model, state.buffers)  # other ranks' blocks are on meta here: skipped

    def memory_stats(self) -> dict[str, int]:
        return {"peak_device_bytes": peak_memory_bytes(self.device)}
