"""Engines that execute a BlockSeq behind one interface (see :mod:`stratum.runtime.engine`)."""

from __future__ import annotations

import torch

from stratum.config import Config
from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq
from stratum.runtime.engine import Engine, OptimSpec, StepResult, TrainState


def optim_spec(cfg: Config) -> OptimSpec:
    o = cfg.optim
    return OptimSpec(betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, grad_clip=o.grad_clip)


def make_engine(cfg: Config, model: BlockSeq, device: torch.device) -> Engine:
    """The engine ``train.engine`` names, set up for ``model`` on ``device``."""
    if cfg.train.engine == "plain":
        from stratum.runtime.plain import PlainEngine
        return PlainEngine(model, optim=optim_spec(cfg), device=device, precision=cfg.train.precision)
    raise StratumError(f"train.engine = {cfg.train.engine!r} is not available")


__all__ = ["Engine", "OptimSpec", "StepResult", "TrainState", "make_engine", "optim_spec"]
