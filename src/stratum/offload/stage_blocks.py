"""The offload engine as a pipeline rank's block runner: the rank's stages run block by block on chunks.

The pipeline runtime (:class:`~stratum.runtime.stage.StageRuntime`) decides when a stage runs forward or backward
for a micro-batch; this decides how: the engine holds the rank's blocks (a BlockSeq of them, ``engine.model``) in
chunks over device, host and disk, and every block's forward and backward first makes its chunks resident, as the
engine's own step does. A stage's forward keeps each block's input and output (the graph between them) until the
stage's backward for that micro-batch, so several micro-batches are in flight as the schedule says.

What the in-flight micro-batches keep is the plan's choice (Placement.activations with Placement.inflight, priced
by the step model per micro-batch in flight): ``keep`` holds every block's saved activations on the device;
``recompute`` runs the forward keeping nothing but each block's input (its checkpoint; the stage's output too,
which the runtime holds) and recomputes each block in the backward from its input, its RNG state and buffer
values (dropout streams draw the same masks: model/streams.py); ``offload`` also copies the checkpoints to the
host tier once the stage's forward is done and fetches them back for that micro-batch's backward — after the
rank's previous backward, as the schedule's order of backwards says, so on a GPU the copy runs before it is
needed. A chunk's gradient is complete after the backward of its earliest block for the step's last
micro-batch; then its reduction (:attr:`OffloadEngine.reducer`) is launched, and once it has completed — beside
the stages' later work, at the latest when :meth:`finish` settles all — it is normed, and updated or handed home
as the plan says. Chunks holding a tensor tied to another pipeline rank complete after the schedule has run
(:meth:`finish`):
their reduction is a collective, and inside the schedule it could wait on a rank that waits on this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from stratum.model.neutral import BufferSnapshot, neutral
from stratum.model.streams import block_stream
from stratum.offload.engine import OffloadEngine, discard, discarded
from stratum.offload.placement import KEEP, SPILL
from stratum.offload.tiers import HOST
from stratum.runtime.device import autocast


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _Checkpoint:
    """One stage's micro-batch between its forward and its backward when its blocks are recomputed."""

    stream: int | None
    ins: list[Tensor | None] = field(default_factory=list)
    """Each block's input on the device (None while spilled; the stage input, the runtime's leaf, is emptied in
    place instead: the runtime reads its gradient)."""
    host: list[Tensor | None] = field(default_factory=list)
    """Each block's spilled input on the host (None when on the device)."""
    rng: list[tuple] = field(default_factory=list)
    bufs: list[BufferSnapshot | None] = field(default_factory=list)
    tail: Tensor | None = None
    """The stage's output as handed to the runtime (a leaf: the backward reads its gradient)."""
    held: int = 0
    """Device bytes of this micro-batch's checkpoints counted in the engine's activations now."""


