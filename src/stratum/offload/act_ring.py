"""Spilled activations on disk: a ring of host buffers between a block's saved tensors and its file.

When the host budget cannot hold every block's spilled activations, the rest go to disk instead of being
recomputed: at the end of such a block's forward its saved tensors are packed into one aligned host buffer
and written (direct I/O, the disk store's pool) to that block's file; before its backward the file is read
back, and the reads for the next blocks down are issued while the current one runs. Two buffers suffice: a
block's write (tens of MB at GB/s) ends long before the next block's forward does, and in the backward one
buffer is read into while the other is copied out. The last blocks written in the forward are still in the
ring when the backward starts, so they are not read back at all.

Buffers are charged to the host tier; files to the disk tier. With a GPU, copies in and out of the (pinned)
buffers run on a side stream, and the disk thread waits for their CUDA events before it touches a buffer.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
from torch import Tensor

from stratum.offload.tiers import DiskStore, Tier, aligned_empty, round_up

RING = 2
"""Host buffers of the ring (the planner charges RING × the largest block's spill bytes to the host tier)."""


class _Slot:
    __slots__ = ("buf", "block", "fut", "event", "used")

    def __init__(self):
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.block: int | None = None
        """The block whose bytes the buffer holds (written or read back), or None."""
        self.fut: Future | None = None
        """The disk write or read in flight on the buffer."""
        self.event = None
        """CUDA event after which the device is done with the buffer."""
        self.used = 0


class ActivationRing:
    """Per-block activation files behind a ring of ``n`` aligned host buffers (see the module docstring)."""

    def __init__(self, disk: DiskStore, host_tier: Tier, *, pin: bool = False, n: int = RING):
        self.disk = disk
        self.host_tier = host_tier
        self.pin = pin
        self.slots = [_Slot() for _ in range(n)]
        self.sizes: dict[int, int] = {}
        """Block → bytes of its last spill (its file holds them, rounded up to ALIGN)."""
        self._clock = 0
        self._filling: _Slot | None = None
        self.bytes_written = 0
        self.bytes_read = 0

    @staticmethod
    def key(i: int) -> str:
        return f"a{i}"

    def _settle(self, s: _Slot) -> None:
        if s.fut is not None:
            s.fut.result()
            s.fut = None
        if s.event is not None:
            s.event.synchronize()
            s.event = None

    def _fit(self, s: _Slot, nbytes: int) -> None:
        need = round_up(max(nbytes, 1))
        if s.buf.numel() < need:
            self.host_tier.release(s.buf.numel())
            s.buf = torch.empty(0, dtype=torch.uint8)
            self.host_tier.charge(need, "activation ring buffer")
            s.buf = aligned_empty(need, torch.uint8, pin=self.pin)

    def _touch(self, s: _Slot) -> None:
        self._clock += 1
        s.used = self._clock

    def _find(self, i: int) -> _Slot | None:
        return next((s for s in self.slots if s.block == i), None)

    # ---- forward ---------------------------------------------------------------------------------------------
    def put(self, i: int, nbytes: int) -> Tensor:
        """A buffer of at least ``nbytes`` for block ``i``'s activations (the least recently used slot, once its
        earlier write has ended); fill it, then :meth:`commit`."""
        s = self._find(i) or min(self.slots, key=lambda t: t.used)
        self._settle(s)
        self._fit(s, nbytes)
        s.block = None  # not valid until committed
        self._touch(s)
        self.sizes[i] = nbytes
        self._filling = s
        return s.buf[:nbytes]

    def commit(self, i: int, event=None) -> None:
        """Block ``i``'s buffer is filled (on the device's stream up to ``event``): write it to its file."""
        s, self._filling = self._filling, None
        assert s is not None, "ActivationRing.commit without put"
        s.block = i
        data = s.buf[:round_up(self.sizes[i])]

        def write():
            if event is not None:
                event.synchronize()
            self.disk.put(self.key(i), data)
        s.fut = self.disk.pool.submit(write)
        self.bytes_written += data.numel()

    # ---- backward --------------------------------------------------------------------------------------------
    def get(self, i: int) -> Tensor:
        """Block ``i``'s activations in a host buffer (read now if no prefetch brought them); the buffer stays
        block ``i``'s until :meth:`prefetch` reuses it, so call that only after copying out."""
        s = self._find(i)
        if s is None:
            victim = self._victim(())
            assert victim is not None  # never None without a keep set
            self._read(i, victim)
            s = self._find(i)
            assert s is not None
        self._settle(s)
        self._touch(s)
        return s.buf[:self.sizes[i]]

    def ready(self, i: int) -> bool:
        """Block ``i``'s bytes are in a buffer now (getting them would not wait for the disk)."""
        s = self._find(i)
        return s is not None and (s.fut is None or s.fut.done())

    def done_with(self, i: int, event=None) -> None:
        """The copy out of block ``i``'s buffer is issued (and ends at ``event`` on a GPU)."""
        s = self._find(i)
        if s is not None:
            s.event = event
            s.block = -1 - i  # the bytes are still there, but the block will not be asked for again

    def prefetch(self, blocks: list[int]) -> None:
        """Start reading the next blocks to come back (in order), as far as the ring allows."""
        want = blocks[:len(self.slots)]
        for i in want:
            if self._find(i) is None:
                s = self._victim(want)
                if s is None:
                    return
                self._read(i, s)

    def _victim(self, keep) -> _Slot | None:
        """A buffer to read into: one holding nothing still wanted (least recently used); when prefetching for
        ``keep``, no buffer holding a block yet to come back is taken."""
        done = [s for s in self.slots if s.block is None or s.block < 0]
        if not done and keep:
            return None
        return min(done or self.slots, key=lambda t: t.used)

    def _read(self, i: int, s: _Slot) -> None:
        self._settle(s)
        self._fit(s, self.sizes[i])
        s.block = i
        self._touch(s)
        data = s.buf[:round_up(self.sizes[i])]
        s.fut = self.disk.read_async(self.key(i), data)
        self.bytes_read += data.numel()

    # ---- lifetime --------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """A new micro-batch: every write has ended and no buffer holds a block any more."""
        for s in self.slots:
            self._settle(s)
            s.block = None

    def close(self) -> None:
        self.reset()
        for s in self.slots:
            self.host_tier.release(s.buf.numel())
            s.buf = torch.empty(0, dtype=torch.uint8)

