"""The library API: a user's own training loop runs its own model on any plan, with three added lines.

    import stratum
    engine = stratum.parallelize(model, plan="replicate(2, pipeline(2))", lr=3e-4)
    for x, y in batches:                 # the same global batch on every process
        loss = engine.step(x, y)         # forward, backward, gradient reduction, clipping, AdamW

``model`` is an ``nn.Sequential`` (its children become the blocks; ``loss_fn(output, y)`` ends it, next-token
cross-entropy by default), a transformers causal LM (GPT-2 or the Llama layout), or a :class:`BlockSeq`.

Runbook
-------
- One process: ``python script.py`` with a one-process plan (``local``, ``split(1)`` …).
- N processes on this machine: ``stratum run --nproc N script.py [args]`` (or ``torchrun --nproc_per_node N
  script.py``); N must be the plan's process count.
- Several machines: ``torchrun --nnodes M --nproc_per_node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT
  script.py`` on every machine, with a plan of M·N processes.

Every process builds the model the same way; the replicas start from rank 0's values (broadcast here), and each
process keeps only what the plan gives it (its pipeline stages, its split shards). ``engine.step`` cuts the
global batch into ``micro_batches × replicas`` micro-batches along the first dimension; the step equals the plain
engine's on the whole batch (mean reduction). Dropout masks are drawn per (``seed``, step, micro-batch, block), as
under ``stratum train``, so every plan draws the same ones: ``engine.steps_done`` counts the steps (set it to the
step a loaded state was saved at to continue the same masks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from stratum.config import Config, ParallelConfig, TrainConfig
from stratum.data.tokens import TRAIN, VAL, Batch
from stratum.dist.world import World, join_world, peers_checked
from stratum.errors import PeerError, StratumError
from stratum.hand_back import Given, check_free, check_given, give_back, given, hold, let_go, release_replaced
from stratum.ir.plan import Offload
from stratum.model.blockseq import BlockSeq, LossFn, lm_cross_entropy
from stratum.model.hf import from_transformers
from stratum.model.sequential import from_sequential
from stratum.parallel.compose import build_engine, rank_speeds
from stratum.runtime.device import resolve_device
from stratum.runtime.engine import Engine, TrainState
from stratum.seeds import mix


def as_blockseq(model: nn.Module, loss_fn: LossFn | None = None) -> BlockSeq:
    """The BlockSeq every engine runs, from the model kinds the API takes."""
    if isinstance(model, BlockSeq):
        return model
    if isinstance(model, nn.Sequential):
        return from_sequential(model, name="user", loss_fn=loss_fn or lm_cross_entropy)
    if hasattr(model, "config") and hasattr(model.config, "model_type"):
        return from_transformers(model)
    raise StratumError(f"stratum.parallelize takes an nn.Sequential, a transformers causal LM or a BlockSeq, "
                       f"not a {type(model).__name__}; wrap your layers in an nn.Sequential")


@dataclass
class Parallel:
    """A model on a plan: call :meth:`step` once per optimizer step."""

    engine: Engine
    world: World
    micro_batches: int
    lr: float
    model: BlockSeq
    """The model as given (wrapped as a BlockSeq): :meth:`close` writes the trained values back into it."""
    given: Given
    """Its tensors as given, and where: what :meth:`close` puts the trained values in."""
    seed: int = 0
    """Seeds the dropout masks' streams (with the step and the micro-batch)."""
    steps_done: int = 0
    """Optimizer steps taken: the step the next one's masks are drawn for."""
    batch_limit: tuple[int, int] | None = None
    """An offload leaf's planned micro-batch (rows, sequence length): the most device memory one may take."""
    closed: bool = False
    """After :meth:`close`: the model is the caller's again."""

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that should print and save."""
        return self.world.is_main

    def _open(self) -> None:
        if self.closed:
            raise StratumError("this engine is closed (close() gave the model back): parallelize the model again "
                               "to go on training it")

    def _split(self, x: torch.Tensor, y: torch.Tensor, split: int) -> list[Batch]:
        """The global batch's micro-batches, each with its dropout stream (as the trainer's data gives them)."""
        n = self.micro_batches * self.world.plan.replicas
        if x.shape[0] % n:
            raise StratumError(f"a batch of {x.shape[0]} rows cannot be cut into {n} equal micro-batches "
                               f"(micro_batches × replicas); use a multiple of {n}")
        if self.batch_limit is not None and (x.shape[0] // n > self.batch_limit[0]
                                             or (x.dim() > 1 and x.shape[1] > self.batch_limit[1])):
            raise StratumError(f"micro-batches of {(x.shape[0] // n, *x.shape[1:2])} are larger than the offload "
                               f"leaf planned its device memory for (batch_shape={self.batch_limit}); give "
                               "parallelize the largest batch_shape a step will take")
        return [Batch(x=a, y=b, stream=mix(self.seed, split, self.steps_done, i))
                for i, (a, b) in enumerate(zip(x.chunk(n), y.chunk(n)))]

    def step(self, x: torch.Tensor, y: torch.Tensor, *, lr: float | None = None) -> float:
        """One optimizer step on the global batch ``(x, y)``; its mean loss (equal on every process)."""
        self._open()
        if lr is not None and not (isinstance(lr, (int, float)) and 0 <= lr < math.inf):
            raise StratumError(f"step(lr={lr!r}): the learning rate must be a finite number ≥ 0")
        with peers_checked(self.world):  # a peer gone mid-exchange: one PeerError, not the backend's traceback
            if self.steps_done == 0:  # each process cutting its own batch (DDP's habit) would train silently wrong
                self.world.agree({"the first step's batch": _digest(x, y)},
                                 "give every process the same global batch (the plan shares it out)")
            loss = self.engine.train_step(self._split(x, y, TRAIN), self.lr if lr is None else lr).loss
        self.steps_done += 1
        return loss

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The mean loss of ``(x, y)`` without training (every process calls it: a collective on most plans)."""
        self._open()
        with peers_checked(self.world):
            return self.engine.eval_loss(self._split(x, y, VAL))

    def state_dict(self) -> TrainState:
        """Parameters and AdamW state by canonical name, whole, on rank 0 (call it on every process; give rank
        0's to every process's :meth:`load_state_dict`)."""
        self._open()
        with peers_checked(self.world):
            return self.engine.state()

    def load_state_dict(self, state: TrainState) -> None:
        """Continue from ``state``: what :meth:`state_dict` returned (rank 0's, on every process)."""
        if not isinstance(state, TrainState):
            raise StratumError(f"load_state_dict takes the TrainState that state_dict() returns (got "
                               f"{type(state).__name__}); to start from a module's weights, load them into the "
                               "model before parallelize")
        self._open()
        with peers_checked(self.world):
            self.engine.load_state(state)

    def close(self) -> None:
        """Release the engine once every process has finished its steps, and give the trained values back to the
        model :func:`parallelize` was given, on every process, where each tensor was (:mod:`stratum.hand_back`;
        a model a split plan made its own stays the engine's: its values are :meth:`state_dict`'s). The process
        group stays (it ends with the process): a launcher's rendezvous cannot be repeated, so another
        :func:`parallelize` in this process joins the same group."""
        self._open()
        self.closed = True
        try:
            with peers_checked(self.world):
                state = self.engine.state()
                self.engine.close()
                if self.world.backend != "none":
                    self.world.wait(dist.barrier(async_op=True), "the closing barrier")
                give_back(self.model, state, self.given, self.world)
        finally:
            let_go(self.given)


