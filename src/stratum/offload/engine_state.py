"""What :class:`~stratum.offload.engine.OffloadEngine`'s mixins share: the engine's state, by name and type.

``Residency``, ``Updates``, ``Reductions`` and ``StateIO`` are mixins of the engine; each works on state the
engine's ``__init__`` and ``_build`` set up and calls methods another part defines. ``EngineState`` declares both
once (annotations, which hold nothing at run time) for the type checker and for a reader of one mixin, with the
two accessors they share: the disk store and the staging buffers, each where the placement has it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from stratum.model.blockseq import BlockSeq
from stratum.offload.activations import ActivationSpill
from stratum.offload.belady import NextUse
from stratum.offload.chunk_state import ChunkState
from stratum.offload.chunks import Layout
from stratum.offload.grad_handoff import ChunkHandoff
from stratum.offload.inflight import MicroBatch
from stratum.offload.placement import Placement
from stratum.offload.prefetch import Transfers
from stratum.offload.tiers import DiskStore, Tier
from stratum.offload.trace import AccessTrace
from stratum.runtime.engine import OptimSpec
from stratum.runtime.loss_scale import LossScaler


class EngineState:
    """The offload engine's state its mixins use (documented where the engine sets it up)."""

    model: BlockSeq
    spec: OptimSpec
    device: torch.device
    placement: Placement
    layout: Layout
    names: list[str]
    sharded: bool
    tiers: dict[str, Tier]
    disk: DiskStore | None
    xfer: Transfers
    xfer_staging: Tensor | None
    staging: list[Tensor | None]
    opt_pool: Executor
    trace: AccessTrace
    spill: ActivationSpill | None
    chunks: list[ChunkState]
    slots: list[Tensor]
    free_slots: list[int]
    resident: set[int]
    _slot_busy: dict[int, Future]
    _vacated: bool
    _yielding: bool
    _mb: MicroBatch | None
    _slot_shape: tuple[int, int, torch.dtype]
    n_vacates: int
    _ptr2chunk: dict[int, ChunkState]
    _nxt: NextUse | None
    _clock: int
    _act: int
    _act_seen: set[int]
    _boundary: set[int]
    _zero: Tensor
    n_fetches: int
    bytes_h2d: int
    bytes_d2h: int
    peak_act: int
    stall_s: float
    phase_s: dict[str, float]
    _all_on_device: bool
    _grads_home: bool
    _half: bool
    scaler: LossScaler | None
    _skipped: bool
    _dpu: bool
    _param_bytes: int
    _updates_inline: bool
    _home_params: set[int]
    _held: dict[int, Tensor]
    _gtarget: dict[int, Tensor]
    _fresh: set[int]
    _defer: tuple[int, ...]
    _lr: float
    _deferred: bool
    _grad_norms: dict[str, Tensor]
    _spill_futs: dict[int, Future | None]
    _opt_futs: list[Future]
    _pending_after: Future | None
    combine_norm: Callable[[list[tuple[str, Tensor]]], Tensor] | None
    handoff: ChunkHandoff | None

    def _staged(self, k: int) -> Tensor:
        """Staging buffer ``k`` (0/1: a disk chunk's parameters/gradients, 2/3: its moments), which ``_build``
        allocates where the placement streams those through the host."""
        buf = self.staging[k]
        assert buf is not None, f"offload: no staging buffer {k} under this placement"
        return buf

    @property
    def _disk(self) -> DiskStore:
        """``disk``, reached for only where the placement puts something on the disk (``Placement.uses_disk``)."""
        assert self.disk is not None, "offload: the placement uses no disk"
        return self.disk

    if TYPE_CHECKING:  # defined by the engine or by another mixin
        def owns(self, i: int) -> bool: ...
        def _ensure_occupied(self) -> None: ...
        def _alloc(self, tier: str, n: int, what: str, dtype: torch.dtype = torch.float32) -> Tensor: ...
        def _access(self, chunk_ids: tuple[int, ...], record: bool = True, grads: bool = False) -> None: ...
        def _bind(self, c: ChunkState) -> None: ...
        def _evict(self, c: ChunkState) -> int: ...
        def _write_home(self, c: ChunkState, what: str, src: Tensor) -> None: ...
        def _home_grads(self, c: ChunkState) -> bool: ...
        def _run_pending(self, c: ChunkState, pending: tuple, into: Tensor) -> None: ...
        def _flush_pending(self) -> None: ...
        def drain(self) -> None: ...
        def _complete_grads(self, c: ChunkState) -> list[tuple[str, Tensor]]: ...
        def _grad_reduced(self, c: ChunkState) -> None: ...
        def _settle(self, c: ChunkState) -> None: ...
        def _reducing(self, i: int) -> bool: ...
        def owned(self) -> list[ChunkState]: ...
        def _publish(self, c: ChunkState, master: Tensor | None = None) -> None: ...
        def _held_bytes(self, held: list) -> int: ...
        def _host_update_held(self, c: ChunkState, held: list, coef: Tensor | None, lr: float,
                              src: Tensor | None) -> Tensor: ...
        def _wait_delayed(self, c: ChunkState | None = None) -> None: ...
        def _delay(self, coef: Tensor | None) -> None: ...
        def _flush_delayed(self) -> None: ...
        def _drop_delayed(self) -> None: ...
        def _publish_delayed(self) -> None: ...
