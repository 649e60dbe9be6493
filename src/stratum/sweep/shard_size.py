"""How many blocks one ``sharded-lrtf`` shard task covers (``sweep.shard_blocks``; 0 = this module's choice).

Hydra's shard is as much of the model as its device holds beside the next shard, whose parameters arrive while it
runs (double buffering): the automatic size is the most blocks per shard such that every shard's parameters and
gradients fit in half the job's device budget. A shard that size costs its give-back little: a task streams its
shard's chunks through the engine's slots either way, and between two shards it evicts what the next shard's
fetches would evict anyway — while each boundary where another job takes the slot copies the waiting job's
pinned chunks and in-flight tensors out and back (:mod:`stratum.offload.vacate`), so fewer, longer tasks cost
fewer copies. A job without a budget is one shard.
"""

from __future__ import annotations

from stratum.config import Config
from stratum.profile.profile import Profile
from stratum.units import parse_budget

AUTO = 0
"""``sweep.shard_blocks`` asking for :func:`fitting_shard_blocks`."""


def fitting_shard_blocks(profile: Profile, budget_bytes: int | None) -> int:
    """The most blocks per shard (shards cut from the first block on, as the shard worker cuts them) whose
    parameters and gradients fit in half of ``budget_bytes`` — at least 1; every block when there is no budget."""
    sizes = [b.param_bytes + b.grad_bytes for b in profile.blocks]
    if budget_bytes is None:
        return max(len(sizes), 1)
    for g in range(len(sizes), 1, -1):
        if max(sum(sizes[i:i + g]) for i in range(0, len(sizes), g)) <= budget_bytes / 2:
            return g
    return 1


def device_shard_blocks(profile: Profile, memory_bytes: int) -> int:
    """:func:`fitting_shard_blocks` on a device of ``memory_bytes`` that also holds the job's activations (the
    simulated cluster's streamed job: :func:`stratum.sweep.strategies.offload_option`)."""
    return fitting_shard_blocks(profile, max(memory_bytes - sum(b.act_saved_bytes for b in profile.blocks), 0))


def job_shard_blocks(profile: Profile, cfg: Config, setting: int) -> int:
    """Blocks per shard task of the job ``cfg`` (its profile ``profile``) under ``sweep.shard_blocks = setting``:
    the setting itself, or with :data:`AUTO` what fits its ``offload.device_budget``."""
    if setting != AUTO:
        return setting
    budget = parse_budget(cfg.offload.device_budget, "offload.device_budget", profile.train_state_bytes)
    return fitting_shard_blocks(profile, budget)