def _digest(*tensors: torch.Tensor) -> str:
    """Shapes and a hash of the values of ``tensors`` (as text, for :meth:`World.agree`)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # (any dtype)
    return f"{' and '.join(str(tuple(t.shape)) for t in tensors)} (values {h.hexdigest()[:12]})"


def _same_start(model: BlockSeq, world: World) -> None:
    """Every process starts from rank 0's parameters and buffers (each built the model on its own)."""
    if world.backend == "none":
        return
    tensors = [*model.named_parameters(), *model.named_buffers()]
    # a process that built another model would pair its broadcasts with the wrong tensors: refused first, naming
    # the first tensor that differs (the count first: the per-tensor facts need as many on every process)
    fix = "build the same model on every process (its names, shapes and dtypes: the same code and arguments)"
    world.agree({"the model built": f"{len(tensors)} tensors"}, fix)
    width = len(str(len(tensors)))
    world.agree({f"the model's tensor {i:0{width}d}": f"{n} {tuple(t.shape)} {t.dtype}"
                 for i, (n, t) in enumerate(tensors)}, fix)
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen and t.device.type != "meta":
            seen.add(id(t))
            world.wait(dist.broadcast(t.data, src=0, async_op=True), "broadcasting the starting parameters")


ARGUMENTS = {"train.micro_batch_size": "batch_shape[0]", "data.seq_len": "batch_shape[1]",
             "train.grad_accum": "micro_batches", "train.precision": "precision", "train.device": "device",
             "optim.weight_decay": "weight_decay", "optim.grad_clip": "grad_clip", "optim.beta1": "betas[0]",
             "optim.beta2": "betas[1]", "optim.eps": "eps", "optim.lr": "lr", "parallel.timeout_s": "timeout_s",
             "parallel.backend": "backend", "parallel.speeds": "speeds", "parallel.plan": "plan",
             "offload.device_budget": "device_budget", "offload.host_budget": "host_budget",
             "set model.dropout = 0": "set the model's dropout to 0"}
