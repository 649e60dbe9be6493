"""The deferred (clipped) AdamW pass over chunks whose parameters live on disk, pipelined across chunks.

With gradient clipping every update waits for the whole backward; then each disk chunk's parameters,
gradients and (with a disk optimizer) moments are read, updated and written back. Done one chunk after another,
the disk idles while a chunk is read and then while it is written. Here two staging sets alternate: while
chunk k's new values are being written from one set, chunk k+1's inputs are already being read into the other,
so reads and writes overlap and the pass runs at the disk's bandwidth rather than its latency. Each update
still returns only once its own writes have ended, because the next forward reads the parameters back.

The arithmetic is ``adamw_chunk`` on the same flat ranges as the unpipelined path: bit-identical results.
"""

from __future__ import annotations

from concurrent.futures import Future

from torch import Tensor

from stratum.offload.cpu_adam import adamw_chunk
from stratum.offload.tiers import DiskStore


class UpdatePipeline:
    """Runs on the optimizer thread, one chunk at a time, in the order given to :meth:`begin`."""

    def __init__(self, disk: DiskStore, sets: list[list[Tensor | None]], moments_on_disk: bool):
        self.disk = disk
        self.sets = sets
        """Two staging sets [params, grads, exp_avg, exp_avg_sq] (moments None when they live in RAM)."""
        self.moments_on_disk = moments_on_disk
        self._next: dict[int, object] = {}
        self._set_of: dict[int, int] = {}
        self._spilled: dict[int, Future | None] = {}
        self._reads: dict[int, list[Future]] = {}
        self.overlapped_reads = 0
        """Chunks whose inputs were read while the previous chunk was written (all but the first of a pass)."""

    def begin(self, chunks: list, spilled: dict[int, Future | None]) -> None:
        """The chunks this pass updates, in order, and the futures of their gradient write-backs."""
        self._next = {a.i: b for a, b in zip(chunks, chunks[1:])}
        self._set_of = {c.i: k % 2 for k, c in enumerate(chunks)}
        self._spilled = dict(spilled)
        self._reads = {}

    def _issue_reads(self, c) -> None:
        fut = self._spilled.pop(c.i, None)
        if fut is not None:  # its gradient must be on disk before it is read back
            fut.result()
        p, g, m, v = (t[:c.cap] if t is not None else None for t in self.sets[self._set_of[c.i]])
        futs = [self.disk.read_async(f"p{c.i}", p), self.disk.read_async(f"g{c.i}", g)]
        if self.moments_on_disk:
            futs += [self.disk.read_async(f"m{c.i}", m), self.disk.read_async(f"v{c.i}", v)]
        self._reads[c.i] = futs

    def update(self, c, coef: Tensor | None, lr: float, *, betas, eps: float, weight_decay: float) -> None:
        """Chunk ``c``'s AdamW step from its staged inputs; starts the next chunk's reads beside its writes."""
        if c.i not in self._reads:
            self._issue_reads(c)
        for f in self._reads.pop(c.i):
            f.result()
        p, g, m, v = (t[:c.cap] if t is not None else None for t in self.sets[self._set_of[c.i]])
        if not self.moments_on_disk:
            m, v = c.m, c.v
        if coef is not None:
            g.mul_(coef.to(g.device))
        adamw_chunk(p, g, m, v, c.step, c.spec.n_decay, c.spec.used, lr=lr, betas=betas, eps=eps,
                    weight_decay=weight_decay)
        writes = [self.disk.write_async(f"p{c.i}", p)]
        if self.moments_on_disk:
            writes += [self.disk.write_async(f"m{c.i}", m), self.disk.write_async(f"v{c.i}", v)]
        nxt = self._next.pop(c.i, None)
        if nxt is not None:  # its set was last used by the chunk before this one, whose writes have ended
            self._issue_reads(nxt)
            self.overlapped_reads += 1
        for f in writes:
            f.result()
