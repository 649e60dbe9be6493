"""Optional packages (the ``[project.optional-dependencies]`` extras): a missing one is a one-line error."""

from __future__ import annotations

import importlib.util

from stratum.errors import StratumError

EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "transformers": "hf", "tokenizers": "bpe",
          "matplotlib": "plot"}
"""Package → the extra of pyproject.toml that installs it."""


def require(package: str, key: str) -> None:
    """Refuse ``key`` (a config key or flag that asks for ``package``) when ``package`` is not installed; looks
    the package up without importing it."""
    if importlib.util.find_spec(package) is None:
        raise StratumError(f"{key} needs the {package} package: pip install 'stratum[{EXTRAS[package]}]' "
                           f"(or switch {key} off)")
