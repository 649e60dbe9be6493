"""Which chunks are on the device: binding parameters to slots, fetching and evicting by OPT on the recorded
access sequence, prefetching ahead, and the saved-tensor hooks that keep a block's weights by chunk reference.

``Residency`` is a mixin of :class:`~stratum.offload.engine.OffloadEngine`; it works on the engine's chunk states
(``chunks``), device slots (``slots``, ``free_slots``, ``resident``), transfer queue (``xfer``), access trace
(``trace``, ``_nxt``) and activation spill (``spill``), all set up by the engine's ``_build``.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from stratum.errors import StratumError
from stratum.offload.activations import Spilled, StorageView
from stratum.offload.belady import choose_victim
from stratum.offload.chunk_state import ChunkState
from stratum.offload.engine_state import EngineState
from stratum.offload.tiers import DEVICE, F32, HOST


class Residency(EngineState):
    """Mixin: moving chunks between their home tier and the device slots (see the module docstring)."""

    # ---- binding parameters to slots ------------------------------------------------------------------------
    def _bind(self, c: ChunkState) -> None:
        """Point the chunk's parameters at its device slot, and their gradients' target at the slot's second
        half."""
        p = c.p()
        for e in c.spec.entries:
            e.param.data = p[e.offset:e.offset + e.numel].view(e.shape)
            if self._all_on_device or self._home_grads(c):
                continue  # its .grad is autograd's
            e.param.grad = None
            self._gtarget[id(e.param)] = c.g()[e.offset:e.offset + e.numel].view(e.shape)
        self._ptr2chunk[p.untyped_storage().data_ptr()] = c

    def _placeholder(self, shape) -> Tensor:
        """What an evicted parameter points at: its shape (so numel and flop counts stay right), no memory."""
        if not hasattr(self, "_zero"):
            self._zero = torch.zeros((), dtype=torch.float32, device=self.device)
        return self._zero.expand(shape)

    def _unbind(self, c: ChunkState) -> None:
        self._ptr2chunk.pop(c.p().untyped_storage().data_ptr(), None)
        for e in c.spec.entries:
            e.param.data = self._placeholder(e.shape)
            e.param.grad = None
            self._gtarget.pop(id(e.param), None)

    # ---- moving chunks ------------------------------------------------------------------------------------------
    def _read_home(self, c: ChunkState, what: str, into: Tensor) -> None:
        """Fill ``into`` (a device or host tensor) with the chunk's home copy of params ('p') or grads ('g')."""
        if what == "p" and c.hp16 is not None:  # mixed precision: the masters' 16-bit copy, in host RAM
            into.copy_(c.hp16, non_blocking=True)
        elif c.home == HOST:
            into.copy_(c.home_copy(what), non_blocking=True)
        elif self.device.type == "cpu":
            self._disk.read(f"{what}{c.i}", into)
        else:  # GPU ← disk: through the pinned transfer buffer (the disk reads into aligned host memory only)
            assert self.xfer_staging is not None  # (allocated for a GPU with parameters on disk)
            st = self.xfer_staging[:into.numel()]
            self._disk.read(f"{what}{c.i}", st)
            into.copy_(st, non_blocking=True)
            torch.cuda.current_stream(into.device).synchronize()  # the staging buffer is reused next

    def _write_home(self, c: ChunkState, what: str, src: Tensor) -> None:
        """Runs on the transfer thread (its side stream on a GPU)."""
        if c.home == HOST:
            c.home_copy(what).copy_(src, non_blocking=True)
            if src.device.type == "cuda":
                torch.cuda.current_stream(src.device).synchronize()
        elif src.device.type == "cuda":  # GPU → disk through the pinned transfer buffer, as reads come
            assert self.xfer_staging is not None
            st = self.xfer_staging[:src.numel()]
            st.copy_(src, non_blocking=True)
            torch.cuda.current_stream(src.device).synchronize()
            self._disk.write(f"{what}{c.i}", st)
        else:
            self._disk.write(f"{what}{c.i}", src)

    def _fetch(self, c: ChunkState, slot_id: int, grads: bool) -> None:
        """Copy ``c`` into slot ``slot_id``, with its gradient so far when ``grads`` (the access that wants it
        is a backward's, which adds to it). A forward's fetch leaves the gradient home: it would only be copied
        back out at the eviction (GPT small, parameters on disk, 4 micro-batches: 553 MiB of chunk copies a
        step that way, 484 MiB now)."""
        c.slot_id = slot_id
        c.slot = self.slots[slot_id]
        self.resident.add(c.i)
        self._bind(c)
        load_grad = grads and c.grad == "home" and not self._home_grads(c)
        if load_grad:
            c.grad = "dev"
        opt_fut = c.opt_fut
        busy = self._slot_busy.pop(slot_id, None)
        pending, c.pending = c.pending, None
        self.n_fetches += 1
        self.bytes_h2d += c.cap * (self._param_bytes + (F32 if load_grad else 0))

        def task(slot=c.slot, cap=c.cap):
            if busy is not None:  # the slot's previous chunk is still being updated in place
                busy.result()
            if opt_fut is not None:
                opt_fut.result()
            if pending is not None:  # its update after the last backward: reads the parameters, then updates
                self._run_pending(c, pending, slot[:cap])
            else:
                self._read_home(c, "p", slot[:cap])
            if load_grad:
                self._read_home(c, "g", slot[cap:])
        c.fut = self.xfer.submit(task)

    def _evict(self, c: ChunkState) -> int:
        """Release ``c``'s slot (writing back dirty params and live gradients first); returns the slot id."""
        assert not c.pinned
        slot, sid = c.slot, c.slot_id
        assert slot is not None and sid is not None, f"chunk {c.i} evicted while not resident"
        write_p, write_g = c.dirty, c.grad == "dev"
        self._unbind(c)
        if write_g:
            c.grad = "home"
        c.dirty = False
        c.slot, c.slot_id, c.fut = None, None, None
        self.resident.discard(c.i)
        if c.opt_fut is not None and not c.opt_fut.done():
            self._slot_busy[sid] = c.opt_fut
        if write_p or write_g:
            self.bytes_d2h += c.cap * F32 * (int(write_p) + int(write_g))

            def task(cap=c.cap):
                if write_p:
                    self._write_home(c, "p", slot[:cap])
                if write_g:
                    self._write_home(c, "g", slot[cap:])
            self.xfer.submit(task)
        return sid

    def _victim(self, protect: set[int], t: int | None) -> ChunkState | None:
        cands = [i for i in self.resident if i not in protect]
        if not cands:
            return None
        if t is not None and self._nxt is not None:
            v = choose_victim(cands, t, self._nxt)
            if v is not None:
                return self.chunks[v]
        return self.chunks[min(cands, key=lambda i: self.chunks[i].last_use)]

    def _make_resident(self, c: ChunkState, protect: set[int], t: int | None, grads: bool) -> None:
        if c.pinned or c.i in self.resident:
            return
        assert not c.stale_home, f"chunk {c.i} fetched before its update was submitted"
        if self.free_slots:
            sid = self.free_slots.pop()
        else:
            v = self._victim(protect, t)
            if v is None:
                raise StratumError(f"offload: {len(self.slots)} device chunk slot(s) cannot hold one block's chunks; "
                                   "raise offload.resident_chunks or offload.device_budget")
            # a chunk whose reduction is in flight is settled first: its slot holds a gradient not reduced yet
            self._settle(v)
            sid = self.free_slots.pop() if self.free_slots else self._evict(v)
        self._fetch(c, sid, grads)

    def _load_grad(self, c: ChunkState) -> None:
        """Bring a resident chunk's gradient so far into its slot (it was fetched by a forward)."""
        c.grad = "dev"
        self.bytes_h2d += c.cap * F32
        self.xfer.wait(self.xfer.submit(self._read_home, c, "g", c.g()))

    def _access(self, chunk_ids: tuple[int, ...], record: bool = True, grads: bool = False) -> None:
        """Make ``chunk_ids`` usable on the device now (with their gradients so far when ``grads``: a backward
        or an update will add to or read them); then prefetch ahead."""
        self._ensure_occupied()
        t = None
        if record:
            self.trace.access(chunk_ids, grads)
            if self.trace.active:
                t = self.trace.pos - 1
        protect = set(chunk_ids)
        for i in chunk_ids:
            self._make_resident(self.chunks[i], protect, t, grads)
        self._clock += 1
        t0 = time.perf_counter()
        for i in chunk_ids:
            c = self.chunks[i]
            c.last_use = self._clock
            self.xfer.wait(c.fut)
            c.fut = None
            if c.opt_fut is not None:  # an update in flight writes the chunk's parameters (home or slot)
                c.opt_fut.result()
                c.opt_fut = None
            if grads and c.grad == "home" and not c.pinned and not self._home_grads(c):
                self._load_grad(c)
        self.stall_s += time.perf_counter() - t0
        if t is not None and self.placement.prefetch_depth > 0:
            self._prefetch(t, protect)

    def _prefetch(self, t: int, protect: set[int]) -> None:
        seq, nxt = self.trace.recorded, self._nxt
        assert seq is not None and nxt is not None  # (called only while the trace is active: after the first step)
        n = len(seq)
        ahead: list[int] = []
        grads: dict[int, bool] = {}  # chunk → whether its next access wants its gradient
        for d in range(1, self.placement.prefetch_depth + 1):
            for i in seq[(t + d) % n]:
                if i not in ahead:
                    ahead.append(i)
                    grads[i] = self.trace.wants_grads[(t + d) % n]
        keep = protect | set(ahead)
        for i in ahead:
            c = self.chunks[i]
            if c.pinned or i in self.resident or c.stale_home:
                continue
            if self.free_slots:
                self._fetch(c, self.free_slots.pop(), grads[i])
                continue
            # not a chunk whose reduction is still running: a prefetch does not wait for it (the access will)
            cands = [r for r in self.resident if r not in keep and not self._reducing(r)]
            if not cands:
                return
            v = choose_victim(cands, t, nxt)
            if v is None or nxt.after(v, t) <= nxt.after(i, t):
                return
            self._settle(self.chunks[v])  # (a reduction that has completed: its work after it, no wait)
            self._fetch(c, self.free_slots.pop() if self.free_slots else self._evict(self.chunks[v]), grads[i])

    # ---- saved tensors: weights by reference, activations counted ------------------------------------------------
    def _pack(self, x: Tensor):
        try:
            ptr = x.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return x
        if ptr == 0:
            return x
        c = self._ptr2chunk.get(ptr)
        if c is not None:
            if c.pinned and not self._yielding:
                # never moves: saved as is (no unpack per weight, per step); only a vacate moves it
                return x
            # offset from the slot's start: the chunk may come back in another slot (aligned slots are views at
            # different offsets of their allocations)
            return ("chunk", c.i, x.storage_offset() - c.p().storage_offset(), tuple(x.shape), tuple(x.stride()),
                    x.dtype)
        if ptr in self._boundary:
            return self._graph_saves(x)
        if ptr not in self._act_seen:
            self._act_seen.add(ptr)
            self._act += x.untyped_storage().nbytes()
            if self._act > self.peak_act:
                self.peak_act = self._act
                self.tiers[DEVICE].note_transient(self._act)
        if self.spill is not None and self.spill.active and x.device == self.device:
            return self.spill.pack(x)
        return self._graph_saves(x)

    def _graph_saves(self, x: Tensor) -> Tensor:
        """What a graph saves of activation ``x``: ``x``, or while a gate is set an alias a vacate can move."""
        if self._yielding and self._mb is not None and x.device == self.device:
            return self._mb.track(x)
        return x

    def _unpack(self, obj):
        if isinstance(obj, (Spilled, StorageView)):
            assert self.spill is not None  # (only a spill packs these)
            return self.spill.unpack(obj)
        if isinstance(obj, tuple) and len(obj) == 6 and obj[0] == "chunk":
            _, i, off, shape, stride, dtype = obj
            c = self.chunks[i]
            if c.slot is None:  # not expected (blocks fetch before backward), but never wrong
                self._access((i,), record=False, grads=True)
            self.xfer.wait(c.fut)
            p = c.p()
            return p.as_strided(shape, stride, p.storage_offset() + off)
        return obj
