"""One micro-batch of the offload engine's step, from its forward to its backward: what each block left for its
backward (its input, its output where kept, its RNG state and buffers where recomputed), and the moves of every
device tensor it holds — those records and what the blocks' autograd graphs saved — to host memory and back while
the engine is vacated (a multi-job scheduler's waits: :meth:`stratum.offload.vacate.Vacate.vacate`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from stratum.model.neutral import BufferSnapshot


def move_storages(tensors: list[Tensor], to: torch.device) -> dict[int, Tensor]:
    """Point each tensor at a copy on ``to`` of the storage it views, one copy per storage, so that views of one
    storage stay views of one copy and the old storage is freed once nothing else holds it. ``.data`` is swapped,
    so each tensor keeps its identity in autograd (a leaf's gradient still accumulates into it). The copies, by
    the data pointer of the storage each replaces."""
    copies: dict[int, Tensor] = {}
    for t in {id(t): t for t in tensors}.values():
        src = t.untyped_storage()
        ptr = src.data_ptr()
        if ptr not in copies:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(src)
            copies[ptr] = whole.to(to, copy=True)
        view = torch.empty(0, dtype=t.dtype, device=to)
        t.data = view.set_(copies[ptr].untyped_storage(), t.storage_offset(), t.shape, t.stride())
    return copies


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
    """Each block's input (None once the block before has read its gradient)."""
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
    saved: list[weakref.ref[Tensor]] = field(default_factory=list)
    """Aliases of the device tensors the blocks' autograd graphs saved while a gate was set (:meth:`track`); an
    alias dies with the graph that holds it."""
    away: bool = False
    """Its device tensors are in host memory (:meth:`send_away`)."""
    away_bytes: int = 0
    """Bytes :meth:`send_away` moved (0 when not away)."""

    def track(self, x: Tensor) -> Tensor:
        """An alias of ``x`` for an autograd graph to save in its place, which :meth:`send_away` can move: a
        graph's saved tensors are out of reach, an alias it holds is not."""
        alias = x.detach()
        self.saved.append(weakref.ref(alias))
        return alias

    def send_away(self) -> dict[int, int]:
        """Move to host memory every device tensor this micro-batch holds — block inputs (and the gradients the
        blocks before read from them), kept outputs, the carry, the targets, recomputed blocks' buffer values, and
        what the blocks' graphs saved through :meth:`track` — so that a waiting job leaves its device. The
        storages renamed: old data pointer → new (the engine keys storages by pointer)."""
        # copies even where the device is the CPU: its device tier is budgeted memory of its own, and the one path
        # runs on every machine
        renamed, self.away_bytes = self._move(torch.device("cpu"))
        self.away = True
        return renamed

    def bring_back(self, device: torch.device) -> dict[int, int]:
        """Put what :meth:`send_away` moved back on ``device``; the storages renamed, as there."""
        renamed, _ = self._move(device)
        self.away, self.away_bytes = False, 0
        return renamed

    def _move(self, to: torch.device) -> tuple[dict[int, int], int]:
        """Every device tensor this record holds onto ``to`` (:func:`move_storages`): the storages renamed (old
        data pointer → new) and the bytes copied."""
        self.saved = [r for r in self.saved if r() is not None]
        snapshots = (value for b in self.bufs if b is not None for *_, value in b.saved)
        held = [t for t in (*(r() for r in self.saved), *self.ins, *self.outs, self.carry, self.y, *snapshots)
                if t is not None]
        owners = [t for t in self.ins if t is not None and t.grad is not None]
        grads = [t.grad for t in owners]
        for t in owners:
            t.grad = None  # (a gradient must sit on its tensor's device: both move, then it goes back on)
        copies = move_storages(held + [g for g in grads if g is not None], to)
        for t, g in zip(owners, grads):
            t.grad = g
        return {p: c.untyped_storage().data_ptr() for p, c in copies.items()}, sum(c.numel() for c in copies.values())
