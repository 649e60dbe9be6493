"""Stratum: train large models, and many of them, on the devices a team actually has."""

from stratum.errors import StratumError

__version__ = "0.1.0"
__all__ = ["StratumError", "__version__"]
