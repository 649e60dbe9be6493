"""Simulators. :mod:`stratum.sim.pipeline`: event simulation of pipeline schedules (SIMULATED numbers)."""
