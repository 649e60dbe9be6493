"""``OffloadEngine``: trains a BlockSeq whose training state is spread over device, host and disk tiers.

Execution is explicit and block by block. Forward: for every block, the chunks holding its parameters are made
resident on the device (fetched from their home tier, evicting by OPT on the recorded access sequence), the block
runs on a detached copy of its input, and its output is kept. Backward: blocks in reverse, the chunks fetched
again if evicted, ``torch.autograd.backward(out, grad)`` with the gradient of the next block's input. Tensors
that a block saves for backward and that live in a chunk (weights and their views) are saved as (chunk, offset,
shape, stride) by a saved-tensor hook and rebuilt from wherever the chunk is resident at backward time, so a
chunk can be evicted between a block's forward and its backward without keeping its memory alive. Every
other saved tensor is an activation: counted and charged against the device budget, and, as the plan says, kept,
spilled to the host tier until the block's backward (activations.py), or dropped and recomputed.

Optimizer: a chunk's gradients are complete after the backward of the earliest block that uses it (in the last
micro-batch). Without gradient clipping its AdamW update runs right then — on the device if its state lives
there, otherwise on the optimizer thread on host/disk, overlapped with the rest of the backward. With clipping
(``optim.grad_clip > 0``) the global norm needs every gradient first: per-parameter norms are taken as each
chunk completes, gradients stay with their chunk (spilled to its home tier when it is evicted), and the updates
run after the backward. That costs gradient traffic but is exact: the same norm, coefficient and update as
``clip_grad_norm_`` + ``torch.optim.AdamW(fused=True)``.
"""

from __future__ import annotations

import math
import time
import warnings
from concurrent.futures import Future

import torch
from torch import Tensor

from stratum.data.tokens import Batch
from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq
from stratum.offload.act_ring import ActivationRing
from stratum.offload.activations import ActivationSpill, Spilled
from stratum.offload.belady import NextUse, choose_victim
from stratum.offload.chunk_state import ChunkState
from stratum.offload.chunks import ChunkSpec, Layout, pack
from stratum.offload.cpu_adam import adamw_chunks
from stratum.offload.host_alloc import HeapTrim, tune_allocator
from stratum.offload.planner import KEEP, SPILL, Plan, grads_to_host, runs_inline
from stratum.offload.prefetch import Inline, Transfers, background_pool
from stratum.offload.tiers import DEVICE, DISK, HOST, DiskStore, Tier, aligned_empty, resolve_disk_dir
from stratum.offload.trace import AccessTrace
from stratum.runtime.device import autocast, canonical
from stratum.runtime.engine import Engine, OptimSpec, StepResult, TrainState

F32 = 4


def _drop(_t: Tensor) -> None:
    """Saved-tensor hook of a forward whose graph is thrown away: keep nothing."""
    return None


def _dropped(_obj) -> Tensor:
    raise RuntimeError("offload: a discarded forward's saved tensor was used")


