"""Simulators. :mod:`stratum.sim.pipeline`: event simulation of pipeline schedules (SIMULATED numbers)."""

from stratum.plan.partition import even_partition
from stratum.sim.pipeline import ActionRecord, Costs, SimResult, simulate

__all__ = ["ActionRecord", "Costs", "SimResult", "even_partition", "simulate"]
