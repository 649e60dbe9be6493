"""The offload engine as a pipeline rank's block runner: the rank's stages run block by block on chunks.

The pipeline runtime (:class:`~stratum.runtime.stage.StageRuntime`) decides when a stage runs forward or backward
for a micro-batch; this decides how: the engine holds the rank's blocks (a BlockSeq of them, ``engine.model``) in
chunks over device, host and disk, and every block's forward and backward first makes its chunks resident, as the
engine's own step does. A stage's forward keeps each block's input and output (the graph between them) until the
stage's backward for that micro-batch, so several micro-batches are in flight as the schedule says; their saved
activations stay on the device (the plan's activation bytes count every micro-batch the schedule keeps in
flight). A chunk's gradient is complete after the backward of its earliest block for the step's last
micro-batch; then its reduction (:attr:`OffloadEngine.reducer`) is launched, and once it has completed — beside
the stages' later work, at the latest when :meth:`finish` settles all — it is normed, and updated or handed home
as the plan says. Chunks holding a tensor tied to another pipeline rank complete after the schedule has run (:meth:`finish`):
their reduction is a collective, and inside the schedule it could wait on a rank that waits on this one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stratum.model.streams import block_stream
from stratum.offload.engine import OffloadEngine


class OffloadBlocks:
    """Runs stage blocks through ``engine`` (see the module docstring).

    ``stage_blocks``: stage → its blocks' indices in the whole model; ``local``: such an index → the block's index
    in ``engine.model``; ``late``: chunks that complete in :meth:`finish`."""

    def __init__(self, engine: OffloadEngine, *, stage_blocks: dict[int, list[int]], local: dict[int, int],
                 late: set[int]):
        self.engine = engine
        self.stage_blocks = stage_blocks
        self.local = local
        self.late = late
        self.saved: dict[tuple[int, int], tuple[list, list, int, list[int]]] = {}
        """(stage, micro-batch) → block inputs, block outputs, activation bytes held, storages of the inputs."""
        self.backwards: dict[int, int] = {}
        self.microbatches = 0

    def begin_step(self, lr: float, microbatches: int) -> None:
        self.engine.begin_step(lr)
        self.backwards = {s: 0 for s in self.stage_blocks}
        self.microbatches = microbatches

    def forward(self, s: int, mb: int, x: Tensor, stream: int | None, training: bool) -> Tensor:
        eng = self.engine
        if not training:
            for g in self.stage_blocks[s]:
                i = self.local[g]
                eng._access(eng._block_chunks(i), record=False)
                with block_stream(stream, g, eng.device):
                    x = eng.model.blocks[i](x)
            return x
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
        eng = self.engine
        ins, outs, held, ptrs = self.saved.pop((s, mb))
        self.backwards[s] += 1
        final = self.backwards[s] == self.microbatches
        blocks = self.stage_blocks[s]
        for k in reversed(range(len(blocks))):
            i = self.local[blocks[k]]
            eng._access(eng._block_chunks(i), grads=True)
            for ci in eng._block_chunks(i):
                c = eng.chunks[ci]
                if c.grad is None:  # filled by _take_grad (a parameter without a gradient: skipped)
                    c.grad = "home" if eng._home_grads(c) else "dev"
            if final:
                eng._note_backward(i)
            o, g = (out, grad) if k == len(blocks) - 1 else (outs[k], ins[k + 1].grad)
            if o.requires_grad:
                torch.autograd.backward(o, g)
            outs[k] = None
            if final:
                for ci in eng._block_chunks(i):
                    if eng.layout.ready_block[ci] == i and ci not in self.late:
                        eng._grad_complete(eng.chunks[ci])
            eng._check()
        eng._act -= held
        eng._boundary.difference_update(ptrs)

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
