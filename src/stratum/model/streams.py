"""Dropout streams: the random numbers a block draws in training are a pure function of (seed, step, micro-batch,
block), whoever runs it.

Engines run a step's blocks in different orders and places — the plain engine one micro-batch after another, a
pipeline stage on its own process, replicas side by side, the offload engine recomputing a block in its backward
— so one shared RNG stream would hand each of them other dropout masks. Instead every micro-batch carries a
stream number (:class:`stratum.data.tokens.Batch`), and each block's training forward runs on a generator seeded
from (stream, block) and then put back (:func:`block_stream`), so every engine draws the plain engine's masks
and the global RNG is left as it was.

torch's global generators are one per process, so threads that train side by side (the sweep's sharded-lrtf
worker runs each job in a thread) must not fork, seed or draw from them at once: every fork here holds
:data:`GLOBAL_RNG`, and a thread whose model draws nothing (:func:`thread_draws_nothing`) neither forks nor waits.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from stratum.seeds import mix

GLOBAL_RNG = threading.RLock()
"""Held while torch's global generators are forked, seeded or drawn from where another thread may do the same:
by every fork here, and by a sharded-lrtf job's set-up (which seeds them). Reentrant: a block's forward forks
inside a recompute's fork. Uncontended in a single-threaded run."""

_thread = threading.local()


def thread_draws_nothing() -> None:
    """The calling thread's training draws no random numbers (its model has no dropout and initialises from its
    own generators): its forks are skipped — no copy of the generators, no wait for :data:`GLOBAL_RNG` — so it
    never touches the generators another thread's blocks draw from."""
    _thread.quiet = True


DROPOUT_ATTRS = ("dropout", "attention_dropout", "dropout_p")
"""Attributes that hold a float drop probability on modules that drop out without an ``nn.Dropout`` (Stratum's
GPT layer and transformers' attention pass it to scaled_dot_product_attention)."""


def dropout_site(model: nn.Module) -> tuple[str, float] | None:
    """The first submodule of ``model`` that drops out as it trains, with its probability; None if none does (one
    the caller put in eval mode draws no masks). Layouts that cut a micro-batch's tensors across processes (burst's
    samples, split's heads) draw other masks than one process would, and refuse such a model."""
    for name, mod in model.named_modules():
        if not mod.training:
            continue
        if isinstance(mod, nn.modules.dropout._DropoutNd):
            if mod.p > 0:
                return name, float(mod.p)
            continue
        for attr in DROPOUT_ATTRS:
            p = getattr(mod, attr, 0.0)
            if isinstance(p, float) and p > 0:
                return name, p
    return None


@contextlib.contextmanager
def forked(devices: Sequence[int | torch.device] = ()) -> Iterator[None]:
    """The global generators (the CPU's and those of the CUDA ``devices``) put back as they were after the body,
    which no other thread's fork overlaps."""
    if getattr(_thread, "quiet", False):
        yield
        return
    with GLOBAL_RNG, torch.random.fork_rng(devices=list(devices)):
        yield


@contextlib.contextmanager
def block_stream(stream: int | None, block: int, device: torch.device) -> Iterator[None]:
    """Run block ``block`` of the micro-batch with dropout stream ``stream`` on its own generator state; with
    ``stream`` None (evaluation, probes), or in a thread that draws nothing, nothing changes."""
    if stream is None or getattr(_thread, "quiet", False):
        yield
        return
    with forked([device] if device.type == "cuda" else []):
        torch.manual_seed(mix(stream, block))
        yield
