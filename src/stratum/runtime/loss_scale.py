"""Dynamic loss scaling for ``train.precision = "fp16"``: fp16 has 5 exponent bits, so small gradients underflow
to zero unless the loss is multiplied by a large scale before the backward; the gradients are divided by it
again before clipping and the update. The scale is dynamic, with torch's GradScaler semantics: a step whose
gradients hold an inf or a NaN is skipped (no parameter, AdamW moment or AdamW step count changes) and the scale
is multiplied by ``BACKOFF``; after ``growth_interval`` steps in a row without one it is multiplied by ``GROWTH``.

Decisions every engine shares:

- A skipped step still consumes its batches and its learning-rate slot: the schedule follows the trainer's step
  counter (steps attempted), as torch's recipe does (``scheduler.step()`` after every ``scaler.step``); AdamW's own
  step count (its bias correction) counts only the updates applied.
- The loss is divided by the micro-batch count first, then scaled: ``scale * (loss / n)``.
- The scaler state (scale, growth tracker) is part of the training state (``TrainState.scaler``), so a checkpoint
  resumes with the scale it saved, under either engine.

The plain engine uses ``torch.amp.GradScaler`` itself (:class:`ScaledAdamW`). :class:`LossScaler` is for an engine
whose update is not a torch optimizer (the offload engine's AdamW over chunks, whose gradients are in no
``param.grad`` GradScaler could unscale); it keeps GradScaler's state and runs GradScaler's own update kernel
(``torch._amp_update_scale_``), so both follow one rule (tested against each other).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from stratum.config import Config
from stratum.runtime.engine import OptimSpec
from stratum.runtime.optim import LocalAdamW

GROWTH = 2.0
"""Scale factor after ``growth_interval`` steps without an overflow (GradScaler's default)."""
BACKOFF = 0.5
"""Scale factor after a step with an overflow (GradScaler's default)."""


@dataclass(kw_only=True)
class LossScaleSpec:
    """The dynamic loss scale's settings (``train.loss_scale``, ``train.loss_scale_growth_interval``)."""

    init_scale: float = 2.0**16
    """The scale of the first step (GradScaler's default)."""
    growth_interval: int = 2000
    """Steps in a row without an overflow after which the scale grows by ``GROWTH`` (GradScaler's default)."""


def loss_scale_spec(cfg: Config) -> LossScaleSpec:
    """The loss-scale settings of ``cfg`` (used where train.precision = fp16)."""
    return LossScaleSpec(init_scale=cfg.train.loss_scale, growth_interval=cfg.train.loss_scale_growth_interval)


def scaler_state(scale: float, growth_tracker: int) -> dict[str, Tensor]:
    """The scaler's part of a TrainState: ``scale`` (float64) and ``growth_tracker`` (int64), CPU tensors."""
    return {"scale": torch.tensor(scale, dtype=torch.float64),
            "growth_tracker": torch.tensor(growth_tracker, dtype=torch.int64)}


class ScaledAdamW(LocalAdamW):
    """torch's AdamW stepped through ``torch.amp.GradScaler``: the plain engine's fp16 optimizer. The fused
    AdamW takes GradScaler's found-inf flag into its kernel, which leaves parameters, moments and step counts as
    they were on a skipped step."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], spec: OptimSpec, device: torch.device,
                 loss_scale: LossScaleSpec):
        super().__init__(named, spec, device)
        self.scaler = torch.amp.GradScaler(device.type, init_scale=loss_scale.init_scale, growth_factor=GROWTH,
                                           backoff_factor=BACKOFF, growth_interval=loss_scale.growth_interval)
        self.skipped = False
        """Whether the last :meth:`step` was skipped for an inf or NaN gradient."""

    def unscale(self) -> None:
        """Divide the gradients by the scale (before their norm is taken), checking them for infs and NaNs."""
        self.scaler.unscale_(self.opt)

    def _apply(self) -> None:
        before = self.scaler.get_scale()
        self.scaler.step(self.opt)
        self.scaler.update()
        # GradScaler backs the scale off exactly when it skipped the step (its documented skip test)
        self.skipped = self.scaler.get_scale() < before

    def scaler_state(self) -> dict[str, Tensor]:
        sd = self.scaler.state_dict()
        return scaler_state(sd["scale"], sd["_growth_tracker"])

    def load_scaler(self, state: Mapping[str, Tensor]) -> None:
        """Take :meth:`scaler_state`'s tensors (from either engine); an empty dict keeps the current scale."""
        if state:
            sd = self.scaler.state_dict()
            sd.update(scale=float(state["scale"]), _growth_tracker=int(state["growth_tracker"]))
            self.scaler.load_state_dict(sd)


class LossScaler:
    """GradScaler's scale and update rule for an engine that unscales and checks its gradients itself (see the
    module docstring): :meth:`update` with the step's found-inf flag, as ``GradScaler.update`` does."""

    def __init__(self, spec: LossScaleSpec, device: torch.device):
        self.spec = spec
        self.scale = torch.full((), spec.init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)

    def scaled(self, loss: Tensor) -> Tensor:
        return loss * self.scale.to(loss.device)

    def update(self, found_inf: Tensor) -> None:
        """After a step: back off on ``found_inf`` (a float 0-d tensor, 1.0 = overflow), else count towards
        growth."""
        torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf.to(self.scale.device, torch.float32),
                                 GROWTH, BACKOFF, self.spec.growth_interval)

    def state(self) -> dict[str, Tensor]:
        return scaler_state(float(self.scale), int(self.growth_tracker))

    def load(self, state: Mapping[str, Tensor]) -> None:
        """Take :meth:`state`'s tensors (from either engine); an empty dict keeps the current scale."""
        if state:
            self.scale.fill_(float(state["scale"]))
            self.growth_tracker.fill_(int(state["growth_tracker"]))
