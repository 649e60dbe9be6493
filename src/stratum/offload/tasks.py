"""Shard-task boundaries of a training step, for a scheduler that interleaves several jobs' steps.

The offload engine reports the end of every block's forward and backward to the gate set for the calling thread
(none by default: one call to a thread-local lookup per block). A multi-job scheduler (the sweep's
``sharded-lrtf``) runs each job's training in its own thread and sets a gate there that, at a shard's last block,
hands the device to another job's shard task and waits for its own next turn — the job's step itself is computed
exactly as without a gate. While it waits, the gate may ask the engine (its :class:`Turn`) to give its device
memory back, so that the jobs sharing a device hold only the running tasks' memory, and to stage its next task.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol


class Turn(Protocol):
    """What a gate may ask of the engine between two blocks (on the engine's own thread)."""

    def stage_next(self) -> int:
        """Start moving the next accesses' chunks to the device now (the engine's prefetch with nothing in use);
        the number of chunk fetches started."""

    def vacate(self) -> int:
        """Give the device back: streamed chunks written home and their slots freed, pinned chunks and the
        in-flight tensors only the engine holds copied to host memory; the next access takes all back. The device
        bytes released."""

    def device_bytes(self) -> int:
        """Device bytes the engine holds now: its charged buffers (slots, pinned chunks, staging) and the step's
        live activations."""


Gate = Callable[[str, int, int, Turn], None]
"""(kind, block, blocks, turn): kind "F" after block ``block``'s forward, "B" after its backward; ``blocks`` in
all; ``turn`` may be called (on the same thread) while the gate waits, before the job's next task."""

_local = threading.local()


def set_gate(gate: Gate | None) -> None:
    """The gate the offload engines of the calling thread report block ends to (None: no gate)."""
    _local.gate = gate


def gate_set() -> bool:
    """A gate is set for the calling thread (its engine may be asked to vacate between blocks)."""
    return getattr(_local, "gate", None) is not None


def block_done(kind: str, block: int, blocks: int, turn: Turn) -> None:
    """Called by the engine after a block's forward ("F") or backward ("B")."""
    gate = getattr(_local, "gate", None)
    if gate is not None:
        gate(kind, block, blocks, turn)
