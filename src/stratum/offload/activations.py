"""Activations spilled to the host tier between a block's forward and its backward, instead of recomputed.

A tensor a block saves for backward that is neither a chunk's weight nor a kept block boundary is copied to host
memory as the forward saves it and copied back just before the block's backward. With a GPU the copies run on a
side stream into pinned memory, overlapped with compute, and block i−1's copy-back is issued while block i's
backward runs; on a CPU the "device" is RAM under the device budget, so a spill is a memcpy from device-budget
memory to host-budget memory (milliseconds per block, against a whole extra forward for recompute).

Both sides copy into arenas allocated once, not into fresh tensors: a fresh buffer costs its page faults (CPU)
or a pinned allocation (GPU) on every copy, several times the cost of copying into memory already mapped.
The host arena holds one micro-batch's spills (micro-batches run one after another); the device arena holds one
block's restored activations (two with a GPU: one in use, one being filled) and exists only during a backward.
A block's spills lie back to back in the host arena (or its disk buffer) in the layout they take on the device,
so its restore is one copy of the whole range: one launch on a GPU instead of one per tensor.

torch's ``autograd.graph.save_on_cpu`` copies a whole graph's saved tensors into fresh host tensors; the engine
needs per-block restore and release, arenas and tier accounting, hence this module. Copies are exact: results are
bit-identical to keeping the activations.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stratum.offload.act_ring import ActivationRing
from stratum.offload.tiers import Tier, aligned_empty
from stratum.profile.profile import spill_key  # the profiler predicts spill bytes alike
from stratum.profile.profile import spill_span as _aligned


class Spilled:
    """One saved tensor while it lives on the host (``host``) and, around its block's backward, on the device.
    ``rel`` is its byte offset in the host arena. A tensor of a block spilled to disk has no host copy of its
    own: ``src`` holds the device tensor until the block's forward ends, then its bytes live at ``rel`` in the
    block's file (act_ring.py)."""

    __slots__ = ("host", "dev", "ready", "nbytes", "own", "src", "rel", "shape", "dtype")

    def __init__(self, host: Tensor | None, nbytes: int, own: bool, like: Tensor, src: Tensor | None = None,
                 rel: int = 0):
        self.host = host
        self.src = src
        self.rel = rel
        self.shape, self.dtype = tuple(like.shape), like.dtype
        self.dev: Tensor | None = None
        self.ready: torch.cuda.Event | None = None
        """CUDA event after which ``dev`` holds the data (None on a CPU: copies are synchronous)."""
        self.nbytes = nbytes
        self.own = own
        """``host`` is its own allocation (the arena was too small this time), charged separately."""


class StorageView:
    """A saved tensor whose whole storage was spilled as bytes (``spilled``): rebuilt on unpack as its own view
    (dtype, shape, strides) of the restored bytes."""

    __slots__ = ("spilled", "dtype", "shape", "stride")

    def __init__(self, spilled: Spilled, like: Tensor):
        self.spilled = spilled
        self.dtype, self.shape, self.stride = like.dtype, tuple(like.shape), tuple(like.stride())


