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
    if cfg.train.engine == "pipeline":
        # ``model`` may hold only this rank's blocks (stratum.runtime.pipeline.build_local_model)
        from stratum.runtime.pipeline import PipelineEngine, make_schedule, plan_pipeline
        return PipelineEngine(model, plan=plan_pipeline(cfg, model), optim=optim_spec(cfg), device=device,
                              precision=cfg.train.precision, timeout_s=cfg.pipeline.timeout_s,
                              schedule_for=lambda m: make_schedule(cfg.pipeline, m))
    if cfg.train.engine == "offload":
        from stratum.offload.setup import make_offload_engine
        return make_offload_engine(cfg, model, device)
    raise StratumError(f"train.engine = {cfg.train.engine!r} is not available")


__all__ = ["Engine", "OptimSpec", "StepResult", "TrainState", "make_engine", "optim_spec"]
