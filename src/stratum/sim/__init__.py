"""Simulators. :mod:`stratum.sim.pipeline`: event simulation of pipeline schedules (SIMULATED numbers)."""

from stratum.sim.pipeline import ActionRecord, Costs, SimResult, even_partition, simulate

__all__ = ["ActionRecord", "Costs", "SimResult", "even_partition", "simulate"]
