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
``clip_grad_norm_`` + ``torch.optim.AdamW(fused=True)``. Under fp16 (loss scaling, on 16-bit chunks) every update
waits likewise: the global norm of the scaled gradients is the overflow check that decides whether any runs
(``Updates._scaled_update``, runtime/loss_scale.py).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import torch
from torch import Tensor

from stratum.data.tokens import Batch
from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq
from stratum.model.neutral import BufferSnapshot, evaluating, neutral
from stratum.model.streams import block_stream
from stratum.offload.act_ring import ActivationRing
from stratum.offload.activations import ActivationSpill
from stratum.offload.belady import NextUse
from stratum.offload.chunk_state import ChunkState
from stratum.offload.chunks import ChunkSpec, Layout, pack
from stratum.offload.delayed import DelayedUpdates
from stratum.offload.grad_handoff import ChunkHandoff
from stratum.offload.host_alloc import HeapTrim, tune_allocator
from stratum.offload.inflight import MicroBatch
from stratum.offload.placement import KEEP, SPILL, Placement
from stratum.offload.prefetch import Inline, Transfers, background_pool
from stratum.offload.reductions import ChunkReducer, Reductions
from stratum.offload.residency import Residency
from stratum.offload.state_io import StateIO
from stratum.offload.step_model import grads_to_host, runs_inline
from stratum.offload.tasks import block_done, gate_set
from stratum.offload.tiers import DEVICE, DISK, F32, HALF, HOST, DiskStore, Tier, aligned_empty, resolve_disk_dir
from stratum.offload.trace import AccessTrace
from stratum.offload.updates import Updates
from stratum.offload.vacate import Vacate
from stratum.runtime.device import HALF_DTYPES, autocast, canonical, peak_memory_bytes
from stratum.runtime.engine import Engine, OptimSpec, StepResult
from stratum.runtime.loss_scale import LossScaler, LossScaleSpec

_LIVE: weakref.WeakSet[OffloadEngine] = weakref.WeakSet()
"""This process's open engines. The CUDA allocator counts the whole process, so its total is one engine's only
where that engine is alone on its device (a sharded-lrtf worker runs several jobs' engines on one GPU)."""


def _alone_on_device(engine: OffloadEngine) -> bool:
    return not any(e is not engine and e.device == engine.device for e in list(_LIVE))


def _as_is(t: Tensor) -> Tensor:
    """Saved-tensor hook that keeps a tensor as it is, uncounted."""
    return t


def discard(_t: Tensor) -> None:
    """Saved-tensor hook of a forward whose graph is thrown away (a block recomputed in its backward): keep
    nothing."""
    return None


def discarded(_obj) -> Tensor:
    raise RuntimeError("offload: a discarded forward's saved tensor was used")


def _materializer(model: BlockSeq, materialize):
    """How the engine initialises a lazily built (meta) model's blocks; refused where it has no way to."""
    if materialize is None and model.block_init is not None:
        materialize = model.materialize
    if any(p.is_meta for p in model.parameters()) and materialize is None:
        raise StratumError("the offload engine got a model on the meta device but no way to initialise its "
                           "blocks (build it with build_model(..., lazy=True))")
    if any(b.is_meta for b in model.buffers()):
        raise StratumError("the offload engine cannot materialise a meta model with buffers")
    return materialize


