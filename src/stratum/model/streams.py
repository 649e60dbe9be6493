"""Dropout streams: the random numbers a block draws in training are a pure function of (seed, step, micro-batch,
block), whoever runs it.

Engines run a step's blocks in different orders and places — the plain engine one micro-batch after another, a
pipeline stage on its own process, replicas side by side, the offload engine recomputing a block in its backward
— so one shared RNG stream would hand each of them other dropout masks. Instead every micro-batch carries a
stream number (:class:`stratum.data.tokens.Batch`), and each block's training forward runs on a generator seeded
from (stream, block) and then put back (:func:`block_stream`), so every engine draws the plain engine's masks
and the global RNG is left as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from stratum.seeds import mix


@contextlib.contextmanager
def block_stream(stream: int | None, block: int, device: torch.device) -> Iterator[None]:
    """Run block ``block`` of the micro-batch with dropout stream ``stream`` on its own generator state; with
    ``stream`` None (evaluation, probes) nothing changes."""
    if stream is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(mix(stream, block))
        yield
