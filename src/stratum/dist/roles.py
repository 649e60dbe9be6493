"""What this process is in a multi-process run — a launcher, a worker, or alone — read from its environment, and
the start of the ranks' forkserver. No torch here: a launcher starts the forkserver (whose imports take seconds)
before it imports torch itself, so the two imports overlap.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from stratum.dist import forked
from stratum.errors import StratumError

WORKER_ENV = "STRATUM_WORKER"
"""Set (to 1) in processes started by :func:`stratum.dist.launch.spawn_local`."""

SPAWN_ENV = "STRATUM_SPAWN"
"""``exec`` makes :func:`stratum.dist.launch.spawn_local` start each rank as a fresh ``python`` process instead of
forking it from the warm forkserver (which only Linux has)."""

RANK_PRELOAD = ("torch._dynamo", "torch.distributed", "stratum.cli", "stratum.config", "stratum.train.trainer",
                "stratum.train.fit", "stratum.parallel.compose", "stratum.runtime.pipeline",
                "stratum.dist.forked_rank")
"""What the server imports once for every rank: torch, the dynamo import of the first optimizer step, and the
modules of ``stratum train``."""

HF_PRELOAD = ("transformers.modeling_utils",)
"""What an ``hf`` model's ranks import beyond that (≈1,000 modules, seconds): the server imports them once. An
ImportError there is ignored by the server; the rank then reports the missing extra itself."""


def under_torchrun() -> bool:
    """True when ``RANK`` and ``WORLD_SIZE`` are set (torchrun, our own spawn, or another launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def is_worker() -> bool:
    """True in a process that must run its share of a multi-process job itself (not spawn one)."""
    return under_torchrun() or os.environ.get(WORKER_ENV) == "1"


def env_rank() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the environment; (0, 1, 0) outside a launched job."""
    if not under_torchrun():
        return 0, 1, 0
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise StratumError("RANK / WORLD_SIZE / LOCAL_RANK must be integers") from None
    return rank, world, local


def forking() -> bool:
    """Ranks are forked from the warm forkserver (not exec'd): on Linux, unless ``STRATUM_SPAWN=exec``."""
    return forked.usable() and os.environ.get(SPAWN_ENV, "fork") != "exec"


def warm_up(extra: Sequence[str] = ()) -> None:
    """Start the forkserver now, when ranks will be forked: its imports (``RANK_PRELOAD``, and ``extra`` — the
    modules the run's model needs) overlap the launcher's own work, and no rank repeats them."""
    if forking():
        forked.warm_up([*RANK_PRELOAD, *extra])
