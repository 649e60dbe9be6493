"""A parent's reduction of each chunk's gradient (over the replicas; of a tensor tied to another pipeline rank),
overlapped with the rest of the backward.

When a chunk's gradient completes (the backward of its earliest block, last micro-batch) the engine hands it to
its parent's :attr:`~stratum.offload.engine.OffloadEngine.reducer`, which *launches* the collective and returns
at once. The backward goes on with the next blocks while the collective runs; the chunk's own work after the
reduction — its norm, its update or its hand-off to the host optimizer, its slot's release — runs when the
engine *settles* it: waits for the collective (within the world's timeout) and writes the combined gradient back.
A chunk is settled at the latest

- when :data:`MAX_IN_FLIGHT` others are in flight and another chunk completes (the oldest is settled first),
- when its slot is taken for another chunk (an eviction would move or overwrite a gradient not reduced yet; a
  prefetch never takes the slot of a chunk whose collective is still running: that fetch waits for its access),
- at the end of the backward (:meth:`Reductions._settle_all`): the step's norm, clipping and updates see every
  reduced gradient.

Every replica launches the chunks' collectives in the same order — the chunk layout and the block order are
replica 0's plan — so the replicas' collectives pair up whenever each one waits.

``Reductions`` is a mixin of :class:`~stratum.offload.engine.OffloadEngine`; what a chunk's work after the
reduction is lives in ``updates.py`` (``_complete_grads``, ``_grad_reduced``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import Tensor

from stratum.offload.chunk_state import ChunkState
from stratum.offload.engine_state import EngineState

MAX_IN_FLIGHT = 2
"""Chunk reductions in flight at once. Each keeps its chunk's slot (or held gradient tensors) until it is
settled, and the parent's packed copy of its gradient (``Launched.nbytes``: device memory the plan does not
count, as it never counted the one copy a synchronous reduction held); a collective group runs its collectives
one after another, so two — one on the link, one queued behind it — keep the link busy, and more would only hold
more memory. The slots stay within the plan's count: a chunk in flight is settled before its slot is taken."""


class Launched(Protocol):
    """A reduction in flight, as a parent's reducer returns it (``stratum.parallel.reduce.Pending``)."""

    def ready(self) -> bool:
        """Its collectives have completed (settling it would not wait)."""
        ...

    def finish(self) -> None:
        """Wait for its collectives within the timeout; leave the combined values in the chunk's gradients."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers it holds until finished (packed copies of the gradients)."""
        ...


ChunkReducer = Callable[[list[str], list[Tensor], str], Launched]
"""(canonical names, one chunk's gradients, what for messages) → that chunk's reduction, launched."""


def overlapped(log: list[tuple[str, int]]) -> int:
    """How many chunk reductions in ``log`` (:attr:`Reductions.reduce_log`) were waited for only after some
    block's backward had started beside them."""
    launched: dict[int, int] = {}
    last_backward = -1
    count = 0
    for k, (what, i) in enumerate(log):
        if what == "launch":
            launched[i] = k
        elif what == "backward":
            last_backward = k
        elif what == "wait" and launched.get(i, k) < last_backward:
            count += 1
    return count


class Reductions(EngineState):
    """Mixin: chunk reductions launched, in flight, settled (see the module docstring)."""

    reducer: ChunkReducer | None
    _in_flight: list[tuple[ChunkState, Launched]]
    """Chunks whose reduction is launched and not settled, oldest first."""
    reduce_log: list[tuple[str, int]]
    """This step's ("launch", chunk), ("backward", block) and ("wait", chunk) events, in order, under a reducer:
    the record that the reductions ran beside the backward (``reductions_overlapped`` in :meth:`step_io`)."""

    def _grad_complete(self, c: ChunkState) -> None:
        """All of this step's gradient of ``c`` is in place: launch its reduction, or without one go on at once."""
        named = self._complete_grads(c)
        if self.reducer is None or not named:
            self._grad_reduced(c)
            return
        if len(self._in_flight) >= MAX_IN_FLIGHT:
            self._settle(self._in_flight[0][0])
        if self.handoff is not None:  # the reduction reads the gradients the host's adds complete
            self.handoff.wait(c)
        self._in_flight.append((c, self.reducer([n for n, _ in named], [g for _, g in named], f"chunk {c.i}")))
        self.reduce_log.append(("launch", c.i))

    def _note_backward(self, block: int) -> None:
        """Block ``block``'s backward of the step's last micro-batch starts (for :attr:`reduce_log`)."""
        if self.reducer is not None:
            self.reduce_log.append(("backward", block))

    def _settle(self, c: ChunkState) -> None:
        """Finish ``c``'s reduction (if it is in flight) and do its work after it."""
        for k, (d, launched) in enumerate(self._in_flight):
            if d is c:
                del self._in_flight[k]
                launched.finish()
                self.reduce_log.append(("wait", c.i))
                self._grad_reduced(c)
                return

    def _settle_all(self) -> None:
        """Every reduction in flight finished, oldest first (the end of the backward)."""
        while self._in_flight:
            self._settle(self._in_flight[0][0])

    def _reducing(self, i: int) -> bool:
        """Chunk ``i``'s reduction is in flight and not complete yet (settling it now would wait)."""
        return any(c.i == i and not launched.ready() for c, launched in self._in_flight)

    def _in_flight_bytes(self) -> int:
        """Bytes the reductions in flight hold (their packed copies; see :data:`MAX_IN_FLIGHT`)."""
        return sum(launched.nbytes for _, launched in self._in_flight)

    def _begin_reductions(self) -> None:
        """A step begins: nothing in flight (the last one settled all at its backward's end), the log empty."""
        assert not self._in_flight, "offload: chunk reductions left in flight by the last step"
        self.reduce_log = []

    def reductions_overlapped(self) -> int:
        """The last step's chunk reductions that ran beside a later block's backward."""
        return overlapped(self.reduce_log)