class OffloadEngine(Engine):
    name = "offload"

    def __init__(self, model: BlockSeq, *, optim: OptimSpec, device: torch.device, plan: Plan,
                 precision: str = "fp32", disk_dir: str = "", check_every_step: bool = True,
                 materialize=None):
        self.model = model
        self.spec = optim
        device = canonical(device)  # saved tensors are matched against it (a spilled activation's device)
        self.device = device
        self.precision = precision
        self.plan = plan
        self.check_every_step = check_every_step
        self._cuda_base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        tune_allocator()
        self._heap_trim = HeapTrim()
        if materialize is None and model.block_init is not None:
            materialize = model.materialize
        self._materialize = materialize
        self._materialized: set[int] = set()
        if any(p.is_meta for p in model.parameters()) and materialize is None:
            raise StratumError("the offload engine got a model on the meta device but no way to initialise its "
                               "blocks (build it with build_model(..., lazy=True))")
        if any(b.is_meta for b in model.buffers()):
            raise StratumError("the offload engine cannot materialise a meta model with buffers")
        for b in model.buffers():
            b.data = b.data.to(device)
        self.layout: Layout = pack(model, plan.chunk_elems)
        self.names = [n for n, _ in model.named_parameters()]
        self.tiers = {DEVICE: Tier(DEVICE, plan.device_budget), HOST: Tier(HOST, plan.host_budget),
                      DISK: Tier(DISK, None)}
        self.disk: DiskStore | None = None
        if plan.uses_disk:
            self.disk = DiskStore(resolve_disk_dir(disk_dir), self.tiers[DISK])
        gpu = device.type == "cuda"
        self.xfer = Transfers(device, inline=runs_inline(gpu, plan.param_tier))
        self._updates_inline = runs_inline(gpu, plan.optimizer_tier, plan.param_tier)
        self.opt_pool = Inline() if self._updates_inline else background_pool(device, "stratum-cpu-adam")
        self.trace = AccessTrace()
        self._nxt: NextUse | None = None
        self._clock = 0
        self._act = 0
        self._act_seen: set[int] = set()
        self._ptr2chunk: dict[int, ChunkState] = {}
        self.spill = None
        if plan.activations == SPILL:
            ring = (ActivationRing(self.disk, self.tiers[HOST], pin=device.type == "cuda")
                    if plan.disk_spill_blocks else None)
            self.spill = ActivationSpill(device, self.tiers[HOST], ring, frozenset(plan.disk_spill_blocks))
        self._boundary: set[int] = set()
        """Storages of the kept block inputs: a saved tensor in one of them is kept by reference, never spilled."""
        self.n_fetches = 0
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.peak_act = 0
        self.stall_s = 0.0
        """Seconds the training thread waited for chunks (fetches and the updates before them), all steps."""
        self.phase_s = {"forward": 0.0, "backward": 0.0, "recompute": 0.0, "update": 0.0, "update_pass": 0.0}
        """Seconds of the training thread per phase, all steps (forward and backward include their waits for
        chunks; backward includes recompute, also counted alone; update = the device-side updates or queueing
        the host/disk ones; update_pass = from queueing the clipped host/disk updates to the end of the last,
        beside the next step's forward)."""
        self._gtarget: dict[int, Tensor] = {}
        """id(parameter) → where its next gradient contribution goes (a view of its chunk's slot)."""
        self._fresh: set[int] = set()
        """id(parameter) whose target already holds a contribution this step (see _take_grad)."""
        self._build()
        self._home_params = {id(e.param) for c in self.chunks if self._home_grads(c) for e in c.spec.entries}
        self._grad_hooks = [] if self._all_on_device else [
            e.param.register_post_accumulate_grad_hook(self._take_grad) for c in self.chunks for e in c.spec.entries]

    # ---- set-up ---------------------------------------------------------------------------------------------
    def _alloc(self, tier: str, n: int, what: str) -> Tensor:
        self.tiers[tier].charge(n * F32, what)
        if tier == DEVICE and self.device.type != "cpu":
            return torch.zeros(n, dtype=torch.float32, device=self.device)
        # CPU memory is aligned for the disk store's direct I/O
        return aligned_empty(n, pin=tier == HOST and self.device.type == "cuda").zero_()

    def _build(self) -> None:
        plan = self.plan
        n_stream = len(self.layout.streamable)
        all_resident = plan.param_tier == DEVICE
        self._all_on_device = all_resident and plan.optimizer_tier == DEVICE
        """Every chunk and its moments stay on the device: gradients are autograd's own tensors, as in the plain
        engine (no slot half to zero and accumulate into, no copies), and one fused AdamW call per weight-decay
        class updates everything after the backward (a launch per chunk cost a GPU more than the work)."""
        self._grads_home = grads_to_host(plan.optimizer_tier, plan.param_tier, self.device.type == "cuda")
        """On a CPU with parameters and moments in host RAM, a streamed chunk's gradients are handed to the host
        optimizer as the tensors autograd made (charged to the host tier while held), as the plain engine's
        optimizer gets them: its slot holds parameters only (twice the slots in a budget), and no gradient is
        copied into a slot, home, or back between micro-batches (those copies were ~4 % of a small model's
        step at a 25 % budget)."""
        self._held: dict[int, Tensor] = {}
        """id(parameter) → its gradient of this step so far (``_grads_home`` chunks)."""
        self.chunks: list[ChunkState] = [None] * len(self.layout.chunks)
        # Streamed chunks first: each frees its parameters' original storage as it goes, so the always-resident
        # (tied) chunk is built when little of the original model is left: peak RAM ≈ the model once.
        for spec in sorted(self.layout.chunks, key=lambda sp: sp.tied or all_resident):
            pinned = spec.tied or all_resident
            home = DEVICE if pinned else plan.param_tier
            c = ChunkState(spec=spec, pinned=pinned, home=home)
            def fill(flat: Tensor) -> Tensor:
                self._ensure_materialized(spec)
                with torch.no_grad():
                    for e in spec.entries:
                        flat[e.offset:e.offset + e.numel].copy_(e.param.detach().reshape(-1))
                return flat
            if pinned:
                if self._all_on_device:  # parameters only; the gradients autograd makes are charged as such
                    c.slot = self._alloc(DEVICE, spec.capacity, f"pinned chunk {spec.index}")
                    self.tiers[DEVICE].charge(spec.capacity * F32, f"gradients of chunk {spec.index}")
                else:
                    c.slot = self._alloc(DEVICE, 2 * spec.capacity, f"pinned chunk {spec.index}")
                fill(c.p())
                if plan.optimizer_tier != DEVICE and self.device.type != "cpu":
                    c.hp = self._alloc(HOST, spec.capacity, "master params")
                    c.hp.copy_(c.p())
                    c.hg = self._alloc(HOST, spec.capacity, "host grads")
                self._bind(c)  # the parameters now view the slot; their original storage is released
            elif home == HOST:
                c.hp = fill(self._alloc(HOST, spec.capacity, "host params"))
                if not self._grads_home:
                    c.hg = self._alloc(HOST, spec.capacity, "host grads")
            else:
                flat = fill(aligned_empty(spec.capacity).zero_())
                self.disk.create(f"p{spec.index}", flat)
                flat.zero_()
                self.disk.create(f"g{spec.index}", flat)
                del flat
            if not pinned:
                for e in spec.entries:
                    e.param.data = self._placeholder(e.shape)
                    e.param.grad = None
            ot = plan.optimizer_tier
            if ot == DISK:
                zeros = aligned_empty(spec.capacity).zero_()
                self.disk.create(f"m{spec.index}", zeros)
                self.disk.create(f"v{spec.index}", zeros)
                del zeros
            else:
                c.m = self._alloc(ot, spec.capacity, "exp_avg")
                c.v = self._alloc(ot, spec.capacity, "exp_avg_sq")
            c.steps = torch.zeros(len(spec.entries), dtype=torch.float32,
                                  device=self.device if ot == DEVICE else "cpu")
            self.chunks[spec.index] = c
        cmax = max(c.cap for c in self.chunks)
        self.staging: list[Tensor | None] = [None] * 4
        if plan.param_tier == DISK and plan.optimizer_tier != DEVICE and n_stream and (
                self.device.type != "cpu" or self.spec.grad_clip > 0 or plan.deferred_chunks):
            self.staging[0] = self._alloc(HOST, self.layout.chunk_elems, "staging: params")
            self.staging[1] = self._alloc(HOST, self.layout.chunk_elems, "staging: grads")
        if plan.optimizer_tier == DISK:  # moments stream through in pieces of at most one chunk
            self.staging[2] = self._alloc(HOST, self.layout.chunk_elems, "staging: exp_avg")
            self.staging[3] = self._alloc(HOST, self.layout.chunk_elems, "staging: exp_avg_sq")
        # GPU ↔ disk copies pass through one pinned buffer; the transfer thread runs them one at a time
        self.xfer_staging = (self._alloc(HOST, self.layout.chunk_elems, "staging: GPU transfers")
                             if plan.param_tier == DISK and n_stream and self.device.type == "cuda" else None)
        R = 0 if all_resident else min(plan.resident_chunks, n_stream)
        cap = self.layout.chunk_elems
        self.slots = [self._alloc(DEVICE, (1 if self._grads_home else 2) * cap, f"slot {s}") for s in range(R)]
        self.free_slots = list(range(R))[::-1]
        self.resident: set[int] = set()
        self._slot_busy: dict[int, Future] = {}
        """Slot → the in-place update still reading/writing it: the next fetch into the slot waits for it."""
        self._defer = tuple(plan.deferred_chunks) if plan.optimizer_tier != DEVICE else ()
        """Chunks whose update the plan defers to beside the next forward (without clipping; with it, all are),
        ascending = the order the forward uses them (chunks are numbered in first-use order)."""
        # Canonical name → (chunk, entry) for state() / load_state() and the gradient norm order.
        self.where = {e.name: (c, e) for c in self.chunks for e in c.spec.entries}

    def _ensure_materialized(self, spec: ChunkSpec) -> None:
        """Give the blocks owning ``spec``'s parameters real (initialised) storage if they are on meta: a model
        larger than RAM is built one block at a time, each block's memory released as its chunks are packed."""
        if self._materialize is None:
            return
        for e in spec.entries:
            if not e.param.is_meta:
                continue
            i = int(e.name.split(".")[1])
            if i in self._materialized:
                continue
            self._materialized.add(i)
            self.model.allocate(i)
            self._materialize(i)

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
        self._ptr2chunk[c.slot.untyped_storage().data_ptr()] = c

    def _take_grad(self, param: Tensor) -> None:
        """Post-accumulate hook: autograd has left a gradient contribution in ``param.grad`` (usually the very
        tensor the backward produced, as in the plain engine); move it to the chunk: the first of a step is
        copied, later ones added. A ``.grad`` that viewed the slot instead made every step zero all slots and
        add every gradient into them: two extra passes over the gradients (about 3 % of a CPU step)."""
        k = id(param)
        if k in self._home_params:
            held = self._held.get(k)
            if held is None:
                self._held[k] = param.grad
                self.tiers[HOST].charge(param.grad.numel() * F32, "gradients held for the host optimizer")
            else:
                held.add_(param.grad)
        elif k in self._fresh:
            self._gtarget[k].add_(param.grad)
        else:
            self._gtarget[k].copy_(param.grad)
            self._fresh.add(k)
        param.grad = None

    def _home_grads(self, c: ChunkState) -> bool:
        """``c``'s gradients are autograd's tensors handed to the host optimizer (``_grads_home``)."""
        return self._grads_home and not c.pinned

    def _placeholder(self, shape) -> Tensor:
        """What an evicted parameter points at: its shape (so numel and flop counts stay right), no memory."""
        if not hasattr(self, "_zero"):
            self._zero = torch.zeros((), dtype=torch.float32, device=self.device)
        return self._zero.expand(shape)

    def _unbind(self, c: ChunkState) -> None:
        self._ptr2chunk.pop(c.slot.untyped_storage().data_ptr(), None)
        for e in c.spec.entries:
            e.param.data = self._placeholder(e.shape)
            e.param.grad = None
            self._gtarget.pop(id(e.param), None)

    # ---- moving chunks ------------------------------------------------------------------------------------------
    def _read_home(self, c: ChunkState, what: str, into: Tensor) -> None:
        """Fill ``into`` (a device or host tensor) with the chunk's home copy of params ('p') or grads ('g')."""
        if c.home == HOST:
            into.copy_(c.hp if what == "p" else c.hg, non_blocking=True)
        elif self.device.type == "cpu":
            self.disk.read(f"{what}{c.i}", into)
        else:  # GPU ← disk: through the pinned transfer buffer (the disk reads into aligned host memory only)
            st = self.xfer_staging[:into.numel()]
            self.disk.read(f"{what}{c.i}", st)
            into.copy_(st, non_blocking=True)
            torch.cuda.current_stream(into.device).synchronize()  # the staging buffer is reused next

    def _write_home(self, c: ChunkState, what: str, src: Tensor) -> None:
        """Runs on the transfer thread (its side stream on a GPU)."""
        if c.home == HOST:
            (c.hp if what == "p" else c.hg).copy_(src, non_blocking=True)
            if src.device.type == "cuda":
                torch.cuda.current_stream(src.device).synchronize()
        elif src.device.type == "cuda":  # GPU → disk through the pinned transfer buffer, as reads come
            st = self.xfer_staging[:src.numel()]
            st.copy_(src, non_blocking=True)
            torch.cuda.current_stream(src.device).synchronize()
            self.disk.write(f"{what}{c.i}", st)
        else:
            self.disk.write(f"{what}{c.i}", src)

    def _fetch(self, c: ChunkState, slot_id: int) -> None:
        c.slot_id = slot_id
        c.slot = self.slots[slot_id]
        self.resident.add(c.i)
        self._bind(c)
        load_grad = c.grad == "home" and not self._home_grads(c)
        if load_grad:
            c.grad = "dev"
        opt_fut = c.opt_fut
        busy = self._slot_busy.pop(slot_id, None)
        self.n_fetches += 1
        self.bytes_h2d += c.cap * F32 * (2 if load_grad else 1)

        def task(slot=c.slot, cap=c.cap):
            if busy is not None:  # the slot's previous chunk is still being updated in place
                busy.result()
            if opt_fut is not None:
                opt_fut.result()
            self._read_home(c, "p", slot[:cap])
            if load_grad:
                self._read_home(c, "g", slot[cap:])
        c.fut = self.xfer.submit(task)

    def _evict(self, c: ChunkState) -> int:
        """Release ``c``'s slot (writing back dirty params and live gradients first); returns the slot id."""
        assert not c.pinned
        slot, sid = c.slot, c.slot_id
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
            return self.chunks[choose_victim(cands, t, self._nxt)]
        return self.chunks[min(cands, key=lambda i: self.chunks[i].last_use)]

    def _make_resident(self, c: ChunkState, protect: set[int], t: int | None) -> None:
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
            sid = self._evict(v)
        self._fetch(c, sid)

    def _access(self, chunk_ids: tuple[int, ...], record: bool = True) -> None:
        """Make ``chunk_ids`` usable on the device now; then prefetch ahead."""
        t = None
        if record:
            self.trace.access(chunk_ids)
            if self.trace.active:
                t = self.trace.pos - 1
        protect = set(chunk_ids)
        for i in chunk_ids:
            self._make_resident(self.chunks[i], protect, t)
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
        self.stall_s += time.perf_counter() - t0
        if t is not None and self.plan.prefetch_depth > 0:
            self._prefetch(t, protect)

    def _prefetch(self, t: int, protect: set[int]) -> None:
        seq = self.trace.recorded
        n = len(seq)
        ahead: list[int] = []
        for d in range(1, self.plan.prefetch_depth + 1):
            for i in seq[(t + d) % n]:
                if i not in ahead:
                    ahead.append(i)
        keep = protect | set(ahead)
        for i in ahead:
            c = self.chunks[i]
            if c.pinned or i in self.resident or c.stale_home:
                continue
            if self.free_slots:
                self._fetch(c, self.free_slots.pop())
                continue
            cands = [r for r in self.resident if r not in keep]
            if not cands:
                return
            v = choose_victim(cands, t, self._nxt)
            if self._nxt.after(v, t) <= self._nxt.after(i, t):
                return
            self._fetch(c, self._evict(self.chunks[v]))

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
            if c.pinned:  # never moves: saved as is (an unpack per weight cost ~3 % of a small CPU step)
                return x
            # offset from the slot's start: the chunk may come back in another slot (aligned slots are views at
            # different offsets of their allocations)
            return ("chunk", c.i, x.storage_offset() - c.slot.storage_offset(), tuple(x.shape), tuple(x.stride()),
                    x.dtype)
        if ptr in self._boundary:
            return x
        if ptr not in self._act_seen:
            self._act_seen.add(ptr)
            self._act += x.untyped_storage().nbytes()
            if self._act > self.peak_act:
                self.peak_act = self._act
                self.tiers[DEVICE].note_transient(self._act)
        if self.spill is not None and self.spill.active and x.device == self.device:
            return self.spill.pack(x)
        return x

    def _unpack(self, obj):
        if isinstance(obj, Spilled):
            return self.spill.unpack(obj)
        if isinstance(obj, tuple) and len(obj) == 6 and obj[0] == "chunk":
            _, i, off, shape, stride, dtype = obj
            c = self.chunks[i]
            if c.slot is None:  # not expected (blocks fetch before backward), but never wrong
                self._access((i,), record=False)
            self.xfer.wait(c.fut)
            return c.slot.as_strided(shape, stride, c.slot.storage_offset() + off)
        return obj

    # ---- optimizer ------------------------------------------------------------------------------------------
    def _norms(self, chunks: list[ChunkState]) -> None:
        views, names = [], []
        for c in chunks:
            if self._home_grads(c):
                live = [(e, g) for e, g in zip(c.spec.entries, c.held) if g is not None]
                views += [g for _, g in live]
                names += [e.name for e, _ in live]
                continue
            g = c.g()  # a parameter without a gradient has no norm, as in the plain engine's clipping
            live = [e for e, ok in zip(c.spec.entries, c.live) if ok]
            views += [g[e.offset:e.offset + e.numel].view(e.shape) for e in live]
            names += [e.name for e in live]
        if views:  # (none where no parameter of these chunks got a gradient)
            for name, nrm in zip(names, torch._foreach_norm(views, 2.0)):
                self._grad_norms[name] = nrm

    def _grad_complete(self, c: ChunkState) -> None:
        """All of this step's gradient of ``c`` is in its slot."""
        if self._all_on_device:  # all chunks are updated together after the backward
            return
        if self._home_grads(c):
            c.held = [self._held.pop(id(e.param), None) for e in c.spec.entries]
            c.live = [g is not None for g in c.held]
        else:
            c.live = [id(e.param) in self._fresh for e in c.spec.entries]
        self._norms([c])
        if self.plan.optimizer_tier == DEVICE:
            if not self._deferred:
                self._update_device([c], None)
            return
        if self._in_slot(c):
            # On a CPU the slot is host memory: update the parameters where they are, with the gradient where it
            # is, and write only the new parameters home (saves a gradient round trip and a parameter read). A
            # pinned chunk's slot is its only copy, and its gradient waits there for a deferred (clipped) update.
            if not self._deferred:
                self._submit_host_update(c, None, src=c.slot)
            return
        # host/disk optimizer: hand the gradient to the host side now, free the slot of a streamed chunk
        slot = c.slot
        if not self._home_grads(c):  # (autograd's tensors are handed over, not copied)
            self.bytes_d2h += c.cap * F32
        if c.pinned:
            fut = self.xfer.submit(lambda: c.hg.copy_(slot[c.cap:], non_blocking=False))
        elif self._home_grads(c):  # the host optimizer takes autograd's tensors (c.held)
            fut = None
            self.free_slots.append(self._evict(c))
        else:
            fut = self.xfer.submit(self._write_home, c, "g", slot[c.cap:])
            c.grad = None  # the slot's gradient is consumed: the eviction must not write it again
            self.free_slots.append(self._evict(c))
        c.grad = "home"
        c.stale_home = True
        self._spill_futs[c.i] = fut
        if not self._update_later(c):
            self._submit_host_update(c, None)

    def _in_slot(self, c: ChunkState) -> bool:
        """``c``'s host/disk update runs on its CPU slot: a streamed chunk's without clipping unless the plan
        defers it (its slot is not freed until the update ends), a pinned chunk's always (never freed)."""
        return self.device.type == "cpu" and (c.pinned or not self._update_later(c))

    def _update_later(self, c: ChunkState) -> bool:
        """``c``'s update waits until after the backward: all with clipping, the plan's deferred chunks without."""
        return self._deferred or c.i in self._defer

    def _update_device(self, chunks: list[ChunkState], coef: Tensor | None) -> None:
        """AdamW of ``chunks`` (on the device, with their moments) in one fused call per weight-decay class."""
        if coef is not None:
            torch._foreach_mul_([c.g() for c in chunks], coef)
        items = [it for c in chunks for it in c.flat_items(c.p(), c.g(), c.m, c.v)]
        adamw_chunks(items, lr=self._lr, betas=self.spec.betas, eps=self.spec.eps,
                     weight_decay=self.spec.weight_decay, count_step=False)
        for c in chunks:
            c.grad = None
            if not c.pinned:
                c.dirty = True

    def _update_params(self, coef: Tensor | None) -> None:
        """All on the device: AdamW of every parameter with its autograd gradient (then dropped, as the plain
        engine's ``zero_grad``), in one fused call per weight-decay class."""
        items = []
        for c in self.chunks:
            grads = [e.param.grad for e in c.spec.entries]
            c.live = [g is not None for g in grads]
            items += c.param_items(c.p(), grads, c.m, c.v)
        self._adamw_params(items, coef, self._lr)
        for c in self.chunks:
            for e in c.spec.entries:
                e.param.grad = None

    def _adamw_params(self, items: list[tuple], coef: Tensor | None, lr: float) -> None:
        """AdamW over ``ChunkState.param_items`` (autograd's gradients, scaled by the clip ``coef`` first)."""
        if coef is not None:
            torch._foreach_mul_([it[1] for it in items], coef)
        adamw_chunks(items, lr=lr, betas=self.spec.betas, eps=self.spec.eps, weight_decay=self.spec.weight_decay,
                     count_step=False)

    def _submit_host_update(self, c: ChunkState, coef: Tensor | None, src: Tensor | None = None) -> None:
        """Queue ``c``'s AdamW step on the optimizer thread; ``src`` = its CPU slot (parameters + gradients) to
        update in place instead of the home copies."""
        spill = self._spill_futs.pop(c.i, None)
        lr = self._lr
        prev = c.opt_fut
        c.grad = None
        c.stale_home = False
        held, c.held = c.held, None

        def task():
            if spill is not None:
                spill.result()
            if prev is not None:
                prev.result()
            if held is not None:
                self._host_update_held(c, held, coef, lr, src)
            else:
                self._host_update(c, coef, lr, src)
        c.opt_fut = self.opt_pool.submit(task)
        self._opt_futs.append(c.opt_fut)

    def _host_update_held(self, c: ChunkState, held: list, coef: Tensor | None, lr: float,
                          src: Tensor | None) -> None:
        """AdamW of a ``_home_grads`` chunk with autograd's gradient tensors, on its slot (``src``, in place,
        then home) or on its host copy; the gradients' host charge is released."""
        p = c.hp if src is None else src[:c.cap]
        self._adamw_params(c.param_items(p, held, c.m, c.v), coef, lr)
        if src is not None:
            c.hp.copy_(p)
        self.tiers[HOST].release(sum(g.numel() for g in held if g is not None) * F32)

    def _host_update_held_together(self, chunks: list[ChunkState], coef: Tensor | None) -> None:
        """The clipped update of ``_home_grads`` chunks on the training thread, all in one AdamW call per
        weight-decay class (a call per chunk was 2 × 19 fused calls a step for GPT ``small``)."""
        items, held_bytes = [], 0
        for c in chunks:
            assert self._spill_futs.pop(c.i, None) is None and (c.opt_fut is None or c.opt_fut.done())
            held, c.held = c.held, None
            c.grad, c.stale_home = None, False
            items += c.param_items(c.hp, held, c.m, c.v)
            held_bytes += sum(g.numel() for g in held if g is not None) * F32
        self._adamw_params(items, coef, self._lr)
        self.tiers[HOST].release(held_bytes)

    def _host_update(self, c: ChunkState, coef: Tensor | None, lr: float, src: Tensor | None = None) -> None:
        n = c.cap
        st = self.staging
        on_disk = c.hp is None and not c.pinned
        if src is not None:
            p, g = src[:n], src[n:]
        elif on_disk:
            p, g = st[0][:n], st[1][:n]
            futs = [self.disk.read_async(f"p{c.i}", p), self.disk.read_async(f"g{c.i}", g)]
            for f in futs:
                f.result()
        else:
            p, g = c.hp, c.hg
        if coef is not None:
            g.mul_(coef.to(g.device))
        kw = dict(lr=lr, betas=self.spec.betas, eps=self.spec.eps, weight_decay=self.spec.weight_decay)
        if self.plan.optimizer_tier != DISK:
            adamw_chunks(c.flat_items(p, g, c.m, c.v), count_step=False, **kw)
        else:
            # moments from disk in pieces of at most one chunk (a large tied chunk needs no large staging), cut
            # at aligned offsets so they move by direct I/O; AdamW is elementwise, so piecewise equals whole
            piece = self.layout.chunk_elems
            for lo in range(0, c.spec.used, piece):
                hi = min(c.cap, lo + piece)
                m, v = st[2][:hi - lo], st[3][:hi - lo]
                fm = self.disk.pool.submit(self.disk.read_range, f"m{c.i}", lo, m)
                self.disk.read_range(f"v{c.i}", lo, v)
                fm.result()
                adamw_chunks(c.flat_items(p, g, m, v, lo, hi), count_step=False, **kw)
                fm = self.disk.pool.submit(self.disk.write_range, f"m{c.i}", lo, m)
                self.disk.write_range(f"v{c.i}", lo, v)
                fm.result()
        if on_disk:
            self.disk.write(f"p{c.i}", p)
        elif src is not None and c.hp is not None:
            c.hp.copy_(p)
        if c.pinned and src is None:
            c.slot[:n].copy_(p)

    def drain(self) -> None:
        """Wait for the background updates and transfers in flight (checkpoints, evaluation, benchmarks)."""
        for f in getattr(self, "_opt_futs", []):
            f.result()
        self._opt_futs = []
        for c in self.chunks:
            c.opt_fut = None
        self.xfer.submit(lambda: None).result()

    # ---- training -------------------------------------------------------------------------------------------
    def _block_chunks(self, i: int) -> tuple[int, ...]:
        return tuple(self.layout.block_chunks[i])

    def _forward_block(self, i: int, x: Tensor, y: Tensor, last: bool, n: int):
        block = self.model.blocks[i]
        with autocast(self.device, self.precision):
            out = block(x)
            if last:
                out = self.model.loss_fn(out, y)
        return out

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult:
        self.model.train()
        self._lr = lr
        self._deferred = self.spec.grad_clip > 0
        self._grad_norms: dict[str, Tensor] = {}
        self._spill_futs: dict[int, Future] = {}
        self._opt_futs = [f for f in getattr(self, "_opt_futs", []) if not f.done()]
        for c in self.chunks:
            c.grad = None
        self._fresh.clear()
        first = self.trace.recorded is None
        self.trace.begin_step()
        L = len(self.model)
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        spill = self.spill
        thin = self.plan.activations != KEEP  # only block inputs stay on the device between forward and backward
        spilled = self.plan.spilled(L)  # the other blocks are recomputed when thin, except:
        on_device = self.plan.kept()  # the last blocks, whose activations stay on the device (Plan.kept_blocks)
        for j, b in enumerate(micro_batches):
            last_mb = j == n - 1
            x = b.x.to(self.device, non_blocking=True)
            y = b.y.to(self.device, non_blocking=True)
            self._act, self._act_seen = 0, set()
            ins, outs, rng = [], [], []
            kept: list[int] = []  # bytes of each kept block input (0 for token ids)
            held: dict[int, int] = {}  # block in on_device → bytes of its saved activations (held on the device)
            self._boundary = set()
            if spill is not None:
                spill.begin_microbatch()
            t_fwd = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                for i in range(L):
                    self._access(self._block_chunks(i))
                    xi = x.detach().requires_grad_(x.is_floating_point())
                    ins.append(xi)
                    kept.append(xi.untyped_storage().nbytes() if xi.is_floating_point() else 0)
                    recompute = thin and i not in spilled and i not in on_device
                    if spill is not None:
                        if not recompute and i not in on_device:
                            spill.begin_block(i)
                        self._boundary.add(xi.untyped_storage().data_ptr())
                        self._act_seen = set()
                    rng.append(self._rng_state() if recompute else None)
                    if recompute:
                        # Run as the recompute will (grad mode on, so kernels are chosen alike: under no_grad a
                        # GPU's attention may pick another kernel and draw other dropout masks), keeping nothing.
                        with torch.autograd.graph.saved_tensors_hooks(_drop, _dropped):
                            out = self._forward_block(i, xi, y, i == L - 1, n).detach()
                        outs.append(None)
                    else:
                        out = self._forward_block(i, xi, y, i == L - 1, n)
                        outs.append(out)
                    if spill is not None:  # this block's activations are still on the device here
                        self._check()
                        spill.end_block()
                        if i in on_device:
                            held[i] = self._act - sum(kept[:i]) - sum(held.values())
                        self._act = sum(kept) + sum(held.values())
                    x = out
                loss = x
                total += loss.detach().float()
                t_bwd = time.perf_counter()
                self.phase_s["forward"] += t_bwd - t_fwd
                if thin:  # live: the kept block inputs, plus one block's saved tensors at a time
                    self._act, self._act_seen = sum(kept) + sum(held.values()), set()
                tied_tmp = self._tied_grads_begin() if j > 0 else []
                for i in reversed(range(L)):
                    self._access(self._block_chunks(i))
                    for ci in self._block_chunks(i):
                        c = self.chunks[ci]
                        if c.grad is None:  # filled by _take_grad (a parameter without a gradient: skipped)
                            c.grad = "home" if self._home_grads(c) else "dev"
                    if spill is not None:
                        spill.restore(i)
                        if spill.cuda and i > 0 and spill.ready(i - 1):
                            spill.restore(i - 1)  # the next block's copy-back runs beside this backward
                        self._act = sum(kept[:i + 1]) + spill.device_bytes + sum(held.values())
                    out = outs[i]
                    if out is None:  # recompute this block's forward with the RNG state of its first run
                        t_re = time.perf_counter()
                        keep = self._rng_state()
                        self._set_rng_state(rng[i])
                        out = self._forward_block(i, ins[i], y, i == L - 1, n)
                        self._set_rng_state(keep)
                        self.phase_s["recompute"] += time.perf_counter() - t_re
                    if i == L - 1:
                        (out / n).backward()
                    else:
                        torch.autograd.backward(out, ins[i + 1].grad)
                    outs[i] = None
                    if i + 1 < L:
                        ins[i + 1] = None
                    if thin:
                        self._check()
                        if spill is not None:
                            spill.release(i)
                        kept[i] = 0
                        held.pop(i, None)
                        self._act, self._act_seen = sum(kept[:i]) + sum(held.values()), set()
                    if last_mb:
                        for ci in self._block_chunks(i):
                            if self.layout.ready_block[ci] == i and not (tied_tmp and self.chunks[ci].spec.tied):
                                self._grad_complete(self.chunks[ci])
                    self._check()
                self._tied_grads_end(tied_tmp)
                if last_mb:
                    for c, *_ in tied_tmp:
                        self._grad_complete(c)
            self.phase_s["backward"] += time.perf_counter() - t_bwd
            self._act, self._act_seen = 0, set()
        t_upd = time.perf_counter()
        if self._all_on_device:  # norms of the gradients that exist (a parameter without one is skipped, as plain)
            live = [e for c in self.chunks for e in c.spec.entries if e.param.grad is not None]
            for e, nrm in zip(live, torch._foreach_norm([e.param.grad for e in live], 2.0)):
                self._grad_norms[e.name] = nrm
        order = [self.where[nm][1] for nm in self.names if nm in self._grad_norms]
        norms = [self._grad_norms[e.name] for e in order]
        total_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        coef = None
        if self._deferred:
            coef = torch.clamp(self.spec.grad_clip / (total_norm + 1e-6), max=1.0)
        if self._all_on_device:
            self._update_params(coef)
        elif self._deferred and self.plan.optimizer_tier == DEVICE:
            for c in self.chunks:
                self._access((c.i,))
                self._update_device([c], coef)
        elif self._deferred:
            together = []  # run here and now (a CPU): every held-gradient chunk in one fused call per class
            for c in self.chunks:
                if self._updates_inline and c.held is not None and not self._in_slot(c):
                    together.append(c)
                else:
                    self._submit_host_update(c, coef, src=c.slot if self._in_slot(c) else None)
            if together:
                self._host_update_held_together(together, coef)
        elif self._defer:
            # the plan's deferred chunks: their updates run beside the next forward, in the order it uses them,
            # moving their disk traffic out of the backward, where the disk is the bottleneck
            for i in self._defer:
                self._submit_host_update(self.chunks[i], None)
        self.phase_s["update"] += time.perf_counter() - t_upd
        if (self._deferred or self._defer) and self.plan.optimizer_tier != DEVICE:  # FIFO: runs after the last

            def note_pass() -> None:
                self.phase_s["update_pass"] += time.perf_counter() - t_upd
            self.opt_pool.submit(note_pass)
        self.trace.end_step()
        if self.device.type == "cpu":
            self._heap_trim.step_end()
        if first:
            self._nxt = NextUse(self.trace.recorded)
        self._check()
        return StepResult(loss=total.item() / n, grad_norm=float(total_norm))

    def _rng_state(self) -> tuple:
        """The RNG states a block's forward draws from (dropout): the CPU's, and the GPU's on a GPU."""
        return (torch.get_rng_state(),
                torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)

    def _set_rng_state(self, state: tuple) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    def _tied_grads_begin(self) -> list:
        """A tied tensor's gradient gets contributions from several blocks. The plain engine sums one
        micro-batch's contributions first and then adds that sum to the accumulated gradient; to round the same
        way, later micro-batches accumulate a tied chunk's gradient in a temporary buffer first."""
        out = []
        for c in self.chunks:
            if c.spec.tied and self._all_on_device:
                # autograd sums this micro-batch's contributions in a fresh .grad; _tied_grads_end adds it
                stash = [(e.param, e.param.grad) for e in c.spec.entries]
                for e in c.spec.entries:
                    e.param.grad = None
                self.tiers[DEVICE].charge(c.cap * F32, "tied gradient of one micro-batch")
                out.append((c, None, stash))
            elif c.spec.tied:
                tmp = self._alloc(DEVICE, c.cap, "tied gradient of one micro-batch")
                before = {id(e.param) for e in c.spec.entries if id(e.param) in self._fresh}
                for e in c.spec.entries:
                    self._gtarget[id(e.param)] = tmp[e.offset:e.offset + e.numel].view(e.shape)
                    self._fresh.discard(id(e.param))
                out.append((c, tmp, before))
        return out

    def _tied_grads_end(self, tmps: list) -> None:
        for c, tmp, before in tmps:
            if tmp is None:  # all on the device: ``before`` holds the earlier micro-batches' gradients
                for param, acc in before:
                    if acc is not None and param.grad is not None:
                        param.grad = acc.add_(param.grad)
                    elif acc is not None:
                        param.grad = acc
                self.tiers[DEVICE].release(c.cap * F32)
                continue
            self._fresh = (self._fresh - {id(e.param) for e in c.spec.entries}) | before
            g = c.g()
            for e in c.spec.entries:  # the slot's entries without a contribution in earlier micro-batches
                if id(e.param) not in self._fresh:
                    g[e.offset:e.offset + e.numel].zero_()
            g.add_(tmp)  # (the buffer's entries without one in this micro-batch are zeros)
            self._bind(c)
            self._fresh.update(id(e.param) for e in c.spec.entries)
            self.tiers[DEVICE].release(c.cap * F32)

    def _check(self) -> None:
        # the activations held now (in the backward: kept inputs + the restore arena) count toward the peak
        self.tiers[DEVICE].note_transient(self._act)
        if not self.check_every_step:
            return
        self.tiers[DEVICE].check(self._act)
        self.tiers[HOST].check()
        if self.device.type == "cuda" and self.plan.device_budget is not None:
            held = torch.cuda.memory_allocated(self.device) - self._cuda_base
            assert held <= self.plan.device_budget * 1.05 + (64 << 20), (
                f"CUDA allocator holds {held} bytes for the offload engine, over its budget {self.plan.device_budget}")

    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> float:
        self.drain()
        self.model.eval()
        total = 0.0
        for b in batches:
            x = b.x.to(self.device)
            y = b.y.to(self.device)
            for i in range(len(self.model)):
                self._access(self._block_chunks(i), record=False)
                x = self._forward_block(i, x, y, i == len(self.model) - 1, 1)
            total += float(x)
        return total / len(batches)

    # ---- state ------------------------------------------------------------------------------------------------
    def _master_params(self, c: ChunkState) -> Tensor:
        """The chunk's current parameters as a CPU tensor, from wherever the authoritative copy is."""
        if c.pinned:
            src = c.p() if c.hp is None else c.hp
            return src.detach().cpu().clone()
        if c.slot is not None and c.dirty:
            self.xfer.wait(c.fut)
            return c.p().detach().cpu().clone()
        if c.hp is not None:
            return c.hp.detach().cpu().clone()
        return self.disk.read(f"p{c.i}", aligned_empty(c.cap))

    def _moments(self, c: ChunkState) -> tuple[Tensor, Tensor]:
        if self.plan.optimizer_tier == DISK:
            return self.disk.read(f"m{c.i}", aligned_empty(c.cap)), self.disk.read(f"v{c.i}", aligned_empty(c.cap))
        return c.m.detach().cpu().clone(), c.v.detach().cpu().clone()

    def state(self) -> TrainState:
        self.drain()
        params, optim = {}, {}
        for c in self.chunks:
            flat = self._master_params(c)
            m, v = self._moments(c)
            steps = c.steps.tolist()
            for e, stepv in zip(c.spec.entries, steps):
                sl = slice(e.offset, e.offset + e.numel)
                params[e.name] = flat[sl].view(e.shape).clone()
                if stepv > 0:  # a parameter never updated has no optimizer state, as in torch.optim.AdamW
                    optim[e.name] = {"step": torch.tensor(stepv, dtype=torch.float32),
                                     "exp_avg": m[sl].view(e.shape).clone(), "exp_avg_sq": v[sl].view(e.shape).clone()}
        # parameters the engine does not manage (frozen) are read from the model
        for n, p in self.model.named_parameters():
            params.setdefault(n, p.detach().cpu().clone())
        return TrainState(params=params, optim=optim)

    def load_state(self, state: TrainState) -> None:
        self.drain()
        for c in self.chunks:
            flat, m, v = (aligned_empty(c.cap).zero_() for _ in range(3))
            steps = [0.0] * len(c.spec.entries)
            for k, e in enumerate(c.spec.entries):
                sl = slice(e.offset, e.offset + e.numel)
                flat[sl] = state.params[e.name].reshape(-1)
                st = state.optim.get(e.name)
                if st:
                    m[sl] = st["exp_avg"].reshape(-1)
                    v[sl] = st["exp_avg_sq"].reshape(-1)
                    steps[k] = float(st["step"])
            if c.slot is not None:
                c.p().copy_(flat)
            if c.hp is not None:
                c.hp.copy_(flat)
            elif not c.pinned:
                self.disk.write(f"p{c.i}", flat)
            c.dirty = False
            if self.plan.optimizer_tier == DISK:
                self.disk.write(f"m{c.i}", m)
                self.disk.write(f"v{c.i}", v)
            else:
                c.m.copy_(m)
                c.v.copy_(v)
            c.steps.copy_(torch.tensor(steps))
            c.uniform = len(set(steps)) == 1

    # ---- reporting ----------------------------------------------------------------------------------------------
    def measured_peaks(self) -> dict[str, int]:
        return {name: t.peak for name, t in self.tiers.items()}

    def memory_stats(self) -> dict[str, int]:
        from stratum.runtime.device import peak_memory_bytes
        return {"peak_device_bytes": peak_memory_bytes(self.device),
                "offload_device_peak_bytes": self.tiers[DEVICE].peak,
                "offload_host_peak_bytes": self.tiers[HOST].peak,
                "offload_disk_bytes": self.tiers[DISK].used,
                "offload_activation_peak_bytes": self.peak_act}

    def close(self) -> None:
        for h in self._grad_hooks:
            h.remove()
        try:
            self.drain()
        finally:
            self.xfer.close()
            self.opt_pool.shutdown(wait=True)
            if self.spill is not None:
                self.spill.close()
            if self.disk is not None:
                self.disk.close()
