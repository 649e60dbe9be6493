"""Engines that execute a BlockSeq behind one interface (see :mod:`stratum.runtime.engine`); a plan's engine is
built by :mod:`stratum.parallel.compose`."""

from stratum.runtime.engine import Engine, GradEngine, OptimSpec, StepResult, TrainState
from stratum.runtime.optim import optim_spec

__all__ = ["Engine", "GradEngine", "OptimSpec", "StepResult", "TrainState", "optim_spec"]