class OffloadBlocks:
    """Runs stage blocks through ``engine`` (see the module docstring).

    ``stage_blocks``: stage → its blocks' indices in the whole model; ``local``: such an index → the block's index
    in ``engine.model``; ``late``: chunks that complete in :meth:`finish`."""

    def __init__(self, engine: OffloadEngine, *, stage_blocks: dict[int, list[int]], local: dict[int, int],
                 late: set[int], order: list[tuple[int, int]] | None = None):
        self.engine = engine
        self.mode = engine.placement.activations
        self.order = order or []
        """The rank's backwards in the schedule's order, (stage, micro-batch): a spilled micro-batch is fetched
        back after the backward before its own."""
        self.stage_blocks = stage_blocks
        self.local = local
        self.late = late
        self.saved: dict[tuple[int, int], tuple[list, list, int, list[int]] | _Checkpoint] = {}
        """(stage, micro-batch) → (kept: block inputs, block outputs, activation bytes held, storages of the
        inputs) or its checkpoint."""
        self.backwards: dict[int, int] = {}
        self.microbatches = 0
        self.done = 0
        """Backwards run this step."""
        self._working = 0
        """Bytes of the saved tensors of the block being recomputed."""
        self._first = False
        """The backward running is its stage's first this step (the per-chunk hand-off casts, not adds)."""

    def begin_step(self, lr: float, microbatches: int) -> None:
        self.engine.begin_step(lr)
        self.backwards = {s: 0 for s in self.stage_blocks}
        self.microbatches = microbatches
        self.done = 0

    def forward(self, s: int, mb: int, x: Tensor, stream: int | None, training: bool) -> Tensor:
        if not training:
            return self._forward_eval(s, x, stream)
        if self.mode != KEEP:
            return self._forward_checkpointed(s, mb, x, stream)
        return self._forward_kept(s, mb, x, stream)

    def _forward_eval(self, s: int, x: Tensor, stream: int | None) -> Tensor:
        eng = self.engine
        for g in self.stage_blocks[s]:
            i = self.local[g]
            eng._access(eng._block_chunks(i), record=False)
            with block_stream(stream, g, eng.device):
                x = eng.model.blocks[i](x)
        return x

    def _forward_kept(self, s: int, mb: int, x: Tensor, stream: int | None) -> Tensor:
        """The stage's blocks keeping every saved activation (and each block's input and output) on the device."""
        eng = self.engine
        ins: list[Tensor] = []
        outs: list[Tensor] = []
        held, ptrs = 0, []
        for g in self.stage_blocks[s]:
            i = self.local[g]
            eng._access(eng._block_chunks(i))
            # the stage input is the runtime's own leaf (it reads its gradient); later inputs are cut here
            xi = x if not ins else x.detach().requires_grad_(x.is_floating_point())
            if xi.is_floating_point():  # a kept block input: counted once, never again as a saved tensor
                ptr = xi.untyped_storage().data_ptr()
                ptrs.append(ptr)
                eng._boundary.add(ptr)
                nbytes = xi.untyped_storage().nbytes()
                held += nbytes
                eng._act += nbytes
            before, eng._act_seen = eng._act, set()
            with torch.autograd.graph.saved_tensors_hooks(eng._pack, eng._unpack), \
                    block_stream(stream, g, eng.device):
                out = eng.model.blocks[i](xi)
            held += eng._act - before
            eng._check()
            ins.append(xi)
            outs.append(out)
            x = out
        self.saved[(s, mb)] = (ins, outs, held, ptrs)
        return x

    def backward(self, s: int, mb: int, out: Tensor, grad: Tensor | None) -> None:
        saved = self.saved.pop((s, mb))
        self.backwards[s] += 1
        final = self.backwards[s] == self.microbatches
        self._first = self.backwards[s] == 1
        if isinstance(saved, _Checkpoint):
            self._backward_checkpointed(s, saved, out, grad, final)
        else:
            self._backward_kept(s, saved, out, grad, final)
        self.done += 1
        nxt = self.order[self.done] if self.done < len(self.order) else None
        ahead = self.saved.get(nxt) if nxt is not None else None
        if isinstance(ahead, _Checkpoint):
            self._fetch(ahead)

    def _block_access(self, i: int, final: bool) -> None:
        """Block ``i``'s chunks resident for its backward, their gradients wanted (under the per-chunk hand-off,
        the chunks whose gradients start here take their device buffers); on the step's last micro-batch its
        backward is noted as begun (what the reductions in flight overlap)."""
        eng = self.engine
        eng._access(eng._block_chunks(i), grads=True)
        for ci in eng._block_chunks(i):
            c = eng.chunks[ci]
            if c.grad is None:  # filled by _take_grad (a parameter without a gradient: skipped)
                c.grad = "home" if eng._home_grads(c) else "dev"
        if eng.handoff is not None:
            eng.handoff.open_block(i)
        if final:
            eng._note_backward(i)

    def _block_done(self, i: int, final: bool) -> None:
        """Block ``i``'s backward is done: on the step's last micro-batch its chunks whose gradient is now
        complete go on to their reduction and update."""
        eng = self.engine
        if eng.handoff is not None:
            # the chunks whose gradients end here go to the host: cast into the accumulator on the stage's first
            # backward this step, added after
            eng._opt_futs += eng.handoff.close_block(i, self._first)
        if final:
            for ci in eng._block_chunks(i):
                if eng.layout.ready_block[ci] == i and ci not in self.late:
                    eng._grad_complete(eng.chunks[ci])
        eng._check()

    def _backward_kept(self, s: int, saved: tuple, out: Tensor, grad: Tensor | None, final: bool) -> None:
        eng = self.engine
        ins, outs, held, ptrs = saved
        blocks = self.stage_blocks[s]
        for k in reversed(range(len(blocks))):
            i = self.local[blocks[k]]
            self._block_access(i, final)
            o, g = (out, grad) if k == len(blocks) - 1 else (outs[k], ins[k + 1].grad)
            if o.requires_grad:
                torch.autograd.backward(o, g)
            outs[k] = None
            self._block_done(i, final)
        eng._act -= held
        eng._boundary.difference_update(ptrs)

    # ---- recompute / offload ------------------------------------------------------------------------------
    def _forward_checkpointed(self, s: int, mb: int, x: Tensor, stream: int | None) -> Tensor:
        """The stage's blocks keeping only each block's input (and the RNG state and buffers it ran with); with
        offload the inputs then go to the host."""
        eng = self.engine
        cp = _Checkpoint(stream=stream)
        for k, g in enumerate(self.stage_blocks[s]):
            i = self.local[g]
            eng._access(eng._block_chunks(i))
            # the stage input is the runtime's own leaf (it reads its gradient); later inputs are cut here
            xi = x if k == 0 else x.requires_grad_(x.is_floating_point())
            cp.ins.append(xi)
            cp.host.append(None)
            cp.rng.append(eng._rng_state())
            block = eng.model.blocks[i]
            cp.bufs.append(BufferSnapshot([block]) if any(True for _ in block.buffers()) else None)
            self._hold(cp, _nbytes(xi))
            # grad mode on, as the recompute runs (a GPU may pick another attention kernel under no_grad)
            with torch.autograd.graph.saved_tensors_hooks(discard, discarded), block_stream(stream, g, eng.device):
                x = block(xi).detach()
        cp.tail = x.requires_grad_(x.is_floating_point())
        self._hold(cp, _nbytes(x))
        if self.mode == SPILL:
            self._spill(cp)
        self.saved[(s, mb)] = cp
        return cp.tail

    def _hold(self, cp: _Checkpoint, nbytes: int) -> None:
        """``nbytes`` more of ``cp`` on the device (negative: fewer), checked against the device budget."""
        eng = self.engine
        cp.held += nbytes
        eng._act += nbytes
        eng.peak_act = max(eng.peak_act, eng._act)
        eng._check()

    def _spill(self, cp: _Checkpoint) -> None:
        """Copy ``cp``'s block inputs to the host tier and free them on the device (the stage output stays: the
        runtime holds it)."""
        eng = self.engine
        for k, xi in enumerate(cp.ins):
            assert xi is not None
            n = _nbytes(xi)
            eng.tiers[HOST].charge(n, "spilled block inputs")
            host = torch.empty(xi.shape, dtype=xi.dtype, pin_memory=eng.device.type == "cuda")
            host.copy_(xi.detach(), non_blocking=True)
            cp.host[k] = host
            if xi.requires_grad and k == 0:  # the runtime's leaf: emptied in place, refilled by _fetch
                xi.data = torch.empty(0, dtype=xi.dtype, device=xi.device)
            else:
                cp.ins[k] = None
            eng.bytes_d2h += n
            self._hold(cp, -n)

    def _fetch(self, cp: _Checkpoint) -> None:
        """``cp``'s spilled block inputs back on the device (asynchronous copies on a GPU), released on the host."""
        eng = self.engine
        for k, host in enumerate(cp.host):
            if host is None:
                continue
            dev = torch.empty(host.shape, dtype=host.dtype, device=eng.device).copy_(host, non_blocking=True)
            xi = cp.ins[k]
            if xi is not None:
                xi.data = dev
            else:
                cp.ins[k] = dev.requires_grad_(k > 0 and dev.is_floating_point())
            cp.host[k] = None
            eng.tiers[HOST].release(_nbytes(host))
            eng.bytes_h2d += _nbytes(host)
            self._hold(cp, _nbytes(host))

    def _backward_checkpointed(self, s: int, cp: _Checkpoint, out: Tensor, grad: Tensor | None,
                               final: bool) -> None:
        """Each block recomputed from its input (fetched back if spilled), last first, and back-propagated; the
        block's saved tensors count toward the device's activations while it runs."""
        eng = self.engine
        self._fetch(cp)
        tail = cp.tail
        assert tail is not None
        if out is not tail:  # the last stage: the runtime's scaled loss over the output
            if out.requires_grad:
                torch.autograd.backward(out, grad)
            grad = tail.grad
        blocks = self.stage_blocks[s]
        for k in reversed(range(len(blocks))):
            i = self.local[blocks[k]]
            self._block_access(i, final)
            xi = cp.ins[k]
            assert xi is not None
            o = self._recompute(cp, k, blocks[k], i, xi)
            if o.requires_grad and grad is not None:
                torch.autograd.backward(o, grad)
            del o
            eng._act, eng._act_seen = eng._act - self._working, set()
            grad = xi.grad if k > 0 else None
            self._hold(cp, -_nbytes(xi))
            cp.ins[k] = None
            self._block_done(i, final)
        self._hold(cp, -cp.held)

    def _recompute(self, cp: _Checkpoint, k: int, g: int, i: int, xi: Tensor) -> Tensor:
        """Block ``i`` (``g`` in the whole model, the ``k``-th of its stage) run again on its input as its first
        forward ran (RNG state, buffer values, dropout stream), its saved tensors counted (``_working``)."""
        eng = self.engine
        block = eng.model.blocks[i]
        before, eng._act_seen = eng._act, set()
        eng._boundary.add(xi.untyped_storage().data_ptr())
        try:
            with neutral(block, devices=[eng.device]), autocast(eng.device, eng.precision), \
                    torch.autograd.graph.saved_tensors_hooks(eng._pack, eng._unpack):
                eng._set_rng_state(cp.rng[k])
                snap = cp.bufs[k]
                if snap is not None:
                    snap.restore()
                with block_stream(cp.stream, g, eng.device):
                    out = block(xi)
        finally:
            eng._boundary.discard(xi.untyped_storage().data_ptr())
        self._working = eng._act - before
        eng._check()
        return out

    def finish(self) -> None:
        """After the schedule: the late chunks complete (their reductions are collectives), then every reduction
        in flight is settled; nothing is left."""
        eng = self.engine
        for ci in sorted(self.late):
            eng._access((ci,), grads=True)
            eng._grad_complete(eng.chunks[ci])
        eng._settle_all()
        if self.saved:
            raise RuntimeError(f"offload stage: micro-batches left without a backward: {sorted(self.saved)[:3]}")
