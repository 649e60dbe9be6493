"""Giving the device back between shard tasks: a multi-job scheduler's waiting job (the sweep's ``sharded-lrtf``)
asks its engine to :meth:`Vacate.vacate`, so that the jobs sharing a device hold only the running tasks' memory.

Everything the engine holds on the device that it can rebuild goes: streamed chunks are evicted (written home as an
eviction writes them) and the slots' memory freed; pinned chunks (a tied embedding: its only copy) and the in-flight
micro-batch's tensors — its records and what the blocks' autograd graphs saved
(:meth:`stratum.offload.inflight.MicroBatch.send_away`) — are copied to host memory. What stays: buffers (hand-off,
spill ring and restore arena, a tied chunk's gradient of one micro-batch). The next access — or the end of a
backward, before the tied chunk's gradients are summed and the update reads them — brings all back
(:meth:`Vacate._ensure_occupied`).
``Vacate`` is a mixin of :class:`~stratum.offload.engine.OffloadEngine`.
"""

from __future__ import annotations

import torch

from stratum.offload.chunk_state import ChunkState
from stratum.offload.engine_state import EngineState
from stratum.offload.tiers import DEVICE


def _nothing() -> None:
    """A transfer that marks a point in the transfer queue."""


class Vacate(EngineState):
    """Mixin: the device given back while the job waits, and taken again (see the module docstring)."""

    def vacate(self) -> int:
        """Give the device back (the module docstring says what goes); the device bytes released (0 with nothing
        to give, already vacated, or the optimizer's state on the device)."""
        pinned = [c for c in self.chunks if c.pinned and c.slot is not None]
        if self._vacated or self.placement.optimizer_tier == DEVICE or not (self.slots or pinned):
            return 0  # (the optimizer's state on the device stays there: a sweep places it on the host)
        for i in sorted(self.resident):
            c = self.chunks[i]
            self._settle(c)
            self.free_slots.append(self._evict(c))
        for fut in [*self._slot_busy.values(), *(c.opt_fut for c in pinned if c.opt_fut is not None)]:
            fut.result()  # in-place updates still writing a slot end before it goes
        self._slot_busy.clear()
        self.xfer.wait(self.xfer.submit(_nothing))  # (transfers run in order: every write-back is done)
        freed = sum(s.numel() * s.element_size() for s in self.slots)
        self._slot_shape = (len(self.slots), self.slots[0].numel(), self.slots[0].dtype) if self.slots else (
            0, 0, torch.float32)
        self.slots, self.free_slots = [], []
        for c in pinned:
            freed += self._move_pinned(c, torch.device("cpu"))
        self.tiers[DEVICE].release(freed)
        self._vacated = True
        self.n_vacates += 1
        if self._mb is None:
            return freed
        self._rename(self._mb.send_away())
        return freed + self._mb.away_bytes

    def _rename(self, renamed: dict[int, int]) -> None:
        """Storages the engine keys by data pointer (activations counted, block boundaries) moved."""
        self._act_seen = {renamed.get(p, p) for p in self._act_seen}
        self._boundary = {renamed.get(p, p) for p in self._boundary}

    def device_bytes(self) -> int:
        """Device bytes held now: the charged buffers (slots unless vacated, pinned chunks, hand-off and spill
        buffers) and the step's live activations unless a vacate moved them away."""
        away = self._mb is not None and self._mb.away
        return self.tiers[DEVICE].used + (0 if away else self._act)

    def _ensure_occupied(self) -> None:
        """Take the device back if :meth:`vacate` gave it away: the slots allocated again (all free), the pinned
        chunks and in-flight tensors copied back."""
        if not self._vacated:
            return
        n, elems, dtype = self._slot_shape
        self.slots = [self._alloc(DEVICE, elems, f"slot {s}", dtype) for s in range(n)]
        self.free_slots = list(range(n))[::-1]
        for c in self.chunks:
            if c.pinned:
                self.tiers[DEVICE].charge(self._move_pinned(c, self.device), f"pinned chunk {c.i}")
        self._vacated = False
        if self._mb is not None:
            self._rename(self._mb.bring_back(self.device))

    def _move_pinned(self, c: ChunkState, to: torch.device) -> int:
        """Copy pinned chunk ``c``'s slot (its parameters, and its gradients where they live in it) to ``to``
        and point its parameters and gradient targets there (a target elsewhere — a tied chunk's gradient of one
        micro-batch — stays); its bytes. No autograd graph holds the old copy: while a gate is set, saved tensors
        refer to pinned chunks by reference (``Residency._pack``)."""
        old = c.slot
        assert old is not None
        ptr = old.untyped_storage().data_ptr()
        into_slot = {id(e.param) for e in c.spec.entries
                     if (t := self._gtarget.get(id(e.param))) is not None and t.untyped_storage().data_ptr() == ptr}
        c.slot = old.to(to, copy=True)
        self._ptr2chunk.pop(ptr, None)
        p, g = c.p(), c.slot[c.cap:]
        for e in c.spec.entries:
            e.param.data = p[e.offset:e.offset + e.numel].view(e.shape)
            if id(e.param) in into_slot:
                self._gtarget[id(e.param)] = g[e.offset:e.offset + e.numel].view(e.shape)
        self._ptr2chunk[p.untyped_storage().data_ptr()] = c
        return old.numel() * old.element_size()