"""The config keys :func:`parallelize` sets, by the argument that gives each: a refusal names what the caller
wrote."""


def _in_arguments(message: str) -> str:
    for key, arg in ARGUMENTS.items():
        message = message.replace(key, arg)
    return message


def _config(*, plan: str, lr: float, micro_batches: int, weight_decay: float, betas: tuple[float, float],
            eps: float, grad_clip: float, precision: str, device: str, backend: str, timeout_s: float, speeds: str,
            batch_shape: tuple[int, int] | None) -> Config:
    """The validated config of :func:`parallelize`'s arguments."""
    cfg = Config()
    cfg.parallel = ParallelConfig(plan=plan, backend=backend, timeout_s=timeout_s, speeds=speeds)
    cfg.train = dataclasses.replace(TrainConfig(), grad_accum=micro_batches, precision=precision, device=device)
    if batch_shape is None:
        if isinstance(cfg.plan.leaf, Offload):
            raise StratumError(f"plan {plan!r} has an offload leaf, which plans device memory for one "
                               "micro-batch's activations: pass batch_shape=(rows, sequence length)")
        if cfg.plan.burst is not None and not cfg.plan.burst.width_list():
            raise StratumError(f"plan {plan!r} plans its widths from the blocks timed on one micro-batch: pass "
                               "batch_shape=(rows, sequence length), or give the widths (burst(n, widths=…))")
    else:
        cfg.train.micro_batch_size, cfg.data = batch_shape[0], dataclasses.replace(cfg.data, seq_len=batch_shape[1])
    cfg.optim = dataclasses.replace(cfg.optim, lr=lr, min_lr=0.0, weight_decay=weight_decay, beta1=betas[0],
                                    beta2=betas[1], eps=eps, grad_clip=grad_clip)
    cfg.validate()
    return cfg


def parallelize(model: nn.Module, *, plan: str = "local", lr: float = 1e-3, micro_batches: int = 1,
                loss_fn: LossFn | None = None, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
                eps: float = 1e-8, grad_clip: float = 1.0, precision: str = "fp32", device: str = "auto",
                backend: str = "auto", timeout_s: float = 30.0, speeds: str = "",
                batch_shape: tuple[int, int] | None = None, seed: int = 0) -> Parallel:
    """``model`` on ``plan`` with AdamW (``lr`` unless a step passes its own); see the module docstring.
    ``speeds``: hardware-aware shares, as ``parallel.speeds`` ("" even, "auto" measured, or one per process).
    ``batch_shape``: (rows, sequence length) of one micro-batch — an offload leaf plans its device memory for the
    activations of that shape, so a plan with one needs it. ``seed``: the dropout masks' (see the module
    docstring)."""
    if isinstance(plan, str) and ParallelConfig(plan=plan).auto:
        raise StratumError("plan='auto' is `stratum train`'s (its search runs as a run starts): give parallelize a "
                           "plan expression; `stratum plan --parallel` ranks them for a config's model")
    try:
        cfg = _config(plan=plan, lr=lr, micro_batches=micro_batches, weight_decay=weight_decay, betas=betas, eps=eps,
                      grad_clip=grad_clip, precision=precision, device=device, backend=backend,
                      timeout_s=timeout_s, speeds=speeds, batch_shape=batch_shape)
    except StratumError as e:  # named by the argument the caller wrote, not by the config key it sets
        raise StratumError(_in_arguments(str(e))) from None
    seq = as_blockseq(model, loss_fn)
    check_given(seq)
    check_free(seq)
    as_given = given(seq)
    try:
        world = join_world(cfg.plan, resolve_device(device), backend=backend, timeout_s=timeout_s)
        seq.to(world.device)
        _same_start(seq, world)
        engine = build_engine(cfg, seq, world, speeds=rank_speeds(cfg, world))
        release_replaced(seq, as_given)
    except PeerError:
        raise
    except StratumError as e:
        raise StratumError(_in_arguments(str(e))) from None
    limit = batch_shape if isinstance(cfg.plan.leaf, Offload) else None
    out = Parallel(engine=engine, world=world, micro_batches=micro_batches, lr=lr, model=seq, given=as_given,
                   seed=seed, batch_limit=limit)
    hold(as_given)
    weakref.finalize(out, let_go, as_given)  # (an engine dropped unclosed holds the model no more)
    return out