def _storage_bytes(x: Tensor) -> Tensor:
    """A flat uint8 tensor over all of ``x``'s storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=x.device).set_(x.untyped_storage())


class ActivationSpill:
    """Per-block spill and restore of saved activations; host bytes charged to the host tier, and the device
    bytes of restored activations reported in ``device_bytes`` for the engine's device accounting."""

    def __init__(self, device: torch.device, host_tier: Tier, ring: ActivationRing | None = None,
                 disk_blocks: frozenset[int] = frozenset()):
        self.device = device
        self.ring = ring
        self.disk_blocks = disk_blocks if ring is not None else frozenset()
        """Blocks whose activations go to disk through ``ring`` (the others stay in the host arena)."""
        self.host_tier = host_tier
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.blocks: dict[int, list[Spilled]] = {}
        self._block_bytes: dict[int, int] = {}
        self._current: int | None = None
        self._cache: dict[tuple, tuple[Tensor, Spilled]] = {}
        self._host = torch.empty(0, dtype=torch.uint8)
        self._host_used = 0
        self._host_need = 0
        self._dev: Tensor | None = None
        self._dev_regions = 2 if self.cuda else 1
        self.device_bytes = 0
        """Bytes of the device arena while a backward holds it (else 0)."""
        self.bytes_d2h = 0
        self.bytes_h2d = 0

    @property
    def _ring(self) -> ActivationRing:
        """``ring``, reached for only by disk blocks (there are none without a ring)."""
        assert self.ring is not None
        return self.ring

    @property
    def _side(self) -> torch.cuda.Stream:
        """The side stream of a GPU's copies (reached for only where ``cuda``)."""
        assert self.stream is not None
        return self.stream

    # ---- forward ---------------------------------------------------------------------------------------------
    def begin_microbatch(self) -> None:
        """Every earlier spill is released; grow the host arena to what the last micro-batch needed."""
        self.clear()
        if self.ring is not None:
            self.ring.reset()
        if self._host_need > self._host.numel():
            self.host_tier.release(self._host.numel())
            self._host = torch.empty(0, dtype=torch.uint8)
            self.host_tier.charge(self._host_need, "spilled activations")
            self._host = aligned_empty(self._host_need, torch.uint8, pin=self.cuda)
        self._host_used = 0
        self._host_need = 0

    def begin_block(self, i: int) -> None:
        self._current = i
        self.blocks.setdefault(i, [])
        self._block_bytes.setdefault(i, 0)
        self._cache = {}

    def end_block(self) -> None:
        i = self._current
        if i in self.disk_blocks:  # pack the block's saved tensors into one buffer and write it out
            todo = self.blocks[i]
            buf = self._ring.put(i, self._block_bytes[i])
            if self.cuda:
                self._side.wait_stream(torch.cuda.current_stream(self.device))
            for t in todo:
                dst, src = self._view(buf, t.rel, t), t.src
                assert src is not None  # (a disk block's tensors keep their device original until here)
                if self.cuda:
                    with torch.cuda.stream(self._side):
                        dst.copy_(src, non_blocking=True)
                    src.record_stream(self._side)
                else:
                    dst.copy_(src)
                t.src = None
            self._ring.commit(i, self._side_stream_done())
        # The cache holds the device originals so that a freed one's address cannot be mistaken for a new
        # tensor's within the block; after the block nothing more is saved into it.
        self._cache = {}
        self._current = None

    @property
    def active(self) -> bool:
        """A block whose activations are spilled is running its forward."""
        return self._current is not None

    def pack(self, x: Tensor) -> Spilled | StorageView:
        """Copy ``x`` (a device tensor the current block saves) to the host, as its view or as its whole storage
        (``spill_key``); what was copied once is not copied again."""
        key, span = spill_key(x)
        whole = key[0] == "storage"
        hit = self._cache.get(key)
        if hit is not None:
            s = hit[1]
        else:
            src = _storage_bytes(x) if whole else x
            nbytes = src.numel() * src.element_size()
            i = self._current
            assert i is not None  # (packing happens only while active: between begin_block and end_block)
            if i in self.disk_blocks:  # copied out with the rest of the block at its end (end_block)
                s = Spilled(None, nbytes, False, src, src=src, rel=self._block_bytes[i])
            else:
                s = self._to_host(src, nbytes, span)
            self.bytes_d2h += nbytes
            self._cache[key] = (x, s)
            self.blocks[i].append(s)
            self._block_bytes[i] += span
        return StorageView(s, x) if whole else s

    def _to_host(self, x: Tensor, nbytes: int, span: int) -> Spilled:
        self._host_need += span
        rel = self._host_used
        if self._host_used + span <= self._host.numel():
            host = self._view(self._host, self._host_used, x)
            self._host_used += span
            own = False
        else:  # the first step sizes the arena; until then each spill is its own allocation
            self.host_tier.charge(nbytes, "spilled activations")
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.cuda)
            own = True
        if self.cuda:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                host.copy_(x, non_blocking=True)
            x.record_stream(self._side)  # x's memory is not reused before the copy has read it
        else:
            host.copy_(x)
        return Spilled(host, nbytes, own, x, rel=rel)

    def _side_stream_done(self):
        """A CUDA event after the copies queued on the side stream so far (None on a CPU: copies are done)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._side)
        return event

    @staticmethod
    def _view(arena: Tensor, offset: int, like) -> Tensor:
        """A view of ``arena`` bytes at ``offset`` with the dtype and shape of ``like`` (a tensor or Spilled)."""
        nbytes = like.nbytes if isinstance(like, Spilled) else like.numel() * like.element_size()
        return arena[offset:offset + nbytes].view(like.dtype).view(like.shape)

    # ---- backward --------------------------------------------------------------------------------------------
    def restore(self, i: int) -> None:
        """Bring block ``i``'s activations back to the device (asynchronously with a GPU)."""
        todo = [s for s in self.blocks.get(i, ()) if s.dev is None]
        if not todo:
            return
        if self._dev is None:  # sized for the largest block still to come back
            region = max(self._block_bytes.values(), default=0)
            self._dev = torch.empty(self._dev_regions * region, dtype=torch.uint8, device=self.device)
            self._region = region
            self.device_bytes = self._dev.numel()
        off = (i % self._dev_regions) * self._region
        if self.cuda:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
        on_disk = i in self.disk_blocks
        src = self._ring.get(i) if on_disk else self._host
        first, end = min(s.rel for s in todo), max(s.rel + _aligned(s.nbytes) for s in todo)
        if not any(s.own for s in todo) and end - first == sum(_aligned(s.nbytes) for s in todo):
            # The block's tensors lie back to back in the arena (or its file's buffer), as they will on the
            # device: one copy of the whole range, not one per tensor (a launch each on a GPU).
            pairs = [(self._dev[off:off + end - first], src[first:end])]
            for s in todo:
                s.dev = self._view(self._dev, off + s.rel - first, s)
        else:
            pairs = []
            for s in todo:
                s.dev = self._view(self._dev, off, s)
                off += _aligned(s.nbytes)
                host = self._view(src, s.rel, s) if on_disk else s.host
                assert host is not None  # (a host-arena tensor has its host copy until released)
                pairs.append((s.dev, host))
        if self.cuda:
            with torch.cuda.stream(self._side):
                for dst, s_ in pairs:
                    dst.copy_(s_, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._side)
            for s in todo:
                s.ready = ready
        else:
            for dst, s_ in pairs:
                dst.copy_(s_)
        self.bytes_h2d += sum(s.nbytes for s in todo)
        if on_disk:
            self._ring.done_with(i, self._side_stream_done())
            self._ring.prefetch(sorted((b for b in self.disk_blocks if b < i and b in self.blocks), reverse=True))

    def ready(self, i: int) -> bool:
        """Restoring block ``i`` now would not wait for a disk read (used to restore a block early)."""
        return i not in self.disk_blocks or self._ring.ready(i)

    def unpack(self, s: Spilled | StorageView) -> Tensor:
        if isinstance(s, StorageView):
            base = self.unpack(s.spilled).view(s.dtype)
            return base.as_strided(s.shape, s.stride, base.storage_offset())
        if s.dev is None:  # not expected: the engine restores a block before its backward
            raise RuntimeError("offload: a spilled activation was used before its block was restored")
        if s.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(s.ready)
        return s.dev

    def release(self, i: int) -> None:
        """Block ``i``'s backward is done: free its activations on both tiers (the device arena with the last)."""
        for s in self.blocks.pop(i, ()):
            if s.own:
                self.host_tier.release(s.nbytes)
            s.host = s.dev = s.ready = None
        self._block_bytes.pop(i, None)
        if not self.blocks and self._dev is not None:
            if self.cuda:  # the copies into it are ordered before anything that reuses its memory
                self._dev.record_stream(self._side)
            self._dev = None
            self.device_bytes = 0

    def clear(self) -> None:
        for i in list(self.blocks):
            self.release(i)

    def close(self) -> None:
        self.clear()
        if self.ring is not None:
            self.ring.close()
        self.host_tier.release(self._host.numel())
        self._host = torch.empty(0, dtype=torch.uint8)
