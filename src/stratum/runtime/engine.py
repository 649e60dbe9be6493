"""The engine seam: what the trainer asks of every way of executing a model.

An engine owns the model's placement, the forward/backward of a whole optimizer step (all its micro-batches)
and the optimizer update, because the engines that come after the plain one need exactly that freedom: the
offload engine updates a chunk as soon as its gradients are complete, the pipeline engine interleaves
micro-batches across ranks. The trainer only hands over micro-batches and a learning rate and gets a loss
back, so the loop, metrics and checkpoints are the same for every engine.

State crosses the seam in a placement-independent form (:class:`TrainState`: full fp32 tensors keyed by the
BlockSeq's canonical parameter names), so a checkpoint written under one engine resumes under another.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from stratum.data.tokens import Batch
from stratum.runtime.tensors import grad_norms


@dataclass(kw_only=True)
class OptimSpec:
    """AdamW hyper-parameters except the learning rate, which the trainer passes every step."""

    betas: tuple[float, float]
    eps: float
    weight_decay: float
    grad_clip: float
    """Global gradient-norm clip; 0 disables."""


@dataclass(kw_only=True)
class StepResult:
    loss: float
    """Mean loss over the step's micro-batches."""
    grad_norm: float
    """Global gradient norm before clipping (unscaled under fp16; inf or NaN on a skipped step)."""
    loss_scale: float | None = None
    """train.precision = fp16: the loss scale this step's backward ran with; None without loss scaling."""
    skipped: bool = False
    """fp16: the step's gradients held an inf or a NaN, so no update ran (runtime/loss_scale.py)."""


@dataclass(kw_only=True)
class TrainState:
    """Everything an engine must save and restore, independent of where tensors live."""

    params: Mapping[str, torch.Tensor]
    """Canonical parameter name → tensor (CPU). A mapping: a loaded checkpoint's reads each tensor from its file
    when asked for (train/checkpoint.py), so an engine restores a model larger than RAM a tensor at a time."""
    optim: Mapping[str, Mapping[str, torch.Tensor]] = field(default_factory=dict)
    """Canonical parameter name → AdamW state (``step``, ``exp_avg``, ``exp_avg_sq``) on the CPU."""
    buffers: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Canonical persistent-buffer name (``blocks.<i>.<name>``) → tensor (CPU), e.g. BatchNorm's running statistics;
    empty for a model without buffers or a state saved before buffers were (the model then keeps its own)."""
    scaler: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """The fp16 loss scaler's ``scale`` and ``growth_tracker`` (runtime/loss_scale.py); empty without loss scaling
    (a run resumed under fp16 from such a state starts from the configured initial scale)."""


# A state the API hands out is saved with torch.save by its callers; torch.load reads only allow-listed classes by
# default (weights_only), and this one holds nothing but names, tensors and dicts of them.
torch.serialization.add_safe_globals([TrainState])

V = TypeVar("V")
W = TypeVar("W")


class Mapped(Mapping[str, W]):
    """``source``'s entries, each passed through ``fn(name, value)`` when asked for."""

    def __init__(self, source: Mapping[str, V], fn: Callable[[str, V], W]):
        self._source = source
        self._fn = fn

    def __getitem__(self, name: str) -> W:
        return self._fn(name, self._source[name])

    def __contains__(self, name: object) -> bool:
        return name in self._source

    def __iter__(self) -> Iterator[str]:
        return iter(self._source)

    def __len__(self) -> int:
        return len(self._source)


def renamed(source: Mapping[str, V], names: Mapping[str, str]) -> Mapping[str, V]:
    """``source``'s entries under other names — ``names`` maps a name in ``source`` to its name here; entries
    ``source`` lacks are absent — each read from ``source`` when asked for (a checkpoint's tensors stay in their
    files until an engine takes them)."""
    return Mapped({new: old for old, new in names.items() if old in source}, lambda _new, old: source[old])


def merge_states(parts: Iterable[TrainState]) -> TrainState:
    """One TrainState of disjoint parts (:meth:`Engine.state_parts`)."""
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, Mapping[str, torch.Tensor]] = {}
    buffers: dict[str, torch.Tensor] = {}
    scaler: dict[str, torch.Tensor] = {}
    for part in parts:
        params.update(part.params)
        optim.update(part.optim)
        buffers.update(part.buffers)
        scaler.update(part.scaler)
    return TrainState(params=params, optim=optim, buffers=buffers, scaler=scaler)


