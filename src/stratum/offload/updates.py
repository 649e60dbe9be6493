"""Gradients and AdamW for the offload engine: collecting each parameter's gradient, per-parameter norms as
chunks complete, and the update of each chunk where its optimizer state lives — during the backward without
clipping, after it (or beside the next forward) with clipping or where the plan defers it.

``Updates`` is a mixin of :class:`~stratum.offload.engine.OffloadEngine`; it works on the engine's chunk states,
its optimizer pool (``opt_pool``: inline on a CPU, a thread otherwise), transfer queue and tiers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

from stratum.offload.chunk_state import ChunkState, count_steps
from stratum.offload.cpu_adam import adamw_chunks
from stratum.offload.engine_state import EngineState
from stratum.offload.tiers import DEVICE, DISK, F32, HALF, HOST
from stratum.runtime.engine import clip_coef


def _named(c: ChunkState, held: list) -> list[tuple[str, Tensor]]:
    """(name, gradient) of ``c``'s entries with a gradient in ``held`` (one per entry, None: none)."""
    return [(e.name, g) for e, g in zip(c.spec.entries, held) if g is not None]


class Updates(EngineState):
    """Mixin: gradients and AdamW of the chunks (see the module docstring)."""

    # ---- gradients ------------------------------------------------------------------------------------------
    def _take_grad(self, param: Tensor) -> None:
        """Post-accumulate hook: autograd has left a gradient contribution in ``param.grad`` (usually the very
        tensor the backward produced, as in the plain engine); move it to the chunk: the first of a step is
        copied, later ones added. A ``.grad`` viewing the slot would make every step zero all slots and add every
        gradient into them: two extra passes over the gradients."""
        k = id(param)
        grad = param.grad
        assert grad is not None  # a post-accumulate hook runs with the gradient in place
        if k in self._home_params:
            held = self._held.get(k)
            if self._half:  # down in 16 bits, accumulated in fp32 on the host
                self.bytes_d2h += grad.numel() * HALF
                grad = grad.to("cpu")
                if held is None:
                    grad = grad.float()
            if held is None:
                self._held[k] = grad
                self.tiers[HOST].charge(grad.numel() * F32, "gradients held for the host optimizer")
            else:
                held.add_(grad)
        elif k in self._fresh:
            self._gtarget[k].add_(grad)
        else:
            self._gtarget[k].copy_(grad)
            self._fresh.add(k)
        param.grad = None

    def _home_grads(self, c: ChunkState) -> bool:
        """``c``'s gradients are autograd's tensors handed to the host optimizer (``_grads_home``): a streamed
        chunk's, and under mixed precision a pinned one's too."""
        return self._grads_home and (self._half or not c.pinned)

    # ---- optimizer ------------------------------------------------------------------------------------------
    def _norms(self, chunks: list[ChunkState]) -> None:
        named: list[tuple[str, Tensor]] = []
        for c in chunks:
            if self._home_grads(c):
                assert c.held is not None
                named += _named(c, c.held)
                continue
            g = c.g()  # a parameter without a gradient has no norm, as in the plain engine's clipping
            named += [(e.name, g[e.offset:e.offset + e.numel].view(e.shape))
                      for e, ok in zip(c.spec.entries, c.live_entries()) if ok]
        self._take_norms(named)

    def _held_norms(self, c: ChunkState, held: list | None) -> None:
        """The norms of ``c``'s gradients ``held`` for its update (taken beside it, on the optimizer thread)."""
        assert held is not None
        self._take_norms(_named(c, held))

    def _take_norms(self, named: list[tuple[str, Tensor]]) -> None:
        if named:  # (none where no parameter of these chunks got a gradient)
            for (name, _), nrm in zip(named, torch._foreach_norm([g for _, g in named], 2.0)):
                self._grad_norms[name] = nrm

    def _complete_grads(self, c: ChunkState) -> list[tuple[str, Tensor]]:
        """All of this step's gradient of ``c`` is in place: (name, gradient) of its parameters that got one,
        for the parent's reduction (``Reductions._grad_complete``)."""
        if self._all_on_device:
            return [(e.name, e.param.grad) for e in c.spec.entries if e.param.grad is not None]
        if self._home_grads(c):
            self._wait_delayed(c)
            if self.handoff is None:
                c.held = [self._held.pop(id(e.param), None) for e in c.spec.entries]
            else:  # views of the chunk's accumulator, which the host's adds queued so far complete
                c.held = self.handoff.held(c)
            c.live = [g is not None for g in c.held]
            return _named(c, c.held)
        c.live = [id(e.param) in self._fresh for e in c.spec.entries]
        g = c.g()
        return [(e.name, g[e.offset:e.offset + e.numel]) for e, ok in zip(c.spec.entries, c.live) if ok]

    def _grad_reduced(self, c: ChunkState) -> None:
        """``c``'s gradient is final (reduced over the parent's processes where it has some): its norm and update,
        or its hand-off to the host optimizer; a gradient another replica updates with is dropped."""
        if self._all_on_device:  # all chunks are updated together after the backward
            if not self.owns(c.i):
                for e in c.spec.entries:
                    e.param.grad = None
            return
        if not self.owns(c.i):
            self._drop_grads(c)
            return
        if self.handoff is not None and not self._update_later(c):  # after the host's add, on its thread
            self._opt_futs.append(self.opt_pool.submit(self._held_norms, c, c.held))
        elif not (self._home_grads(c) and self._update_later(c)):  # (those: all together, grad_norms_now)
            self._norms([c])
        if self.placement.optimizer_tier == DEVICE:
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
        slot, hg = c.slot, c.hg
        assert slot is not None
        if not self._home_grads(c):  # (autograd's tensors are handed over, not copied)
            self.bytes_d2h += c.cap * F32
        fut: Future | None
        if self._home_grads(c):  # the host optimizer takes autograd's tensors (c.held); a pinned chunk stays
            fut = None
            if not c.pinned:
                self.free_slots.append(self._evict(c))
        elif c.pinned:
            assert hg is not None  # a pinned chunk with a host optimizer on a GPU has host grads (_build)
            fut = self.xfer.submit(lambda: hg.copy_(slot[c.cap:], non_blocking=False))
        else:
            fut = self.xfer.submit(self._write_home, c, "g", slot[c.cap:])
            c.grad = None  # the slot's gradient is consumed: the eviction must not write it again
            self.free_slots.append(self._evict(c))
        c.grad = "home"
        c.stale_home = True  # (delayed: its published copy changes when the next step starts)
        self._spill_futs[c.i] = fut
        if not self._update_later(c):
            self._submit_host_update(c, None)

    def _drop_grads(self, c: ChunkState) -> None:
        """``c`` is updated by another replica, where its reduced gradient went: nothing of it stays here."""
        held, c.held = c.held, None
        if held is not None:
            self.tiers[HOST].release(self._held_bytes(held))
        c.grad = None

    def _held_bytes(self, held: list) -> int:
        """Host bytes charged while gradients are held: autograd's tensors (the per-chunk hand-off's are views of
        the chunks' accumulators, charged for good when they were allocated)."""
        return 0 if self.handoff is not None else sum(g.numel() for g in held if g is not None) * F32

    def _in_slot(self, c: ChunkState) -> bool:
        """``c``'s host/disk update runs on its CPU slot: a streamed chunk's without clipping unless the plan
        defers it (its slot is not freed until the update ends), a pinned chunk's always (never freed) — unless
        the slot is a 16-bit working copy (``_half``): the update runs on the fp32 master."""
        return self.device.type == "cpu" and not self._half and (c.pinned or not self._update_later(c))

    def _update_later(self, c: ChunkState) -> bool:
        """``c``'s update waits until after the backward: all with clipping or delayed, the plan's deferred
        chunks without."""
        return self._deferred or self._dpu or c.i in self._defer

    def owned(self) -> list[ChunkState]:
        """The chunks this engine updates (all unless sharded)."""
        return [c for c in self.chunks if self.owns(c.i)]

    def _update_device(self, chunks: list[ChunkState], coef: Tensor | None) -> None:
        """AdamW of ``chunks`` (on the device, with their moments) in one fused call per weight-decay class."""
        if coef is not None:
            torch._foreach_mul_([c.g() for c in chunks], coef)
        count_steps(chunks)
        items = [it for c in chunks for it in c.flat_items(c.p(), c.g(), *c.moments())]
        adamw_chunks(items, lr=self._lr, betas=self.spec.betas, eps=self.spec.eps,
                     weight_decay=self.spec.weight_decay)
        for c in chunks:
            c.grad = None
            if not c.pinned:
                c.dirty = True

    def _update_params(self, coef: Tensor | None) -> None:
        """All on the device: AdamW of every parameter with its autograd gradient (then dropped, as the plain
        engine's ``zero_grad``), in one fused call per weight-decay class."""
        owned = self.owned()
        for c in owned:
            c.live = [e.param.grad is not None for e in c.spec.entries]
        count_steps(owned)
        items = [it for c in owned for it in c.param_items(c.p(), [e.param.grad for e in c.spec.entries],
                                                             *c.moments())]
        self._adamw_params(items, coef, self._lr)
        for c in self.chunks:
            for e in c.spec.entries:
                e.param.grad = None

    def _adamw_params(self, items: list[tuple], coef: Tensor | None, lr: float) -> None:
        """AdamW over ``ChunkState.param_items`` (autograd's gradients, scaled by the clip ``coef`` first)."""
        if coef is not None:
            torch._foreach_mul_([it[1] for it in items], coef)
        adamw_chunks(items, lr=lr, betas=self.spec.betas, eps=self.spec.eps, weight_decay=self.spec.weight_decay)

    def _submit_host_update(self, c: ChunkState, coef: Tensor | None, src: Tensor | None = None,
                            lr: float | None = None, spill=None) -> None:
        """Queue ``c``'s AdamW step on the optimizer thread; ``src`` = its CPU slot (parameters + gradients) to
        update in place instead of the home copies."""
        spill = self._spill_futs.pop(c.i, spill)
        lr = self._lr if lr is None else lr
        prev = c.opt_fut
        c.grad = None
        c.stale_home = False
        held, c.held = c.held, None
        if src is not None and c.hp is not None:  # the new parameters go home from the slot
            self.bytes_d2h += c.cap * F32
        elif src is None and c.pinned and held is None:  # the device copy of a pinned chunk is refreshed
            self.bytes_h2d += c.cap * F32
        elif c.pinned and self._half:  # and its 16-bit copy (Updates._publish)
            self.bytes_h2d += c.cap * HALF

        def task():
            if spill is not None:
                spill.result()
            if prev is not None:
                prev.result()
            if held is not None:
                self._publish(c, self._host_update_held(c, held, coef, lr, src))
            else:
                self._host_update(c, coef, lr, src)
        c.opt_fut = self.opt_pool.submit(task)
        self._opt_futs.append(c.opt_fut)

    def _host_update_held(self, c: ChunkState, held: list, coef: Tensor | None, lr: float,
                          src: Tensor | None) -> Tensor:
        """AdamW of a ``_home_grads`` chunk with autograd's gradient tensors, on its slot (``src``, in place,
        then home), on its host copy, or (a mixed-precision master on disk) on its master read into the staging
        and written back; the gradients' host charge is released. Returns the updated fp32 parameters."""
        if c.hp is None:  # (only 16-bit chunks hand a disk-home chunk's gradients to the host)
            p = self._staged(0)[:c.cap]
            read: Future | None = self._disk.read_async(f"p{c.i}", p)
        else:
            p, read = (c.hp if src is None else src[:c.cap]), None
        count_steps([c])
        if self.placement.optimizer_tier == DISK:
            if coef is not None:  # (elementwise: the same product as clipping the items' views)
                torch._foreach_mul_([g for g in held if g is not None], coef.to(p.device))

            def arrived() -> None:
                if read is not None:
                    read.result()
            self._adamw_disk_moments(c, lambda m, v, lo, hi: c.param_items(p, held, m, v, lo, hi), lr, arrived,
                                     p if c.hp is None else None)
        else:
            if read is not None:
                read.result()
            self._adamw_params(c.param_items(p, held, *c.moments()), coef, lr)
            if c.hp is None:
                self._disk.write(f"p{c.i}", p)
        if src is not None and c.hp is not None:
            c.hp.copy_(p)
        self.tiers[HOST].release(self._held_bytes(held))
        return p

    def _publish(self, c: ChunkState, master: Tensor | None = None) -> None:
        """Under mixed precision, after ``c``'s update: the new fp32 master (``master``, by default the host copy)
        cast to 16 bits on the host (the copy fetches send up: a GPU's pinned one, or a disk-home chunk's) and,
        for a pinned chunk, into its device slot."""
        if not self._half:
            return
        master = c.hp if master is None else master
        assert master is not None  # (a pinned or host-home chunk's master is on the host under mixed precision)
        if c.hp16 is not None:
            c.hp16.copy_(master)
        if c.pinned:
            c.p().copy_(master if c.hp16 is None else c.hp16)

    def _host_update_held_together(self, chunks: list[ChunkState], coef: Tensor | None) -> None:
        """The clipped update of ``_home_grads`` chunks on the training thread, all in one AdamW call per
        weight-decay class (a call per chunk was 2 × 19 fused calls a step for GPT ``small``)."""
        items, helds = [], []
        for c in chunks:
            assert self._spill_futs.pop(c.i, None) is None and (c.opt_fut is None or c.opt_fut.done())
            assert c.held is not None and c.hp is not None  # (apply_updates chose chunks with held gradients)
            helds.append(c.held)
            c.held, c.grad, c.stale_home = None, None, False
        count_steps(chunks)
        for c, held in zip(chunks, helds):
            items += c.param_items(c.home_copy("p"), held, *c.moments())
        held_bytes = sum(self._held_bytes(held) for held in helds)
        self._adamw_params(items, coef, self._lr)
        for c in chunks:
            self._publish(c)
            if c.pinned and self._half:
                self.bytes_h2d += c.cap * HALF
        self.tiers[HOST].release(held_bytes)

    def _host_update(self, c: ChunkState, coef: Tensor | None, lr: float, src: Tensor | None = None,
                     into: Tensor | None = None) -> None:
        """AdamW of ``c`` from its home copies (or its CPU slot ``src``); ``into``: a disk-home chunk's device
        slot being fetched, which receives the new parameters too (on a CPU the update runs in it)."""
        n = c.cap
        on_disk = c.hp is None and not c.pinned
        reads: list = []
        if src is not None:
            p, g = src[:n], src[n:]
        elif on_disk:
            p = into if into is not None and into.device.type == "cpu" else self._staged(0)[:n]
            g = self._staged(1)[:n]
            reads = [self._disk.read_async(f"p{c.i}", p), self._disk.read_async(f"g{c.i}", g)]
        else:
            assert c.hp is not None and c.hg is not None  # not on disk: a host home, or a pinned chunk's master
            p, g = c.hp, c.hg

        def arrived() -> None:
            """The parameter and gradient reads (in flight beside the moments' first piece) are done; clip."""
            nonlocal coef
            for f in reads:
                f.result()
            reads.clear()
            if coef is not None:
                g.mul_(coef.to(g.device))
                coef = None
        p_written = False
        count_steps([c])
        if self.placement.optimizer_tier != DISK:
            arrived()
            adamw_chunks(c.flat_items(p, g, *c.moments()), **self._adamw_kw(lr))
        else:
            p_written = self._adamw_disk_moments(c, lambda m, v, lo, hi: c.flat_items(p, g, m, v, lo, hi), lr,
                                                 arrived, p if on_disk else None)
        if on_disk:
            if not p_written:
                self._disk.write(f"p{c.i}", p)
            if into is not None and into.data_ptr() != p.data_ptr():  # a GPU slot: from the pinned staging
                into.copy_(p, non_blocking=True)
                torch.cuda.current_stream(into.device).synchronize()  # the staging is reused next
        elif src is not None and c.hp is not None:
            c.hp.copy_(p)
        if c.pinned and src is None:
            c.p().copy_(p)

    def _adamw_kw(self, lr: float) -> dict[str, Any]:
        return dict(lr=lr, betas=self.spec.betas, eps=self.spec.eps, weight_decay=self.spec.weight_decay)

    def _adamw_disk_moments(self, c: ChunkState, items: Callable[[Tensor, Tensor, int, int], list], lr: float,
                            arrived: Callable[[], None], master: Tensor | None) -> bool:
        """AdamW of ``c`` with its moments streamed from disk: ``items(m, v, lo, hi)`` are the work items of
        elements ``[lo, hi)`` with those moments; ``arrived()`` runs once the first piece's moments are in (reads
        of the parameters and gradients go on beside them); ``master``: the chunk's fp32 parameters, written to
        its file beside the last piece's moments. Returns whether that write was issued (not for a chunk with
        nothing in use: it has no piece).

        Moments come in pieces of at most one chunk (a large tied chunk needs no large staging), cut at aligned
        offsets so they move by direct I/O; AdamW is elementwise, so piecewise equals whole. A piece's reads go
        out together, and so do its writes: the disk is the bottleneck here, and serves several requests faster
        than one at a time."""
        kw = self._adamw_kw(lr)
        piece = self.layout.chunk_elems
        written = False
        for lo in range(0, c.spec.used, piece):
            hi = min(c.cap, lo + piece)
            m, v = self._staged(2)[:hi - lo], self._staged(3)[:hi - lo]
            fm = self._disk.pool.submit(self._disk.read_range, f"m{c.i}", lo, m)
            self._disk.read_range(f"v{c.i}", lo, v)
            fm.result()
            arrived()
            adamw_chunks(items(m, v, lo, hi), **kw)
            outs = [self._disk.pool.submit(self._disk.write_range, f"m{c.i}", lo, m)]
            if master is not None and lo + piece >= c.spec.used:
                outs.append(self._disk.pool.submit(self._disk.write, f"p{c.i}", master))
                written = True
            self._disk.write_range(f"v{c.i}", lo, v)
            for f in outs:
                f.result()
        arrived()
        return written

    # ---- updates run by the next fetch -----------------------------------------------------------------------------
    def _update_at_fetch(self, c: ChunkState) -> bool:
        """``c``'s clipped update waits for its next fetch (ChunkState.pending): its parameters live on disk,
        where a separate update pass read them and the forward's fetch read them again (GPT-2 774M beyond RAM:
        3.1 GB of a step's 18.7 GB of disk reads). Not a deferred chunk's without clipping: its update runs beside
        the forward's first blocks, long before the fetch (run by the fetch, the forward waited for it)."""
        return c.hp is None and not c.pinned and c.held is None and not self.sharded  # (sharded: shared at once)

    def _pend(self, c: ChunkState, coef: Tensor | None) -> None:
        c.pending = (coef, self._lr, self._spill_futs.pop(c.i, None))
        c.grad = None
        c.stale_home = False  # the fetch that brings it back updates it first

    def _run_pending(self, c: ChunkState, pending: tuple, into: Tensor) -> None:
        """On the transfer thread: ``c``'s waiting update, whose new parameters land in ``into`` (its slot)."""
        coef, lr, spill = pending
        for f in (spill, self._pending_after):
            if f is not None:
                f.result()
        self._host_update(c, coef, lr, into=into)

    def _flush_pending(self) -> None:
        """Run the updates waiting for a fetch, or delayed to the next step, now (before the parameters are read:
        a checkpoint)."""
        if self._dpu:
            self._flush_delayed()
        for c in self.chunks:
            if c.pending is not None:
                coef, lr, spill = c.pending
                c.pending = None
                self._submit_host_update(c, coef, lr=lr, spill=spill)
        self.drain()

    def drain_optimizer(self) -> None:
        """Wait for the optimizer thread's work queued so far (updates, the hand-off's adds)."""
        for f in getattr(self, "_opt_futs", []):
            f.result()
        self._opt_futs = []

    def drain(self) -> None:
        """Wait for the background updates and transfers in flight (checkpoints, evaluation, benchmarks)."""
        self.drain_optimizer()
        self._wait_delayed()
        for c in self.chunks:
            c.opt_fut = None
        self.xfer.wait(self.xfer.submit(lambda: None))  # (the device's copies too, not only their issue)

    def _update_after_backward(self) -> Tensor:
        """After the last micro-batch's backward: the global gradient norm (returned, a 0-d tensor) from the
        per-parameter norms in the plain engine's order, then the updates that waited for it."""
        named = self.grad_norms_now()
        if self.combine_norm is not None:
            total_norm = self.combine_norm(named)
        elif named:
            total_norm = torch.linalg.vector_norm(torch.stack([n for _, n in named]), 2.0)
        else:
            total_norm = torch.zeros((), device=self.device)
        if self.scaler is not None:
            return self._scaled_update(total_norm)
        coef = None
        if self._deferred:
            coef = torch.clamp(self.spec.grad_clip / (total_norm + 1e-6), max=1.0)
        self.apply_updates(coef)
        return total_norm

    def _scaled_update(self, scaled_norm: Tensor) -> Tensor:
        """fp16: the gradients are the scaled loss's, all held on the host (16-bit chunks), every update waiting
        here. Their global norm is finite exactly when every gradient is (fp32 sums of squares of values in
        fp16's range cannot overflow): the inf/NaN check over all chunks. A step with one drops every gradient
        and updates nothing — no parameter, moment or step count — as GradScaler skips ``optimizer.step``;
        otherwise the unscaled norm clips, and one coefficient (clip factor / scale) multiplies each gradient,
        which with a power-of-two scale is the plain engine's ``unscale_`` then clip to the bit. The unscaled
        norm is returned."""
        assert self.scaler is not None
        found_inf = (~torch.isfinite(scaled_norm)).float()
        inv_scale = self.scaler.scale.double().reciprocal().float()  # as GradScaler.unscale_ computes it
        norm = scaled_norm * inv_scale.to(scaled_norm.device)
        self._skipped = bool(found_inf)
        if self._skipped:
            for c in self.owned():
                self._drop_grads(c)
                self._spill_futs.pop(c.i, None)
                c.stale_home = False  # its parameters stay as they are
        else:
            self.apply_updates(clip_coef(norm, self.spec.grad_clip) * inv_scale.to(norm.device))
        self.scaler.update(found_inf)
        return norm

    def grad_norms_now(self) -> list[tuple[str, Tensor]]:
        """(name, norm) of every parameter with a gradient this step, in the plain engine's order (after the
        backward; the norms of streamed chunks were taken as each completed, except those of gradients held on
        the host for an update after the backward: taken here, all in one call)."""
        if self.handoff is not None:  # the host's adds, and the norms queued behind them
            self.drain_optimizer()
        held = [c for c in self.owned() if self._home_grads(c) and c.held is not None]
        if held:
            self._norms(held)
        if self._all_on_device:  # norms of the gradients that exist (a parameter without one is skipped, as plain)
            live = [e for c in self.owned() for e in c.spec.entries if e.param.grad is not None]
            grads = [e.param.grad for e in live if e.param.grad is not None]
            for e, nrm in zip(live, torch._foreach_norm(grads, 2.0)):
                self._grad_norms[e.name] = nrm
        return [(nm, self._grad_norms[nm]) for nm in self.names if nm in self._grad_norms]

    def apply_updates(self, coef: Tensor | None) -> None:
        """The updates that waited for the end of the backward — all of them, multiplied by the clip ``coef``,
        when updates wait for the global norm (on a CPU the clipped host updates run here, elsewhere they are
        queued) — or for the next forward (the plan's deferred chunks)."""
        t_upd = time.perf_counter()
        if coef is not None and self.placement.optimizer_tier != DEVICE:
            # the host updates read it on other threads, whose copies wait on their own streams, not on the one
            # whose kernels computed it (a sweep job's): it comes to the host here, after them
            coef = coef.cpu()
        if self._dpu:
            self._delay(coef)
        elif self._all_on_device:
            self._update_params(coef)
        elif self._deferred and self.placement.optimizer_tier == DEVICE:
            for c in self.owned():
                self._access((c.i,), grads=True)
                self._update_device([c], coef)
        elif self._deferred:
            together = []  # run here and now (a CPU): every held-gradient chunk in one fused call per class
            for c in self.owned():
                if self._updates_inline and c.held is not None and not self._in_slot(c):
                    together.append(c)
                elif self._update_at_fetch(c):
                    self._pend(c, coef)
                else:
                    self._submit_host_update(c, coef, src=c.slot if self._in_slot(c) else None)
            if together:
                self._host_update_held_together(together, coef)
        elif self._defer:
            # the plan's deferred chunks: their updates run beside the next forward, in the order it uses them,
            # moving their disk traffic out of the backward, where the disk is the bottleneck
            for i in self._defer:
                if self.owns(i):
                    self._submit_host_update(self.chunks[i], None)
        # an update run by a fetch uses the staging buffers: after the host updates queued so far
        self._pending_after = self._opt_futs[-1] if self._opt_futs else None
        self.phase_s["update"] += time.perf_counter() - t_upd
        if (self._deferred or self._defer) and self.placement.optimizer_tier != DEVICE:  # FIFO: runs after the last

            def note_pass() -> None:
                self.phase_s["update_pass"] += time.perf_counter() - t_upd
            self.opt_pool.submit(note_pass)

    # ---- tied gradients ----------------------------------------------------------------------------------------
    def _tied_grads_begin(self) -> list[tuple[ChunkState, Tensor | None, Any]]:
        """A tied tensor's gradient gets contributions from several blocks. The plain engine sums one
        micro-batch's contributions first and then adds that sum to the accumulated gradient; to round the same
        way, later micro-batches accumulate a tied chunk's gradient in a temporary buffer first."""
        out: list[tuple[ChunkState, Tensor | None, Any]] = []
        for c in self.chunks:
            if c.spec.tied and self._all_on_device:
                # autograd sums this micro-batch's contributions in a fresh .grad; _tied_grads_end adds it
                stash = [(e.param, e.param.grad) for e in c.spec.entries]
                for e in c.spec.entries:
                    e.param.grad = None
                self.tiers[DEVICE].charge(c.cap * F32, "tied gradient of one micro-batch")
                out.append((c, None, stash))
            elif c.spec.tied and not self._home_grads(c):  # (held gradients are summed on the host in fp32)
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
