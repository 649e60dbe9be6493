"""The one-step-delayed update (ZeRO-Offload's DPU), ``offload.delayed_update``: under mixed-precision placement
the host's AdamW over step t's gradients runs beside step t + 1 (its forward first), and its result is what step
t + 2 computes with. Step t + 1 therefore runs on parameters that have every gradient up to step t − 1's: one
step staler than the ordinary update, as in ZeRO-Offload (which turns it on after a few ordinary steps; here it
applies from the first step, so steps 0 and 1 both run on the initial parameters).

What keeps the two steps apart: fetches and pinned chunks read the published 16-bit copy of each master
(``ChunkState.hp16``, on a CPU too) while the update writes the fp32 master; the copy is refreshed from the
master only when the next step starts (:meth:`DelayedUpdates._start_delayed`), or an evaluation before it. A
checkpoint (``state()``) applies the pending update first, so it holds every gradient so far and moves between
engines as any other; the step after it then runs on those parameters (the delay restarts there, in the run that
saved as in a run resumed from it).

``DelayedUpdates`` is a mixin of :class:`~stratum.offload.engine.OffloadEngine`.
"""

from __future__ import annotations

from concurrent.futures import Future

from torch import Tensor

from stratum.offload.chunk_state import ChunkState
from stratum.offload.engine_state import EngineState
from stratum.offload.tiers import HALF, HOST


class DelayedUpdates(EngineState):
    """Mixin: the one-step-delayed update (see the module docstring)."""

    _dpu: bool
    _delayed: list[tuple[ChunkState, list, Tensor | None, float]]
    """The last step's updates not started yet: (chunk, its gradients, clip coefficient, learning rate)."""
    _dpu_futs: dict[int, Future]
    """Chunk → its delayed update in flight (beside this step)."""
    _dpu_updated: list[ChunkState]
    """Chunks whose master the updates in flight change: published when the next step starts."""

    def _init_delayed(self, on: bool) -> None:
        self._dpu = on
        self._delayed, self._dpu_futs, self._dpu_updated = [], {}, []

    def _delay(self, coef: Tensor | None) -> None:
        """After the backward: this step's updates wait for the next step's start."""
        for c in self.owned():
            held, c.held = c.held, None
            c.grad = None  # (still stale_home: not fetched until the next publication)
            if held is not None:
                self._delayed.append((c, held, coef, self._lr))

    def _start_delayed(self) -> None:
        """At a step's start: publish the updates that ran beside the last step (the 16-bit copies this step
        computes with), then start those of the last step's gradients beside this one."""
        self._publish_delayed()
        batch, self._delayed = self._delayed, []
        for c, held, coef, lr in batch:
            self._dpu_futs[c.i] = self.opt_pool.submit(self._host_update_held, c, held, coef, lr, None)
            self._dpu_updated.append(c)

    def _publish_delayed(self) -> None:
        """The updates in flight finished and their 16-bit copies published: what the next step computes with.
        Until then no chunk whose gradient completed this step is fetched (``stale_home``): a prefetch for the
        next step would read the copy being replaced."""
        self._wait_delayed()
        for c in self._dpu_updated:
            self._publish(c)
            if c.pinned:
                self.bytes_h2d += c.cap * HALF
        self._dpu_updated = []
        for c in self.chunks:
            c.stale_home = False

    def _wait_delayed(self, c: ChunkState | None = None) -> None:
        """Wait for the delayed updates in flight (of ``c`` only, given: its gradient of this step is about to
        replace what the update reads, ``ChunkState.live``)."""
        for i in [c.i] if c is not None else list(self._dpu_futs):
            f = self._dpu_futs.pop(i, None)
            if f is not None:
                f.result()

    def _flush_delayed(self) -> None:
        """Apply and publish every pending delayed update now (a checkpoint)."""
        self._start_delayed()
        self._publish_delayed()

    def _drop_delayed(self) -> None:
        """Forget the pending updates (a state loaded over them), releasing their gradients' host bytes."""
        self._wait_delayed()
        self._dpu_updated = []
        for _, held, _, _ in self._delayed:
            self.tiers[HOST].release(self._held_bytes(held))
        self._delayed = []