class Engine(abc.ABC):
    """Executes training steps of a BlockSeq; see the module docstring for the contract."""

    name: str = "engine"

    @abc.abstractmethod
    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult:
        """Forward and backward over all ``micro_batches`` (gradients averaged), clip, one AdamW update."""

    @abc.abstractmethod
    def eval_loss(self, batches: list[Batch]) -> float:
        """Mean loss over ``batches`` without gradients, in eval mode."""

    @abc.abstractmethod
    def state(self) -> TrainState:
        """The current parameters and optimizer state, on the CPU."""

    def state_parts(self) -> Iterable[TrainState]:
        """:meth:`state` in parts whose union is the whole state, for a checkpoint written part by part: an
        engine holding more state than RAM yields it a piece at a time (lazily); the default is one part,
        :meth:`state` (called now: a collective under a multi-process engine)."""
        return [self.state()]

    @abc.abstractmethod
    def load_state(self, state: TrainState) -> None:
        """Restore what :meth:`state` returned (possibly from another engine)."""

    def memory_stats(self) -> dict[str, int]:
        """Byte counters worth logging (e.g. ``peak_device_bytes``); empty if the engine has none."""
        return {}

    def step_io(self) -> dict[str, float]:
        """What the last step moved between memory tiers, for the metrics log: ``moved_h2d_bytes``,
        ``moved_d2h_bytes``, ``moved_disk_read_bytes``, ``moved_disk_write_bytes`` and ``wait_s`` (seconds the
        step waited for data); empty for an engine that keeps its state in one place."""
        return {}

    def describe(self) -> str:
        """Lines worth printing at start (what the engine measured or chose); empty if none."""
        return ""

    @property
    def predicted_step_s(self) -> float | None:
        """Seconds per step the engine's plan predicts, where it has one."""
        return None

    def close(self) -> None:  # noqa: B027 (a default, not abstract: an engine that holds nothing keeps it)
        """Release threads, files and process groups."""


class AroundChild(Engine):
    """A plan node's engine around its child's: every Engine call goes to ``child`` unless the node changes it
    (what a node adds is its own step, norm or checkpoint form; the rest is the child's)."""

    child: Engine

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult:
        return self.child.train_step(micro_batches, lr)

    def eval_loss(self, batches: list[Batch]) -> float:
        return self.child.eval_loss(batches)

    def state(self) -> TrainState:
        return self.child.state()

    def state_parts(self) -> Iterable[TrainState]:
        return self.child.state_parts()

    def load_state(self, state: TrainState) -> None:
        self.child.load_state(state)

    def memory_stats(self) -> dict[str, int]:
        return self.child.memory_stats()

    def step_io(self) -> dict[str, float]:
        return self.child.step_io()

    def describe(self) -> str:
        return self.child.describe()

    @property
    def predicted_step_s(self) -> float | None:
        return self.child.predicted_step_s

    def close(self) -> None:
        self.child.close()


def clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor ``torch.nn.utils.clip_grad_norm_`` multiplies gradients by (1 when clipping is off)."""
    limit = max_norm if max_norm > 0 else math.inf
    return torch.clamp(limit / (norm + 1e-6), max=1.0)


class GradEngine(Engine):
    """An engine whose step has three phases a parent executor can work between (a replicate node reduces the
    replicas' gradients after :meth:`forward_backward` and before :meth:`update`).

    ``train_step`` is the three phases with nothing between them, so a GradEngine alone trains like any engine.
    """

    spec: OptimSpec
    grads_final_in_backward: bool = False
    """True when a parameter's gradient is final as soon as autograd has accumulated it for the step's last
    micro-batch (so a parent may start reducing it during the backward)."""

    @abc.abstractmethod
    def forward_backward(self, micro_batches: list[Batch], divisor: int) -> torch.Tensor:
        """Forward and backward over ``micro_batches``, each loss divided by ``divisor`` (the step's micro-batch
        count) before its backward, gradients accumulated in the parameters; the sum of the losses (float64,
        equal on every rank of this engine)."""

    @abc.abstractmethod
    def grad_params(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters by canonical name, each tensor once, in an order every replica shares."""

    @abc.abstractmethod
    def norm_counted(self) -> set[str]:
        """Names in :meth:`grad_params` whose gradient counts in the global norm on this rank (a tensor held by
        several ranks counts on one of them)."""

    @abc.abstractmethod
    def reduce_norm(self, norms: torch.Tensor) -> torch.Tensor:
        """The global gradient norm (float32 scalar) from this rank's part of it (:func:`grad_norms`'s vector),
        combined with this engine's other ranks."""

    @abc.abstractmethod
    def update(self, lr: float, coef: torch.Tensor) -> None:
        """Multiply every gradient by ``coef`` (the clip factor), one AdamW step, drop the gradients."""

    def grad_norm(self) -> torch.Tensor:
        """The global norm of the gradients now held, over all ranks of this engine."""
        counted = self.norm_counted()
        return self.reduce_norm(grad_norms([p for n, p in self.grad_params() if n in counted]))

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult:
        n = len(micro_batches)
        loss_sum = self.forward_backward(micro_batches, n)
        norm = self.grad_norm()
        self.update(lr, clip_coef(norm, self.spec.grad_clip))
        return StepResult(loss=float(loss_sum) / n, grad_norm=float(norm))
