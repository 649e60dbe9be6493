"""Stratum: train large models, and many of them, on the devices a team actually has."""

from stratum.errors import StratumError

__version__ = "0.1.0"
__all__ = ["StratumError", "__version__", "parallelize"]


def __getattr__(name: str):
    # the library API pulls in every engine; `import stratum` for the CLI or the errors stays light
    if name == "parallelize":
        from stratum.api import parallelize
        return parallelize
    raise AttributeError(f"module 'stratum' has no attribute {name!r}")
