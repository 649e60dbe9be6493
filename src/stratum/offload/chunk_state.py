"""A chunk's run-time state (``ChunkState``) and the AdamW work items it hands to ``cpu_adam.adamw_chunks``.

The layout (which parameters, at which offsets) is ``chunks.ChunkSpec``; this is where the chunk is now — its
device slot, home copies, moments, per-parameter step counts — and what moves of it are in flight. The engine
(engine.py) decides the moves; the items built here are views, made once per placement, so that a step's update
costs no fresh tensor views.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import Tensor

from stratum.offload.chunks import ChunkSpec


@dataclass(eq=False)
class ChunkState:
    """One chunk at run time: where its parameters, gradients and AdamW state are, and its moves in flight."""

    spec: ChunkSpec
    pinned: bool
    home: str
    """Tier of the authoritative parameter copy while the chunk is not on the device (device = pinned there)."""
    slot: Tensor | None = None
    """Device buffer of 2 × capacity: parameters then gradients."""
    slot_id: int | None = None
    fut: Future | None = None
    hp: Tensor | None = None
    """Host parameters (home = host, or the fp32 master of a pinned chunk with a host/disk optimizer on a GPU; on
    a CPU the slot is host memory already and a pinned chunk is updated in place)."""
    hp16: Tensor | None = None
    """Under mixed-precision placement on a GPU (or with the delayed update, delayed.py): a pinned 16-bit copy of
    the fp32 master ``hp``, cast on the host after each update, which fetches (and a pinned chunk's refresh) read:
    16 bits cross the link."""
    hg: Tensor | None = None
    grad: str | None = None
    """Where this step's gradient is: None (none yet), 'dev' (slot), 'home' (host tensor / disk file)."""
    dirty: bool = False
    """The device copy is newer than the home copy (updated on the device)."""
    m: Tensor | None = None
    v: Tensor | None = None
    steps: Tensor | None = None
    """AdamW's step count of each entry (parameter), as torch.optim.AdamW keeps one per parameter: a parameter
    without a gradient is skipped and its count stays behind."""
    uniform: bool = True
    """Every entry has been updated at every update so far (the counts are equal): the chunk updates as one
    range with ``steps[0]``; otherwise parameter by parameter."""
    live: list | None = None
    """Per entry, whether it got a gradient this step (set when the chunk's gradient completes)."""
    views: dict = field(default_factory=dict)
    """(parameters', moments' storage) → per entry (its parameters, exp_avg, exp_avg_sq, step count, weight-decayed
    elements): the views ``param_items`` hands to AdamW every step, made once (fresh views cost ~1 µs each)."""
    opt_fut: Future | None = None
    stale_home: bool = False
    """Gradients handed to the host/disk optimizer whose update is not submitted yet: the home copy is about to
    change, so the chunk must not be (pre)fetched until then."""
    pending: tuple | None = None
    """(clip coefficient, learning rate, gradient write in flight or None) of a clipped update waiting for the
    chunk's next fetch: a disk-home chunk's update runs in the fetch that brings it back for the forward, so its
    parameters are read from disk once for both (see ``Updates._update_at_fetch``)."""
    last_use: int = 0
    held: list | None = None
    """Gradients handed to the host optimizer (the engine's ``_home_grads`` chunks): autograd's tensors, None for
    a parameter without one, from the chunk's gradient completing until its update is queued."""

    @property
    def i(self) -> int:
        return self.spec.index

    @property
    def cap(self) -> int:
        return self.spec.capacity

    def p(self) -> Tensor:
        assert self.slot is not None, f"chunk {self.i} is not on the device"
        return self.slot[: self.cap]

    def g(self) -> Tensor:
        assert self.slot is not None, f"chunk {self.i} is not on the device"
        return self.slot[self.cap:]

    def home_copy(self, what: str) -> Tensor:
        """The host copy of the parameters (``what`` = 'p') or the gradients ('g'), where the chunk has one."""
        t = self.hp if what == "p" else self.hg
        assert t is not None, f"chunk {self.i} has no host copy of {what!r}"
        return t

    def step_counts(self) -> Tensor:
        """``steps``, set when the chunk's moments are (the engine's ``_alloc_moments``)."""
        assert self.steps is not None, f"chunk {self.i} has no step counts"
        return self.steps

    def moments(self) -> tuple[Tensor, Tensor]:
        """``m`` and ``v`` where they are tensors (a device or host optimizer: not on disk, not another replica's)."""
        assert self.m is not None and self.v is not None, f"chunk {self.i} has no moments here"
        return self.m, self.v

    def live_entries(self) -> list:
        """``live``, set when the chunk's gradient completes."""
        assert self.live is not None, f"chunk {self.i}: its gradient is not complete"
        return self.live

    def param_items(self, p: Tensor, grads: list, m: Tensor, v: Tensor, lo: int = 0,
                    hi: int | None = None) -> list[tuple]:
        """adamw_chunks items (:func:`count_steps` first), one per parameter of the chunk with a
        gradient (``grads[k]``: entry k's, any shape, or None), each with its own step count: its range of ``p``
        (the chunk's parameters) and of the moments ``m``/``v``, which hold the chunk's elements ``[lo, hi)`` (a
        piece of a disk chunk's moments; by default all of them)."""
        hi = self.cap if hi is None else hi
        if lo == 0 and hi == self.cap:
            key = (p.data_ptr(), m.data_ptr())
            views = self.views.get(key)
            if views is None:
                if len(self.views) > 16:  # the chunk has moved through many slots: start over
                    self.views.clear()
                views = self.views[key] = [
                    (p[e.offset:e.offset + e.numel], m[e.offset:e.offset + e.numel], v[e.offset:e.offset + e.numel],
                     self.step_counts()[k], e.numel if e.offset < self.spec.n_decay else 0, e.numel)
                    for k, e in enumerate(self.spec.entries)]
            return [(pv, g.reshape(-1), mv, vv, st, nd, n) for (pv, mv, vv, st, nd, n), g in zip(views, grads)
                    if g is not None]
        out = []
        for k, (e, g) in enumerate(zip(self.spec.entries, grads)):
            a, b = max(e.offset, lo), min(e.offset + e.numel, hi)
            if g is None or a >= b:
                continue
            n = b - a
            out.append((p[a:b], g.reshape(-1)[a - e.offset:b - e.offset], m[a - lo:b - lo], v[a - lo:b - lo],
                        self.step_counts()[k], n if e.offset < self.spec.n_decay else 0, n))
        return out

    def flat_items(self, p: Tensor, g: Tensor, m: Tensor, v: Tensor, lo: int = 0,
                   hi: int | None = None) -> list[tuple]:
        """adamw_chunks items (:func:`count_steps` first) of a chunk whose gradients are one
        flat range ``g`` (a slot's or home copy, like ``p``): the whole range as one item where every parameter has
        a gradient (at every step so far), else parameter by parameter (``param_items``); ``m`` and ``v`` hold
        elements ``[lo, hi)``."""
        hi = self.cap if hi is None else hi
        if self.uniform and all(self.live_entries()):
            nd, used = min(max(self.spec.n_decay - lo, 0), hi - lo), min(self.spec.used - lo, hi - lo)
            return [(p[lo:hi], g[lo:hi], m, v, self.step_counts()[0], nd, used)]
        grads = [g[e.offset:e.offset + e.numel] if ok else None
                 for e, ok in zip(self.spec.entries, self.live_entries())]
        return self.param_items(p, grads, m, v, lo, hi)


def count_steps(chunks: list[ChunkState]) -> None:
    """Advance the step count of the entries of ``chunks`` that got a gradient (``live``), before their update's
    items are made; a chunk where one did not stops updating as one range (``uniform``). The chunks that update
    as one range advance in one ``_foreach_add_`` (as torch's AdamW advances all its steps): a call per chunk
    would be a kernel launch per chunk on a GPU."""
    whole = []
    for c in chunks:
        live = c.live_entries()
        if c.uniform and all(live):
            whole.append(c.step_counts())
            continue
        c.uniform = False
        ks = [k for k, ok in enumerate(live) if ok]
        if ks:
            c.step_counts()[ks] += 1
    if whole:
        torch._foreach_add_(whole, 1)