class OffloadEngine(Residency, Vacate, Updates, DelayedUpdates, Reductions, StateIO, Engine):
    name = "offload"

    def __init__(self, model: BlockSeq, *, optim: OptimSpec, device: torch.device, placement: Placement,
                 precision: str = "fp32", disk_dir: str = "", check_every_step: bool = True,
                 materialize=None, owns: Callable[[int], bool] | None = None, delayed_update: bool = False,
                 loss_scale: LossScaleSpec | None = None):
        self.model = model
        self.sharded = owns is not None
        """Another engine (a replica) updates some chunks: this one holds their parameters, not their AdamW
        state (:meth:`owns`)."""
        self._owns = owns
        self.spec = optim
        device = canonical(device)  # saved tensors are matched against it (a spilled activation's device)
        self.device = device
        self.precision = precision
        self.placement = placement
        self._init_precision(delayed_update, loss_scale)
        self.check_every_step = check_every_step
        self._cuda_base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        _LIVE.add(self)
        tune_allocator()
        self._heap_trim = HeapTrim()
        self._materialize = _materializer(model, materialize)
        self._materialized: set[int] = set()
        for b in model.buffers():
            b.data = b.data.to(device)
        self.layout: Layout = pack(model, placement.chunk_elems)
        self.names = [n for n, _ in model.named_parameters()]
        self.tiers = {DEVICE: Tier(DEVICE, placement.device_budget), HOST: Tier(HOST, placement.host_budget),
                      DISK: Tier(DISK, None)}
        self.disk: DiskStore | None = None
        if placement.uses_disk:
            self.disk = DiskStore(resolve_disk_dir(disk_dir), self.tiers[DISK])
        gpu = device.type == "cuda"
        self.xfer = Transfers(device, inline=runs_inline(gpu, placement.param_tier))
        self._updates_inline = runs_inline(gpu, placement.optimizer_tier, placement.param_tier)
        self.opt_pool = Inline() if self._updates_inline else background_pool(device, "stratum-cpu-adam")
        self.trace = AccessTrace()
        self._nxt: NextUse | None = None
        self._clock = 0
        self._act = 0
        self._mb: MicroBatch | None = None
        """The micro-batch between its forward and backward (what a vacate may move off the device)."""
        self._yielding = False
        """A scheduler's gate may vacate this step (tasks.gate_set): saved tensors refer to pinned chunks by
        reference too, so that a vacate can move them."""
        self._act_seen: set[int] = set()
        self._ptr2chunk: dict[int, ChunkState] = {}
        self.spill = None
        if placement.activations == SPILL and not placement.inflight:  # a pipeline rank spills in its runner
            ring = (ActivationRing(self._disk, self.tiers[HOST], pin=device.type == "cuda")
                    if placement.disk_spill_blocks else None)
            self.spill = ActivationSpill(device, self.tiers[HOST], ring, frozenset(placement.disk_spill_blocks))
        self._boundary: set[int] = set()
        """Storages of the kept block inputs: a saved tensor in one of them is kept by reference, never spilled."""
        self._init_counters()
        self._gtarget: dict[int, Tensor] = {}
        """id(parameter) → where its next gradient contribution goes (a view of its chunk's slot)."""
        self._fresh: set[int] = set()
        """id(parameter) whose target already holds a contribution this step (see _take_grad)."""
        self._pending_after = None
        """The last host update queued before the updates left to the next fetches (ChunkState.pending)."""
        self.combine_norm: Callable[[list[tuple[str, Tensor]]], Tensor] | None = None
        """A sharded parent's global gradient norm from this engine's per-parameter norms (of the chunks it owns,
        in the plain engine's order); None: this engine's norm is the norm."""
        self.reducer: ChunkReducer | None = None
        """A parent's reduction of one chunk's gradients (names, gradients, what for messages → the reduction in
        flight, which leaves the result in those gradients when finished): over the replicas, or of a tensor tied
        to another pipeline rank. It is launched as the chunk's gradient completes and settled — before the
        chunk's norm and update — while later blocks' backward runs (reductions.py); None alone."""
        self._in_flight = []
        self.reduce_log = []
        self._build()
        self._home_params = {id(e.param) for c in self.chunks if self._home_grads(c) for e in c.spec.entries}
        self.handoff = (ChunkHandoff(self.layout, self.chunks, self._half_dtype, self._alloc, self.xfer, self.opt_pool)
                        if self._chunk_grads else None)
        """The per-chunk hand-off of 16-bit gradients (grad_handoff.py, Placement.chunk_grads); None: each
        gradient goes to the host as autograd makes it (``_take_grad``)."""
        take = self._take_grad if self.handoff is None else self.handoff.take
        self._grad_hooks = [] if self._all_on_device else [
            e.param.register_post_accumulate_grad_hook(take) for c in self.chunks for e in c.spec.entries]

    # ---- set-up ---------------------------------------------------------------------------------------------
    def _init_precision(self, delayed_update: bool, loss_scale: LossScaleSpec | None) -> None:
        """The chunks' parameter precision the placement planned, checked against the run's; fp16's loss scaler,
        which needs 16-bit chunks and no sharded replicas; and the delayed update, which only a bf16 placement
        without sharded replicas can run."""
        if self.placement.half_params and self.precision not in HALF_DTYPES:
            raise StratumError(f"the offload placement holds 16-bit chunks (planned for train.precision = bf16 or "
                               f"fp16) but this run's precision is {self.precision!r}; plan it with the run's "
                               "precision")
        fp16 = self.precision == "fp16"
        if fp16 and (not self.placement.half_params or self.sharded):
            raise StratumError("train.precision = 'fp16' on the offload engine needs 16-bit chunks with the fp32 "
                               "masters and AdamW off the device (a placement planned for fp16, "
                               "offload.optimizer_tier = 'host' or 'disk') and no sharded replicas; use bf16 or fp32 "
                               "otherwise")
        self.scaler = LossScaler(loss_scale or LossScaleSpec(), self.device) if fp16 else None
        """fp16: the dynamic loss scale (runtime/loss_scale.py); every update then waits for the end of the
        backward, where one inf/NaN check over all chunks decides whether any runs (``_scaled_update``)."""
        self._skipped = False
        """The last step's gradients overflowed: nothing was updated."""
        self._half = self.placement.half_params
        """Mixed-precision placement (Placement.half_params): the device's chunks are 16-bit working copies, the
        fp32 masters (``hp``, or files on disk beside a 16-bit host copy ``hp16``) and the moments live on the
        host or the disk, every gradient goes to the host in 16 bits — as autograd makes it (``_take_grad``) or a
        chunk at a time (``handoff``) — and is accumulated there in fp32, and each update's new masters go back up
        in 16 bits (``Updates._publish``)."""
        self._half_dtype = HALF_DTYPES.get(self.precision, torch.bfloat16)
        """The dtype of the device's 16-bit working copies (``_half``): the run's autocast dtype."""
        self._param_bytes = HALF if self._half else F32
        """Bytes per element of a chunk's parameters on the device (and of a fetch)."""
        self._chunk_grads = self._half and self.placement.chunk_grads
        """16-bit gradients go to the host a chunk at a time (``handoff``), each chunk's fp32 accumulator ``hg``."""
        in_ram = self.placement.optimizer_tier == HOST and self.placement.param_tier != DISK
        if delayed_update and (not self._half or not in_ram or self.sharded or fp16):
            raise StratumError("offload.delayed_update needs bf16 chunks with the fp32 masters and optimizer state "
                               "in host RAM (train.precision = 'bf16', offload.optimizer_tier = 'host', parameters "
                               "not on disk) and no sharded replicas; set offload.delayed_update = false")
        self._init_delayed(delayed_update)

    def _init_counters(self) -> None:
        """What the engine counts over its steps: fetches, bytes per link, waits, seconds per phase."""
        self.n_fetches = 0
        self.bytes_h2d = 0
        """Bytes of chunks copied to the device so far (parameters; gradients where they come back; a pipeline
        rank's spilled checkpoints fetched back, stage_blocks.py)."""
        self.bytes_d2h = 0
        """Bytes of chunks and gradients written from the device (or a CPU slot) to their home so far (and a
        pipeline rank's spilled checkpoints)."""
        self.last_step_traffic: dict[str, int] = {}
        """Link → bytes the last step moved (:meth:`traffic` before and after it)."""
        self.last_step_wait_s = 0.0
        self.n_vacates = 0
        """Times :meth:`vacate` gave the slots back (a multi-job scheduler's waits)."""
        self.peak_act = 0
        self.stall_s = 0.0
        """Seconds the training thread waited for chunks (fetches and the updates before them), all steps."""
        self.phase_s = {"forward": 0.0, "backward": 0.0, "recompute": 0.0, "update": 0.0, "update_pass": 0.0}
        """Seconds of the training thread per phase, all steps (forward and backward include their waits for
        chunks; backward includes recompute, also counted alone; update = the device-side updates or queueing
        the host/disk ones; update_pass = from queueing the clipped host/disk updates to the end of the last,
        beside the next step's forward; updates run by the next forward's fetches count in its forward)."""

    def _alloc(self, tier: str, n: int, what: str, dtype: torch.dtype = torch.float32) -> Tensor:
        self.tiers[tier].charge(n * dtype.itemsize, what)
        if tier == DEVICE and self.device.type != "cpu":
            return torch.zeros(n, dtype=dtype, device=self.device)
        # CPU memory is aligned for the disk store's direct I/O
        return aligned_empty(n, dtype=dtype, pin=tier == HOST and self.device.type == "cuda").zero_()

    def _build_chunk(self, spec: ChunkSpec, *, pinned: bool) -> ChunkState:
        """One chunk's state: its parameters copied to their home (the device slot of a pinned chunk, host memory
        or disk), gradient room beside them, its AdamW moments; a streamed chunk's parameters then placeholders."""
        placement = self.placement
        home = DEVICE if pinned else placement.param_tier
        c = ChunkState(spec=spec, pinned=pinned, home=home)
        def fill(flat: Tensor) -> Tensor:
            self._ensure_materialized(spec)
            with torch.no_grad():
                for e in spec.entries:
                    flat[e.offset:e.offset + e.numel].copy_(e.param.detach().reshape(-1))
            return flat
        if pinned and self._half:  # a 16-bit working copy of the fp32 master, filled from it
            c.slot = self._alloc(DEVICE, spec.capacity, f"pinned chunk {spec.index}", self._half_dtype)
            c.hp = fill(self._alloc(HOST, spec.capacity, "master params"))
            c.p().copy_(c.hp)
            self._bind(c)
        elif pinned:
            if self._all_on_device:  # parameters only; the gradients autograd makes are charged as such
                c.slot = self._alloc(DEVICE, spec.capacity, f"pinned chunk {spec.index}")
                self.tiers[DEVICE].charge(spec.capacity * F32, f"gradients of chunk {spec.index}")
            else:
                c.slot = self._alloc(DEVICE, 2 * spec.capacity, f"pinned chunk {spec.index}")
            fill(c.p())
            if placement.optimizer_tier != DEVICE and self.device.type != "cpu":
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
            self._disk.create(f"p{spec.index}", flat)
            if self._half:  # the disk holds the fp32 master only: fetches read its 16-bit copy in host RAM
                c.hp16 = self._alloc(HOST, spec.capacity, "16-bit copy of the masters", self._half_dtype)
                c.hp16.copy_(flat)
            else:
                flat.zero_()
                self._disk.create(f"g{spec.index}", flat)
            del flat
        if not pinned:
            for e in spec.entries:
                e.param.data = self._placeholder(e.shape)
                e.param.grad = None
        if self._chunk_grads:  # the fp32 accumulator the per-chunk hand-off adds each micro-batch's gradient to
            c.hg = self._alloc(HOST, spec.capacity, "gradient accumulator")
        if self._half and c.hp16 is None and (self.device.type == "cuda" or self._dpu):  # (delayed: published)
            c.hp16 = self._alloc(HOST, spec.capacity, "16-bit copy of the masters", self._half_dtype)
            c.hp16.copy_(c.home_copy("p"))
        self._alloc_moments(c)
        return c

    def _build_staging(self, n_stream: int) -> None:
        """Host buffers a disk home streams through: parameters and gradients, moments, GPU transfers."""
        placement = self.placement
        self.staging: list[Tensor | None] = [None] * 4
        if placement.param_tier == DISK and placement.optimizer_tier != DEVICE and n_stream and (
                self._half or self.device.type != "cpu" or self.spec.grad_clip > 0 or placement.deferred_chunks):
            self.staging[0] = self._alloc(HOST, self.layout.chunk_elems, "staging: params")
            if not self._half:  # (16-bit chunks: the update's gradients are held on the host, never on disk)
                self.staging[1] = self._alloc(HOST, self.layout.chunk_elems, "staging: grads")
        if placement.optimizer_tier == DISK:  # moments stream through in pieces of at most one chunk
            self.staging[2] = self._alloc(HOST, self.layout.chunk_elems, "staging: exp_avg")
            self.staging[3] = self._alloc(HOST, self.layout.chunk_elems, "staging: exp_avg_sq")
        # GPU ↔ disk copies pass through one pinned buffer; the transfer thread runs them one at a time (16-bit
        # chunks are fetched from their host copies)
        self.xfer_staging = (self._alloc(HOST, self.layout.chunk_elems, "staging: GPU transfers")
                             if placement.param_tier == DISK and n_stream and self.device.type == "cuda"
                             and not self._half else None)

    def _build(self) -> None:
        placement = self.placement
        n_stream = len(self.layout.streamable)
        all_resident = placement.param_tier == DEVICE
        self._all_on_device = all_resident and placement.optimizer_tier == DEVICE
        """Every chunk and its moments stay on the device: gradients are autograd's own tensors, as in the plain
        engine (no slot half to zero and accumulate into, no copies), and one fused AdamW call per weight-decay
        class updates everything after the backward (a launch per chunk cost a GPU more than the work)."""
        self._grads_home = grads_to_host(placement.optimizer_tier, placement.param_tier, self.device.type == "cuda",
                                         self._half)
        """On a CPU with parameters and moments in host RAM, a streamed chunk's gradients are handed to the host
        optimizer as the tensors autograd made (charged to the host tier while held), as the plain engine's
        optimizer gets them: its slot holds parameters only (twice the slots in a budget), and no gradient is
        copied into a slot, home, or back between micro-batches. Under mixed-precision placement every chunk's
        gradients go to the host (``_half``)."""
        self._held: dict[int, Tensor] = {}
        """id(parameter) → its gradient of this step so far (``_grads_home`` chunks)."""
        built: dict[int, ChunkState] = {}
        # Streamed chunks first: each frees its parameters' original storage as it goes, so the always-resident
        # (tied) chunk is built when little of the original model is left: peak RAM ≈ the model once.
        for spec in sorted(self.layout.chunks, key=lambda sp: sp.pinned or all_resident):
            built[spec.index] = self._build_chunk(spec, pinned=spec.pinned or all_resident)
        self.chunks: list[ChunkState] = [built[i] for i in range(len(self.layout.chunks))]
        self._build_staging(n_stream)
        R = 0 if all_resident else min(placement.resident_chunks, n_stream)
        cap = self.layout.chunk_elems
        slot_dtype = self._half_dtype if self._half else torch.float32
        self.slots = [self._alloc(DEVICE, (1 if self._grads_home else 2) * cap, f"slot {s}", slot_dtype)
                      for s in range(R)]
        self.free_slots = list(range(R))[::-1]
        self._vacated = False
        """The slots are given back (:meth:`vacate`); the next access allocates them again."""
        self.resident: set[int] = set()
        self._slot_busy: dict[int, Future] = {}
        """Slot → the in-place update still reading/writing it: the next fetch into the slot waits for it."""
        self._defer = tuple(placement.deferred_chunks) if placement.optimizer_tier != DEVICE else ()
        """Chunks whose update the placement defers to beside the next forward (without clipping; with it, all are),
        ascending = the order the forward uses them (chunks are numbered in first-use order)."""
        # Canonical name → (chunk, entry) for state() / load_state() and the gradient norm order.
        self.where = {e.name: (c, e) for c in self.chunks for e in c.spec.entries}

    def _alloc_moments(self, c: ChunkState) -> None:
        """``c``'s AdamW moments (zeros) on the optimizer's tier — none where another replica updates it — and
        its per-parameter step counts."""
        spec, ot = c.spec, self.placement.optimizer_tier
        if not self.owns(spec.index):  # its AdamW state lives with the replica that updates it
            pass
        elif ot == DISK:
            zeros = aligned_empty(spec.capacity).zero_()
            self._disk.create(f"m{spec.index}", zeros)
            self._disk.create(f"v{spec.index}", zeros)
            del zeros
        else:
            c.m = self._alloc(ot, spec.capacity, "exp_avg")
            c.v = self._alloc(ot, spec.capacity, "exp_avg_sq")
        c.steps = torch.zeros(len(spec.entries), dtype=torch.float32, device=self.device if ot == DEVICE else "cpu")

    def owns(self, i: int) -> bool:
        """This engine updates chunk ``i`` (holds its AdamW state); every chunk unless sharded."""
        return self._owns is None or self._owns(i)

    def _ensure_materialized(self, spec: ChunkSpec) -> None:
        """Give the blocks owning ``spec``'s parameters real storage and their values, once each: a model larger
        than RAM is built one block at a time, each block's memory released as its chunks are packed. By owner,
        not by what is still on meta: a tied parameter gets storage from whichever of its blocks is allocated
        first (the head, whose chunk may be packed before the embedding's), its values from its owner only."""
        if self._materialize is None:
            return
        for e in spec.entries:
            i = int(e.name.split(".")[1])  # (an entry is named by its owner: BlockSeq.owned_parameters)
            if i in self._materialized:
                continue
            self._materialized.add(i)
            self.model.allocate(i)
            with neutral(devices=[self.device]):  # an initialiser that draws must not move the run's streams
                self._materialize(i)

    # ---- training -------------------------------------------------------------------------------------------
    def _block_chunks(self, i: int) -> tuple[int, ...]:
        return tuple(self.layout.block_chunks[i])

    def _forward_block(self, i: int, x: Tensor, y: Tensor, last: bool, n: int, stream: int | None = None):
        block = self.model.blocks[i]
        with autocast(self.device, self.precision), block_stream(stream, i, self.device):
            out = block(x)
            if last:
                out = self.model.loss_fn(out, y)
        return out

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult:
        scale = float(self.scaler.scale) if self.scaler is not None else None
        loss_sum, norm = self.train_share(micro_batches, lr, len(micro_batches))
        return StepResult(loss=loss_sum.item() / len(micro_batches), grad_norm=float(norm), loss_scale=scale,
                          skipped=self._skipped)

    def train_share(self, micro_batches: list[Batch], lr: float, divisor: int) -> tuple[Tensor, Tensor]:
        """One optimizer step over this engine's part of the step's micro-batches, each loss divided by
        ``divisor`` (the step's micro-batch count over all replicas) before its backward; each chunk's gradient
        goes through :attr:`reducer` as it completes, beside the backward of the blocks after it and before its
        norm and update. The sum of the losses and the global gradient norm (0-d tensors)."""
        self.begin_step(lr)
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for j, b in enumerate(micro_batches):
            mb = MicroBatch(y=self._on_device(b.y), stream=b.stream, n=n, first=j == 0, last=j == n - 1)
            self._mb = mb
            self._act, self._act_seen = 0, set()
            self._boundary = set()
            if self.spill is not None:
                self.spill.begin_microbatch()
            t_fwd = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                loss = self._forward_pass(mb, self._on_device(b.x))
                total += loss.detach().float()
                t_bwd = time.perf_counter()
                self.phase_s["forward"] += t_bwd - t_fwd
                self._backward_pass(mb, divisor)
            self.phase_s["backward"] += time.perf_counter() - t_bwd
            self._act, self._act_seen = 0, set()
            self._mb = None
            del mb
        total_norm = self._update_after_backward()
        self.end_step()
        return total, total_norm

    def _on_device(self, t: Tensor) -> Tensor:
        """A micro-batch's tensor on the device in a storage of its own. Where the device is the host the step's
        micro-batches are views of one batch tensor, and a block saving a view is charged (and the plan's minimum
        budget exceeded) for the whole batch's storage, not the micro-batch the profile measured."""
        t = t.to(self.device, non_blocking=True)
        return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t

    def _forward_pass(self, mb: MicroBatch, x: Tensor) -> Tensor:
        """Every block's forward on ``x``, keeping, spilling or dropping (to recompute) what each one saves as
        the placement says; the loss. Between two blocks the running activation is ``mb.carry`` (no local holds
        it, so a vacate may move it off the device)."""
        L = len(self.model)
        thin = self.placement.activations != KEEP  # only block inputs stay on the device between forward and backward
        spilled = self.placement.spilled(L)  # the other blocks are recomputed when thin, except:
        # the last blocks, whose activations stay on the device (Placement.kept_blocks)
        on_device = self.placement.kept()
        mb.carry = x
        del x
        for i in range(L):
            self._access(self._block_chunks(i))
            self._forward_one(mb, i, thin and i not in spilled and i not in on_device, i in on_device)
            block_done("F", i, L, self)
        assert mb.carry is not None
        return mb.carry.to(self.device)  # (a vacate at the last block's end may have moved the loss away)

    def _forward_one(self, mb: MicroBatch, i: int, recompute: bool, on_device: bool) -> None:
        """Block ``i``'s forward on ``mb.carry``; its output becomes ``mb.carry``."""
        L, spill = len(self.model), self.spill
        assert mb.carry is not None
        xi = mb.carry.detach().requires_grad_(mb.carry.is_floating_point())
        mb.ins.append(xi)
        mb.kept.append(xi.untyped_storage().nbytes() if xi.is_floating_point() else 0)
        if spill is not None:
            if not recompute and not on_device:
                spill.begin_block(i)
            self._boundary.add(xi.untyped_storage().data_ptr())
            self._act_seen = set()
        # with a stream the block seeds its own generator (block_stream): the global state is not its to keep
        mb.rng.append(self._rng_state() if recompute and mb.stream is None else None)
        mb.bufs.append(BufferSnapshot([self.model.blocks[i]]) if recompute else None)
        if recompute:
            # Run as the recompute will (grad mode on, so kernels are chosen alike: under no_grad a GPU's
            # attention may pick another kernel and draw other dropout masks), keeping nothing.
            with torch.autograd.graph.saved_tensors_hooks(discard, discarded):
                out = self._forward_block(i, xi, mb.y, i == L - 1, mb.n, mb.stream).detach()
            mb.outs.append(None)
        else:
            out = self._forward_block(i, xi, mb.y, i == L - 1, mb.n, mb.stream)
            mb.outs.append(out)
        if spill is not None:  # this block's activations are still on the device here
            self._check()
            spill.end_block()
            if on_device:
                mb.held[i] = self._act - sum(mb.kept[:i]) - sum(mb.held.values())
            self._act = sum(mb.kept) + sum(mb.held.values())
        mb.carry = out

    def _backward_pass(self, mb: MicroBatch, divisor: int) -> None:
        """Every block's backward, last first (each block's output kept, restored or recomputed); on the last
        micro-batch each chunk whose gradient is complete goes on to its reduction, norm and update — the
        reductions in flight beside the next blocks, all settled before this returns."""
        L = len(self.model)
        if self.placement.activations != KEEP:  # live: the kept block inputs, plus one block's saved tensors at a time
            self._act, self._act_seen = sum(mb.kept) + sum(mb.held.values()), set()
        tied_tmp = self._tied_grads_begin() if not mb.first else []
        for i in reversed(range(L)):
            self._access(self._block_chunks(i), grads=True)
            self._backward_one(mb, i, divisor, bool(tied_tmp))
            block_done("B", i, L, self)
        self._ensure_occupied()  # (the tied chunk's gradients are summed next, the update reads them after)
        self._tied_grads_end(tied_tmp)
        if mb.last:
            for c, *_ in tied_tmp:
                self._grad_complete(c)
            self._settle_all()

    def _backward_one(self, mb: MicroBatch, i: int, divisor: int, tied_apart: bool) -> None:
        """Block ``i``'s backward (its input's gradient left on ``mb.ins[i]`` for the block before); on the last
        micro-batch its complete chunks go on to their reductions (the tied chunk's after every block, when its
        gradient is summed apart: ``tied_apart``)."""
        L = len(self.model)
        if mb.last:
            self._note_backward(i)
        for ci in self._block_chunks(i):
            c = self.chunks[ci]
            if c.grad is None:  # filled by _take_grad (a parameter without a gradient: skipped)
                c.grad = "home" if self._home_grads(c) else "dev"
        out = self._block_output(mb, i)
        if self.handoff is not None:
            self.handoff.open_block(i)
        if i == L - 1:
            part = out / divisor
            if self.scaler is not None:
                # what the product saves is the scaler's own scale, there for the whole run: not an activation
                with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
                    part = self.scaler.scaled(part)
            part.backward()
        else:
            x_next = mb.ins[i + 1]
            assert x_next is not None
            torch.autograd.backward(out, x_next.grad)
        mb.outs[i] = None
        if i + 1 < L:
            mb.ins[i + 1] = None
        if self.placement.activations != KEEP:
            self._check()
            if self.spill is not None:
                self.spill.release(i)
            mb.kept[i] = 0
            mb.held.pop(i, None)
            self._act, self._act_seen = sum(mb.kept[:i]) + sum(mb.held.values()), set()
        if self.handoff is not None:
            self._opt_futs += self.handoff.close_block(i, mb.first)
        if mb.last:
            for ci in self._block_chunks(i):
                if self.layout.ready_block[ci] == i and not (tied_apart and self.chunks[ci].spec.tied):
                    self._grad_complete(self.chunks[ci])
        self._check()

    def _block_output(self, mb: MicroBatch, i: int) -> Tensor:
        """Block i's output for its backward: kept from the forward, its spilled activations restored, or
        recomputed from its input with the first run's RNG state and buffer values."""
        spill = self.spill
        if spill is not None:
            spill.restore(i)
            if spill.cuda and i > 0 and spill.ready(i - 1):
                spill.restore(i - 1)  # the next block's copy-back runs beside this backward
            self._act = sum(mb.kept[:i + 1]) + spill.device_bytes + sum(mb.held.values())
        kept_out, x_in = mb.outs[i], mb.ins[i]
        assert x_in is not None
        if kept_out is not None:
            return kept_out
        t_re = time.perf_counter()
        state, snap = mb.rng[i], mb.bufs[i]
        assert snap is not None
        with neutral(self.model.blocks[i], devices=[self.device]):
            if state is not None:
                self._set_rng_state(state)
            snap.restore()
            out = self._forward_block(i, x_in, mb.y, i == len(self.model) - 1, mb.n, mb.stream)
        mb.bufs[i] = None
        self.phase_s["recompute"] += time.perf_counter() - t_re
        return out

    def stage_next(self) -> int:
        """Between two blocks, with no chunk in use: start fetching the next accesses' chunks (the recorded
        sequence's, as :meth:`_prefetch` does, now free to evict the chunks the last block used if OPT says so).
        A scheduler that lets another job compute before this one's next shard task calls it meanwhile; the
        number of chunk fetches started (0 before the sequence is recorded)."""
        if not self.trace.active or self.placement.prefetch_depth == 0 or self.trace.pos == 0:
            return 0
        self._ensure_occupied()
        before = self.n_fetches
        self._prefetch(self.trace.pos - 1, set())
        return self.n_fetches - before

    def begin_step(self, lr: float) -> None:
        """Before a step's first forward: gradients none yet, the access trace recording (or checking) anew."""
        self._moved0, self._wait0 = self.traffic(), self.stall_s
        self._yielding = gate_set()
        if self._dpu:
            self._start_delayed()
        self._lr = lr
        self._deferred = self.spec.grad_clip > 0 or self.scaler is not None
        self._grad_norms: dict[str, Tensor] = {}
        self._spill_futs: dict[int, Future | None] = {}
        self._opt_futs = [f for f in getattr(self, "_opt_futs", []) if not f.done()]
        for c in self.chunks:
            c.grad = None
        self._fresh.clear()
        if self.handoff is not None:
            self.handoff.begin_step()
        self._begin_reductions()
        self._first_step = self.trace.recorded is None
        self.trace.begin_step()

    def end_step(self) -> None:
        """After a step's updates are queued: the recorded access sequence becomes the eviction oracle."""
        self.trace.end_step()
        if self.device.type == "cpu":
            self._heap_trim.step_end()
        if self._first_step:
            assert self.trace.recorded is not None  # (the trace's end_step records the first step's accesses)
            self._nxt = NextUse(self.trace.recorded)
        self._check()
        self.last_step_traffic = {k: v - self._moved0[k] for k, v in self.traffic().items()}
        self.last_step_wait_s = self.stall_s - self._wait0

    def _rng_state(self) -> tuple:
        """The RNG states a block's forward draws from (dropout): the CPU's, and the GPU's on a GPU."""
        return (torch.get_rng_state(),
                torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)

    def _set_rng_state(self, state: tuple) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    def _check(self) -> None:
        # the activations held now (in the backward: kept inputs + the restore arena) count toward the peak
        self.tiers[DEVICE].note_transient(self._act)
        if not self.check_every_step:
            return
        self.tiers[DEVICE].check(self._act)
        self.tiers[HOST].check()
        if self.device.type == "cuda" and self.placement.device_budget is not None and _alone_on_device(self):
            # (the parent's packed copies of the gradients being reduced are its buffers, outside the plan)
            held = torch.cuda.memory_allocated(self.device) - self._cuda_base - self._in_flight_bytes()
            assert held <= self.placement.device_budget * 1.05 + (64 << 20), (
                f"CUDA allocator holds {held} bytes for the offload engine, "
                f"over its budget {self.placement.device_budget}")

    def ready_for_eval(self) -> None:
        """The work in flight finished and the chunks holding the parameters the next step computes with (under
        the delayed update, the published copies of the updates run beside the last step): what an evaluation
        of the model reads, here or by a pipeline rank's stage runner."""
        self.drain()
        if self._dpu:
            self._publish_delayed()

    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> float:
        self.ready_for_eval()
        total = 0.0
        with evaluating([self.model]):
            for b in batches:
                x = b.x.to(self.device)
                y = b.y.to(self.device)
                for i in range(len(self.model)):
                    self._access(self._block_chunks(i), record=False)
                    x = self._forward_block(i, x, y, i == len(self.model) - 1, 1)
                total += float(x)
        return total / len(batches)

    # ---- reporting ----------------------------------------------------------------------------------------------
    def traffic(self) -> dict[str, int]:
        """Bytes moved so far per link, counted as the plan predicts them (``Placement.predicted_traffic``): h2d =
        chunks fetched + activations restored, d2h = chunks, gradients and updated parameters written home +
        activations spilled, disk_read / disk_write = all the disk store's reads and writes (set-up included).
        Work that runs beside the next step (a clipped update pass on a thread) counts when it runs."""
        spill, handoff = self.spill, self.handoff
        return {"h2d": self.bytes_h2d + (spill.bytes_h2d if spill else 0),
                "d2h": self.bytes_d2h + (spill.bytes_d2h if spill else 0) + (handoff.bytes_d2h if handoff else 0),
                "disk_read": self.disk.bytes_read if self.disk else 0,
                "disk_write": self.disk.bytes_written if self.disk else 0}

    def step_io(self) -> dict[str, float]:
        t = self.last_step_traffic
        if not t:
            return {}
        io = {"moved_h2d_bytes": t["h2d"], "moved_d2h_bytes": t["d2h"], "moved_disk_read_bytes": t["disk_read"],
              "moved_disk_write_bytes": t["disk_write"], "wait_s": self.last_step_wait_s}
        if self.reducer is not None:
            io["reductions_overlapped"] = self.reductions_overlapped()
        return io

    @property
    def predicted_step_s(self) -> float | None:
        return self.placement.predicted_step_s

    def measured_peaks(self) -> dict[str, int]:
        return {name: t.peak for name, t in self.tiers.items()}

    def memory_stats(self) -> dict[str, int]:
        return {"peak_device_bytes": peak_memory_bytes(self.device),
                "offload_device_peak_bytes": self.tiers[DEVICE].peak,
                "offload_host_peak_bytes": self.tiers[HOST].peak,
                "offload_disk_bytes": self.tiers[DISK].used,
                "offload_activation_peak_bytes": self.peak_act,
                "optim_state_bytes": sum(2 * c.cap * F32 for c in self.owned())}

    def close(self) -> None:
        _LIVE.discard(self)
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
