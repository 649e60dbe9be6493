"""One micro-batch of the offload engine's step, from its forward to its backward: what each block left for its
backward (its input, its output where kept, its RNG state and buffers where recomputed), and the moves of the
tensors only this record holds to host memory and back while the engine is vacated (a multi-job scheduler's
waits: :meth:`stratum.offload.vacate.Vacate.vacate`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from stratum.model.neutral import BufferSnapshot


@dataclass
class MicroBatch:
    """One micro-batch of :meth:`OffloadEngine.train_share`, from its forward to its backward."""

    y: Tensor
    stream: int | None
    n: int
    """Micro-batches of this engine's share of the step."""
    first: bool
    last: bool
    ins: list[Tensor | None] = field(default_factory=list)
    """Each block's input (None once its backward is done)."""
    outs: list[Tensor | None] = field(default_factory=list)
    """Each block's output (None: recomputed in the backward)."""
    rng: list[tuple | None] = field(default_factory=list)
    bufs: list[BufferSnapshot | None] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    """Bytes of each kept block input (0 for token ids)."""
    held: dict[int, int] = field(default_factory=dict)
    """Block kept on the device (Placement.kept_blocks) → bytes of its saved activations."""
    carry: Tensor | None = None
    """The forward's running activation between two blocks (the next block's input; then the loss)."""
    done_from: int | None = None
    """The last block whose backward is done (its input holds only the gradient the block before reads)."""
    away: dict[int, tuple[Tensor, Tensor | None]] = field(default_factory=dict)
    """Block → its input (and that input's gradient) moved to host memory while the engine is vacated."""
    carry_away: bool = False
    """``carry`` is in host memory while the engine is vacated."""

    def send_away(self) -> int:
        """Move to host memory the device tensors only this record holds — a recomputed block's input (its
        forward kept no graph), a block's input after its backward (it holds the gradient the block before
        reads), the carry out of a recomputed block — so that a waiting job leaves its device; the bytes of
        block inputs moved (as counted in ``kept``)."""
        # copies even where the device is the CPU: its device tier is budgeted memory of its own, and the one path
        # runs on every machine
        cpu = torch.device("cpu")
        moved = 0
        for k, t in enumerate(self.ins):
            if t is None or not (self.bufs[k] is not None or self._done(k)):
                continue
            self.away[k] = (t.detach().to(cpu, copy=True),
                            None if t.grad is None else t.grad.to(cpu, copy=True))
            self.ins[k] = None
            moved += self.kept[k]
        if self.carry is not None and self.outs and self.outs[-1] is None and not self.carry_away:
            # (a kept block's output stays with its graph)
            self.carry, self.carry_away = self.carry.to(cpu, copy=True), True
        return moved

    def bring_back(self, device: torch.device) -> None:
        """Put what :meth:`send_away` moved back on ``device``."""
        for k, (t, g) in self.away.items():
            back = t.to(device).requires_grad_(t.is_floating_point())
            if g is not None:
                back.grad = g.to(device)
            self.ins[k] = back
        self.away.clear()
        if self.carry_away:
            assert self.carry is not None
            self.carry, self.carry_away = self.carry.to(device), False

    def away_bytes(self) -> int:
        """Bytes of block inputs :meth:`send_away` moved (the engine's live activations still count them)."""
        return sum(self.kept[k] for k in self.away)

    def _done(self, k: int) -> bool:
        return self.done_from is not None and k >= self.done_from
