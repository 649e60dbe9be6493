"""Shard-task boundaries of a training step, for a scheduler that interleaves several jobs' steps.

The offload engine reports the end of every block's forward and backward to the gate set for the calling thread
(none by default: one call to a thread-local lookup per block). A multi-job scheduler (the sweep's
``sharded-lrtf``) runs each job's training in its own thread and sets a gate there that, at a shard's last block,
hands the device to another job's shard task and waits for its own next turn — the job's step itself is computed
exactly as without a gate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

Stage = Callable[[], int]
"""Starts moving the engine's next accesses' chunks to the device now (its prefetch with nothing in use); the
number of chunk fetches it started."""
Gate = Callable[[str, int, int, Stage], None]
"""(kind, block, blocks, stage): kind "F" after block ``block``'s forward, "B" after its backward; ``blocks`` in
all; ``stage`` may be called (on the same thread) while the gate waits, before the job's next task."""

_local = threading.local()


def set_gate(gate: Gate | None) -> None:
    """The gate the offload engines of the calling thread report block ends to (None: no gate)."""
    _local.gate = gate


def block_done(kind: str, block: int, blocks: int, stage: Stage) -> None:
    """Called by the engine after a block's forward ("F") or backward ("B")."""
    gate = getattr(_local, "gate", None)
    if gate is not None:
        gate(kind, block, blocks, stage)
