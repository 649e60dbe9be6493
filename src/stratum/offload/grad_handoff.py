"""The per-chunk hand-off of 16-bit gradients to the host (``offload.grad_handoff``, Placement.chunk_grads).

Under mixed-precision placement (16-bit chunks, fp32 masters and AdamW on the host) every gradient autograd makes
must reach the chunk's fp32 accumulator on the host. The per-tensor path (``Updates._take_grad``) copies each one
there as autograd hands it over: on a GPU a synchronous copy per parameter and micro-batch on the training
thread. This path moves a chunk at a time:

- **device buffers.** While a chunk receives gradients in a micro-batch's backward (from the backward of its last
  block to that of its first, ``Layout.ready_block``) it holds a flat 16-bit buffer on the device with its
  slot's offsets. The post-accumulate hook (:meth:`ChunkHandoff.take`) copies a parameter's first contribution of
  the micro-batch into it and adds later ones (a tied tensor's two blocks), in 16 bits, as autograd sums a
  tensor's contributions. A pinned chunk (tied tensors; outliers) has its own buffer; the others share a pool of
  :func:`open_chunks` + :data:`SPARE` chunk-sized buffers.
- **one copy per chunk and micro-batch.** After the backward of the chunk's first block, its buffer's used
  elements go in one copy to a pinned 16-bit host staging buffer, on the transfer stream after an event recorded
  on the compute stream (``Transfers.submit``); the buffer goes back to the pool with that copy's future, and a
  chunk taking it next makes the compute stream wait for the copy's completion event before writing to it.
- **the host's add.** On the optimizer thread (FIFO with the host updates, which therefore read the gradient
  after it), once the copy's event has completed, the staging is cast into the chunk's fp32 accumulator
  (``ChunkState.hg``; the micro-batch's first) or added to it (later ones). The staging buffers form a ring of
  :data:`STAGING`; a copy into one waits until the add that read its last contents has finished. When the chunk's
  step gradient completes its held gradients (``ChunkState.held``) are views of the accumulator.

On a CPU the "device" is host memory, the copies are memcpys and everything runs inline on the training thread:
this path then adds a copy per gradient and one per chunk, so ``auto`` picks it only where copies are
asynchronous (a GPU); ``chunk`` forces it (the CPU tests run it that way).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor, Future

import torch
from torch import Tensor

from stratum.config import OFFLOAD_GRAD_HANDOFFS
from stratum.errors import StratumError
from stratum.offload.chunk_state import ChunkState
from stratum.offload.chunks import Layout
from stratum.offload.prefetch import Transfers
from stratum.offload.tiers import DEVICE, HALF, HOST

SPARE = 1
"""Pooled device buffers beyond the most chunks receiving gradients at once: the chunk that opens next takes the
buffer released longest ago, whose copy to the host has most likely finished, so the compute stream rarely waits."""
STAGING = 2
"""Pinned staging buffers for chunk-sized copies: one is copied into while the host adds the other."""

Alloc = Callable[[str, int, str, torch.dtype], Tensor]
"""(tier, elements, what for the tier's accounting, dtype) → a zeroed buffer charged to that tier."""


def per_chunk(mode: str, async_copies: bool) -> bool:
    """Whether ``offload.grad_handoff = mode`` hands 16-bit gradients over per chunk: ``auto`` where copies run
    beside compute (a GPU)."""
    if mode not in OFFLOAD_GRAD_HANDOFFS:
        raise StratumError(f"offload.grad_handoff = {mode!r} is not one of: {', '.join(OFFLOAD_GRAD_HANDOFFS)}")
    return mode == "chunk" or (mode == "auto" and async_copies)


def open_chunks(layout: Layout) -> int:
    """The most streamed chunks receiving gradients at once in a backward: those whose blocks span block ``i``."""
    pinned = {c.index for c in layout.chunks if c.pinned}
    last = layout.last_block
    spans = [(layout.ready_block[c], last[c]) for c in last if c not in pinned]
    return max((sum(lo <= i <= hi for lo, hi in spans) for i in range(len(layout.block_chunks))), default=0)


def buffer_elems(layout: Layout) -> tuple[list[int], list[int]]:
    """Elements of each device buffer and each host staging buffer the hand-off allocates: each pinned chunk's own
    of its capacity, then the pooled chunk-sized ones (never more than there are streamed chunks)."""
    pinned = [c.capacity for c in layout.chunks if c.pinned]
    streamed = sum(not c.pinned for c in layout.chunks)
    C = layout.chunk_elems
    return (pinned + [C] * min(open_chunks(layout) + SPARE, streamed), pinned + [C] * min(STAGING, streamed))


def handoff_bytes(layout: Layout) -> dict[str, int]:
    """Tier → bytes the hand-off's buffers hold (16-bit: device buffers, host staging), for the step model."""
    dev, staging = buffer_elems(layout)
    return {DEVICE: HALF * sum(dev), HOST: HALF * sum(staging)}


def link_bytes(layout: Layout, n_micro: int) -> int:
    """Bytes the hand-off copies to the host per step: each chunk's used elements in 16 bits, once a micro-batch."""
    return n_micro * HALF * sum(c.used for c in layout.chunks)


class ChunkHandoff:
    """The per-chunk hand-off of one engine's chunks (see the module docstring)."""

    def __init__(self, layout: Layout, chunks: list[ChunkState], dtype: torch.dtype, alloc: Alloc, xfer: Transfers,
                 opt_pool: Executor):
        self.xfer, self.opt_pool = xfer, opt_pool
        dev, staging = buffer_elems(layout)
        n_pinned = sum(c.spec.pinned for c in chunks)
        bufs = [alloc(DEVICE, n, "gradient hand-off buffer", dtype) for n in dev]
        stage = [alloc(HOST, n, "staging: gradient hand-off", dtype) for n in staging]
        pinned = [c.i for c in chunks if c.spec.pinned]
        self.pool: dict[int | None, list[tuple[Tensor, Future | None]]] = {
            None: [(b, None) for b in bufs[n_pinned:]], **{i: [(bufs[k], None)] for k, i in enumerate(pinned)}}
        """Free device buffers — the pooled ones (key None), oldest released first, and each pinned chunk's own (key:
        the chunk) — each with its last copy to the host (or None)."""
        self.ring: dict[int | None, list[tuple[Tensor, Future | None]]] = {
            None: [(s, None) for s in stage[n_pinned:]], **{i: [(stage[k], None)] for k, i in enumerate(pinned)}}
        """Staging buffers, keyed as ``pool``, next to use first, each with the host's add that read it last (or
        None)."""
        last = layout.last_block
        self.opens = {i: [c for c in chunks if last.get(c.i) == i] for i in range(len(layout.block_chunks))}
        self.closes = {i: [c for c in chunks if layout.ready_block.get(c.i) == i]
                       for i in range(len(layout.block_chunks))}
        self.target: dict[int, tuple[Tensor, int, int]] = {}
        """id(parameter) → (its view of its chunk's open buffer, chunk, entry)."""
        self.open: dict[int, Tensor] = {}
        """Chunk → its device buffer while it receives this micro-batch's gradients."""
        self.got: dict[int, set[int]] = {c.i: set() for c in chunks}
        """Chunk → its entries with a contribution in this micro-batch."""
        self.step_got: dict[int, set[int]] = {c.i: set() for c in chunks}
        """Chunk → its entries with a contribution in this step (``ChunkState.live``)."""
        self.adds: dict[int, Future] = {}
        """Chunk → the host's last add of its gradient this step."""
        self._views: dict[tuple[int, int], list[tuple[int, Tensor]]] = {}
        self._held: dict[int, list[Tensor]] = {}
        self.bytes_d2h = 0
        self.wait_s = 0.0
        """Seconds the training thread waited for a pooled buffer's copy to be issued (its staging still being
        read by the host's add): on a GPU the sign that the adds lag behind the backward."""

    def begin_step(self) -> None:
        for s in self.step_got.values():
            s.clear()
        self.adds.clear()

    def take(self, param: Tensor) -> None:
        """Post-accumulate hook: the contribution in ``param.grad`` into its chunk's device buffer (copied if it
        is the micro-batch's first, added in 16 bits otherwise)."""
        grad = param.grad
        assert grad is not None  # a post-accumulate hook runs with the gradient in place
        view, ci, k = self.target[id(param)]
        got = self.got[ci]
        if k in got:
            view.add_(grad)
        else:
            view.copy_(grad)
            got.add(k)
        param.grad = None

    def open_block(self, i: int) -> None:
        """Before block ``i``'s backward: the chunks whose gradients start with it take a device buffer."""
        for c in self.opens[i]:
            buf, copied = self.pool[self._key(c)].pop(0)
            t0 = time.perf_counter()
            self.xfer.wait(copied)  # (the compute stream waits for the buffer's last copy to the host)
            self.wait_s += time.perf_counter() - t0
            self.open[c.i] = buf
            key = (buf.data_ptr(), c.i)
            if key not in self._views:
                self._views[key] = [(id(e.param), buf[e.offset:e.offset + e.numel].view(e.shape))
                                    for e in c.spec.entries]
            for k, (pid, view) in enumerate(self._views[key]):
                self.target[pid] = (view, c.i, k)

    def close_block(self, i: int, first: bool) -> list[Future]:
        """After block ``i``'s backward: each chunk whose gradients end with it goes to the host in one copy and
        is added there (``first``: the step's first micro-batch, cast into the accumulator); the adds queued."""
        return [self._hand_over(c, first) for c in self.closes[i]]

    def _hand_over(self, c: ChunkState, first: bool) -> Future:
        buf = self.open.pop(c.i)
        got = self.got[c.i]
        for k, e in enumerate(c.spec.entries):  # the pooled buffer holds another chunk's values there
            if k not in got:
                buf[e.offset:e.offset + e.numel].zero_()
        self.step_got[c.i] |= got
        got.clear()
        staging, read = self.ring[self._key(c)].pop(0)
        n, acc = c.spec.used, c.home_copy("g")

        def copy() -> None:
            if read is not None:
                read.result()  # the host's add has read the staging's last contents
            staging[:n].copy_(buf[:n], non_blocking=True)
        copied = self.xfer.submit(copy)

        def add() -> None:
            done = copied.result()
            if isinstance(done, torch.cuda.Event):
                done.synchronize()
            if first:
                acc[:n].copy_(staging[:n])
            else:
                acc[:n].add_(staging[:n])
        added = self.opt_pool.submit(add)
        self.pool[self._key(c)].append((buf, copied))
        self.ring[self._key(c)].append((staging, added))
        self.adds[c.i] = added
        self.bytes_d2h += n * HALF
        return added

    @staticmethod
    def _key(c: ChunkState) -> int | None:
        """Which buffers ``c`` uses: a pinned chunk its own, the others the pooled ones."""
        return c.i if c.spec.pinned else None

    def held(self, c: ChunkState) -> list[Tensor | None]:
        """``c``'s step gradient as views of its accumulator, None for an entry without one (after the last
        micro-batch's hand-off; read them after :meth:`wait`)."""
        views = self._held.get(c.i)
        if views is None:
            acc = c.home_copy("g")
            views = self._held[c.i] = [acc[e.offset:e.offset + e.numel].view(e.shape) for e in c.spec.entries]
        got = self.step_got[c.i]
        return [v if k in got else None for k, v in enumerate(views)]

    def wait(self, c: ChunkState | None = None) -> None:
        """Until the host's adds of ``c`` (all chunks: None) this step have finished."""
        for i in [c.i] if c is not None else list(self.adds):
            f = self.adds.get(i)
            if f is not None:
                f.result()
