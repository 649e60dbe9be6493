"""The chunk access sequence: recorded during the first step, then checked access by access every step.

A divergence (a different access than recorded — e.g. another number of micro-batches) switches the engine to
on-demand fetching for good: one warning, no hang, still exact (only slower).
"""

from __future__ import annotations

import warnings


class AccessTrace:
    def __init__(self):
        self.recorded: list[tuple[int, ...]] | None = None
        self._recording: list[tuple[int, ...]] = []
        self.wants_grads: list[bool] = []
        """Per recorded access: whether it wants the chunks' gradients (a backward's or an update's)."""
        self.pos = 0
        self.diverged = False

    @property
    def active(self) -> bool:
        """A recorded, not diverged sequence is available for OPT eviction and prefetch."""
        return self.recorded is not None and not self.diverged

    def begin_step(self) -> None:
        self.pos = 0
        self._recording = []
        if self.recorded is None:
            self.wants_grads = []

    def access(self, chunks: tuple[int, ...], grads: bool = False) -> None:
        """Record (first step) or check (later steps) one access; ``grads``: it wants the gradients."""
        if self.recorded is None:
            self._recording.append(chunks)
            self.wants_grads.append(grads)
            return
        if self.diverged:
            return
        if self.pos >= len(self.recorded) or self.recorded[self.pos] != chunks:
            self.diverged = True
            warnings.warn(f"offload: the chunk access sequence diverged from the recorded one at access {self.pos} "
                          "(a different model path or number of micro-batches); falling back to on-demand "
                          "fetching without prefetch for the rest of the run", RuntimeWarning, stacklevel=3)
            return
        self.pos += 1

    def end_step(self) -> None:
        if self.recorded is None:
            self.recorded = self._recording
        elif not self.diverged and self.pos != len(self.recorded):
            self.diverged = True
            warnings.warn("offload: the step ended before the recorded access sequence did; falling back to "
                          "on-demand fetching", RuntimeWarning, stacklevel=2)
