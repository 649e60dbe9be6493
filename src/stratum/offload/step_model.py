"""The offload step model: what one training step of a placement costs — peak bytes per tier, bytes moved per
link, seconds — computed exactly as the engine allocates and moves them.

The transfers follow from simulating OPT eviction on the step's chunk access sequence (:mod:`.belady`), the step
time from the profile's block times and the bandwidths measured at start-up. The planner
(:mod:`stratum.offload.planner`) prices every candidate with :func:`predict`; the engine's tests hold it to the
bytes the engine really moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from stratum.ir.costs import Costs
from stratum.offload.act_ring import RING
from stratum.offload.belady import simulate_step
from stratum.offload.chunks import ChunkSpec, Layout
from stratum.offload.grad_handoff import handoff_bytes, link_bytes
from stratum.offload.placement import KEEP, RECOMPUTE, SPILL, Placement
from stratum.offload.tiers import DEVICE, DISK, F32, HALF, HOST, Bandwidths, round_up
from stratum.runtime.device import HALF_DTYPES

LINKS = ("h2d", "d2h", "disk_read", "disk_write")


class Accesses(NamedTuple):
    """The chunk accesses of one step, as the engine performs them."""
    seq: list[tuple[int, ...]]
    wants: list[bool]
    """Per access: it wants the chunks' gradients (a backward's, or an update's)."""
    consumed: dict[int, int]
    """Chunk → the access after which the engine's update takes its gradient (its completion, or its update)."""


def access_sequence(layout: Layout, n_micro: int, deferred: bool, optimizer_tier: str) -> Accesses:
    """The chunk accesses of one step, as the engine performs them (streamed chunks only matter)."""
    L = len(layout.block_chunks)
    seq: list[tuple[int, ...]] = []
    wants: list[bool] = []
    for _ in range(n_micro):
        seq += [tuple(layout.block_chunks[i]) for i in range(L)]
        seq += [tuple(layout.block_chunks[i]) for i in reversed(range(L))]
        wants += [False] * L + [True] * L
    # a chunk's gradient is complete after the last micro-batch's backward of the first block that uses it
    last_bwd = len(seq) - L
    consumed = {c: last_bwd + (L - 1 - b) for c, b in layout.ready_block.items()}
    if deferred and optimizer_tier == DEVICE:  # clipped device updates: one access per chunk after the backward
        for c in layout.chunks:
            consumed[c.index] = len(seq)
            seq.append((c.index,))
            wants.append(True)
    return Accesses(seq, wants, consumed)


def half_chunks(precision: str, opt: str, ptier: str) -> bool:
    """Mixed-precision placement (Placement.half_params): under 16-bit autocast (bf16, or fp16 with loss scaling; the
    chunks in that dtype) with the fp32 master weights and AdamW moments off the device, the device holds 16-bit
    working copies of the chunks (slots and pinned chunks), every gradient goes to the host in 16 bits as autograd
    makes it and is accumulated there in fp32, where the update runs; the updated masters come back up as 16-bit
    copies (ZeRO-Offload's recipe). Masters and moments live in host RAM or on disk (``opt``, ``ptier``); a chunk
    whose master is on disk keeps its 16-bit copy in host RAM, which fetches read, so the disk moves only what the
    update reads and writes. With the moments on the device nothing crosses a link to save."""
    return precision in HALF_DTYPES and opt != DEVICE


def grads_to_host(opt: str, ptier: str, async_copies: bool, half: bool = False) -> bool:
    """Chunks hand autograd's gradient tensors straight to the host optimizer (engine._grads_home): every chunk's
    under mixed-precision placement (``half``); else the streamed chunks' on a CPU (no asynchronous copies: host
    RAM is the device's memory too) with parameters and moments on the host."""
    return half or (not async_copies and ptier == HOST and opt == HOST)


def runs_inline(async_copies: bool, *tiers: str) -> bool:
    """Work that touches only ``tiers`` runs on the training thread (prefetch.Inline), not on a thread beside it:
    on a CPU, unless the work waits on the disk. There compute keeps every core busy, and a thread beside it adds
    only contention (docs/offload.md has the A/B). A disk read or write waits on the device, and compute goes on
    beside it."""
    return not async_copies and DISK not in tiers


def slot_bytes(C: int, opt: str, ptier: str, bw: Bandwidths | None, half: bool = False) -> int:
    """Bytes of one device slot: parameters and gradients, or parameters only (``grads_to_host``), those in 16
    bits under mixed-precision placement (``half``)."""
    if half:
        return HALF * C
    return (4 if grads_to_host(opt, ptier, bw is not None and bw.async_copies) else 8) * C


@dataclass(frozen=True, kw_only=True)
class _Candidate:
    """One candidate placement with what the step model derives from it (see :func:`predict`'s arguments)."""

    layout: Layout
    R: int
    opt: str
    ptier: str
    k: int
    acts: str
    costs: Costs
    bw: Bandwidths | None
    n_micro: int
    deferred: bool
    spilled: frozenset[int]
    disk_spilled: frozenset[int]
    deferred_chunks: frozenset[int]
    kept: frozenset[int]
    inflight: tuple[int, ...] = ()
    """Placement.inflight: per block, the micro-batches a pipeline rank's stage holds at once (empty: one)."""
    half: bool = False
    """Placement.half_params: 16-bit chunks on the device, gradients to the host (``half_chunks``)."""
    chunk_grads: bool = False
    """Placement.chunk_grads: with ``half``, the gradients go to the host a chunk at a time (grad_handoff.py)."""

    @property
    def async_copies(self) -> bool:
        return self.bw is not None and self.bw.async_copies

    @property
    def stream(self) -> list[ChunkSpec]:
        return [c for c in self.layout.chunks if not c.pinned and self.ptier != DEVICE]

    @property
    def pinned(self) -> list[ChunkSpec]:
        return [c for c in self.layout.chunks if c.pinned or self.ptier == DEVICE]

    @property
    def slots(self) -> int:
        return min(self.R, len(self.stream))

    @property
    def recomputed(self) -> list[int]:
        if self.acts == KEEP:
            return []
        L = len(self.costs.act_bytes)
        if self.inflight:  # a pipeline rank keeps (or spills) block inputs and recomputes every block
            return list(range(L))
        return [i for i in range(L) if self.acts == RECOMPUTE or (i not in self.spilled and i not in self.kept)]

    @property
    def in_slot(self) -> bool:
        """A CPU slot is host memory: without clipping a streamed chunk's host/disk update runs in place on its
        slot as soon as its gradient is complete, and only the new parameters go home (engine._grad_complete) —
        except the deferred chunks', whose gradients go home and whose updates run beside the next forward."""
        return self.opt != DEVICE and not self.deferred and not self.async_copies and not self.half

    @property
    def late(self) -> int:
        return len(self.deferred_chunks) if self.in_slot else 0


def _stage_activation_bytes(c: _Candidate) -> float:
    """Device bytes of a pipeline rank's in-flight micro-batches' activations at their peak (Placement.inflight;
    the costs are stage_profile's: act_bytes a block's saved tensors with its input, out_bytes the block's
    checkpoint, spill_bytes the part of it a spill moves to the host). Keep: every in-flight micro-batch's saved
    tensors. Recompute: their checkpoints + one block's saved tensors (the block being recomputed). Offload: the
    checkpoints not spilled + one micro-batch's spilled checkpoints fetched back for its backward + one block's."""
    costs, n = c.costs, c.inflight
    if c.acts == KEEP:
        return sum(k * a for k, a in zip(n, costs.act_bytes))
    one_block = max(costs.act_bytes, default=0)
    kept = sum(k * o for k, o in zip(n, costs.out_bytes))
    if c.acts == RECOMPUTE:
        return kept + one_block
    return kept - sum(k * s for k, s in zip(n, costs.spill_bytes)) + sum(costs.spill_bytes) + one_block


def _activation_bytes(c: _Candidate) -> float:
    """Device bytes of one micro-batch's activations at their peak (of a pipeline rank's in-flight ones:
    :func:`_stage_activation_bytes`)."""
    if c.inflight:
        return _stage_activation_bytes(c)
    costs, L = c.costs, len(c.costs.act_bytes)
    one_block = max(costs.act_bytes, default=0)
    if c.acts == KEEP:
        return sum(costs.act_bytes)
    if c.acts == RECOMPUTE:  # the kept block inputs + one block's saved tensors at a time
        return one_block + sum(costs.out_bytes)
    # the kept block boundaries + the block being run (+ the next one's copy-back on a GPU); with some blocks
    # recomputed, a recomputed block's saved tensors meet the restore buffer, which lives from the first spilled
    # block's backward to the last one's. Kept blocks' activations pile up from the first one's forward on: the
    # forward's peak is the block running plus the kept ones before it. They are all released before the first
    # restore (the kept blocks are the last of the forward, the first of the backward).
    restore = (2 if c.async_copies else 1) * one_block
    fwd_peak = max((costs.act_bytes[j] + sum(costs.act_bytes[k] for k in c.kept if k < j) for j in range(L)),
                   default=0)
    return max(restore + (one_block if c.recomputed else 0), fwd_peak) + sum(costs.out_bytes)


def _peaks(c: _Candidate, act: float) -> dict[str, float]:
    """Peak bytes per tier."""
    chunks, C, costs = c.layout.chunks, c.layout.chunk_elems, c.costs
    pinned, stream = c.pinned, c.stream
    # a pinned chunk: parameters and gradients, or (``half``) its 16-bit parameters only
    dev: float = (sum((HALF if c.half else 8) * ch.capacity for ch in pinned)
                  + c.slots * slot_bytes(C, c.opt, c.ptier, c.bw, c.half) + act)
    # a tied chunk's per-micro-batch gradient buffer (same rounding as plain; a pipeline rank's stages accumulate
    # in place)
    if c.n_micro > 1 and not c.half and not c.inflight:
        dev += sum(4 * ch.capacity for ch in chunks if ch.tied)
    host: float = 0
    disk: float = 0
    if c.opt != DEVICE and (c.async_copies or c.half):  # pinned chunks' fp32 masters + grads on the host
        host += sum(8 * ch.capacity for ch in pinned)
    if c.half and c.async_copies:  # a GPU's pinned 16-bit copies of the masters, sent up after each update
        host += sum(HALF * ch.capacity for ch in chunks)
    elif c.half and c.ptier == DISK:  # a disk master's 16-bit copy, which fetches read
        host += sum(HALF * ch.capacity for ch in stream)
    if c.chunk_grads:  # the hand-off's 16-bit device buffers and pinned staging (its fp32 accumulators: above)
        extra = handoff_bytes(c.layout)
        dev += extra[DEVICE]
        host += extra[HOST]
    if c.ptier == HOST:
        host += sum(8 * ch.capacity for ch in stream)
    elif c.ptier == DISK and c.half:  # fp32 masters on disk, their gradients accumulated in fp32 on the host
        host += sum(F32 * ch.capacity for ch in stream)
        disk += sum(F32 * ch.capacity for ch in stream)
    elif c.ptier == DISK:
        disk += sum(8 * ch.capacity for ch in stream)
    moments = sum(8 * ch.capacity for ch in chunks)
    if c.opt == DEVICE:
        dev += moments
    elif c.opt == HOST:
        host += moments
    else:
        disk += moments
    if c.acts == SPILL and c.inflight:  # every in-flight micro-batch's spilled checkpoints
        host += sum(k * s for k, s in zip(c.inflight, costs.spill_bytes))
    elif c.acts == SPILL:  # one micro-batch's spilled activations (micro-batches run one after another)
        host += sum(costs.spill_bytes[i] for i in c.spilled - c.disk_spilled)
        if c.disk_spilled:
            host += RING * max(round_up(costs.spill_bytes[i]) for i in c.disk_spilled)
            disk += sum(round_up(costs.spill_bytes[i]) for i in c.disk_spilled)
    if c.opt == DISK:  # staging for the moments of the chunk being updated, in pieces of one chunk
        host += 2 * C * F32
    if c.ptier == DISK and c.opt != DEVICE and stream and (not c.in_slot or c.late):  # staging: params, grads
        host += (1 if c.half else 2) * C * F32  # (16-bit chunks: the gradients are held on the host)
    if c.ptier == DISK and stream and c.async_copies and not c.half:  # a GPU's pinned buffer for disk ↔ device
        host += C * F32
    return {DEVICE: dev, HOST: host, DISK: disk}


@dataclass
class _Traffic:
    """Bytes moved per step, per link; of them, those moved while the backward runs (the rest moves beside the
    forward: a clipped (deferred) host/disk update pass runs beside the next step's forward, so its traffic loads
    the forward's window, not the backward's — which decides, e.g., whether activations are better spilled to disk
    or recomputed); and of the host↔device bytes, those a CPU moves by memcpy (on the cores that train: not
    overlapped with compute), keyed by in_backward."""

    total: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LINKS, 0.0))
    back: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LINKS, 0.0))
    memcpy: dict[bool, float] = field(default_factory=lambda: {False: 0.0, True: 0.0})

    def add(self, link: str, nbytes: float, in_backward: bool, copy: bool = True) -> None:
        self.total[link] += nbytes
        if in_backward:
            self.back[link] += nbytes
        if copy and link in ("h2d", "d2h"):
            self.memcpy[in_backward] += nbytes

    def forward(self) -> dict[str, float]:
        return {key: self.total[key] - self.back[key] for key in self.total}


def _stream_traffic(c: _Candidate, t: _Traffic) -> None:
    """Streamed chunks' fetches and gradient round trips, simulated on the step's access sequence."""
    C, stream = c.layout.chunk_elems, c.stream
    # chunk parameters/gradients move by memcpy on a CPU (disk plans: by the disk's I/O; 16-bit chunks are fetched
    # from their host copies)
    direct = c.ptier != DISK or c.half
    slot_grads = not grads_to_host(c.opt, c.ptier, c.async_copies, c.half)  # else autograd's go to the host
    P = HALF if c.half else F32  # bytes of a fetched parameter
    acc = access_sequence(c.layout, c.n_micro, c.deferred, c.opt)
    pinned = {ch.index for ch in c.layout.chunks if ch.pinned}
    seq = [tuple(x for x in cs if x not in pinned) for cs in acc.seq]
    # A host/disk update outside the slot leaves the device copy stale: such chunks start a step not resident.
    # Gradients held in slots make round trips between micro-batches.
    stale = (frozenset(ch.index for ch in stream) if c.opt != DEVICE and not c.in_slot
             else frozenset(c.deferred_chunks))
    sim = simulate_step(seq, c.slots, wants=acc.wants if slot_grads else None, consumed=acc.consumed, stale=stale)
    fetches = sim.fetches
    half = fetches // 2  # forward and backward touch every block once each
    t.add("h2d", half * C * P, False, direct)
    t.add("h2d", (fetches - half) * C * P, True, direct)
    t.add("h2d", sim.grad_reads * C * F32, True, direct)
    t.add("d2h", (sim.grad_writes - sim.grad_writes_fwd) * C * F32, True, direct)
    t.add("d2h", sim.grad_writes_fwd * C * F32, False, direct)
    if c.opt == DEVICE:  # each updated chunk is written back once
        t.add("d2h", len(stream) * C * F32, not c.deferred, direct)
    if c.ptier == DISK and not c.half:
        t.add("disk_read", half * C * F32, False)
        t.add("disk_read", (fetches - half + sim.grad_reads) * C * F32, True)
        t.add("disk_write", (sim.grad_writes - sim.grad_writes_fwd) * C * F32, True)
        t.add("disk_write", sim.grad_writes_fwd * C * F32, False)
        if c.opt == DEVICE:
            t.add("disk_write", len(stream) * C * F32, not c.deferred)


def _update_traffic(c: _Candidate, t: _Traffic) -> None:
    """What a host/disk optimizer moves: gradients home, updated parameters back, moments in and out."""
    C, chunks, pinned, n_stream = c.layout.chunk_elems, c.layout.chunks, c.pinned, len(c.stream)
    if c.half:  # every gradient down in 16 bits (a chunk or a tensor at a time); pinned chunks' new copies up
        t.add("d2h", link_bytes(c.layout, c.n_micro) if c.chunk_grads else c.n_micro * c.layout.grad_elems * HALF,
              True)
        t.add("h2d", sum(ch.capacity for ch in pinned) * HALF, not c.deferred)
        if c.ptier == DISK:  # each disk master read for its update and written back
            for link in ("disk_read", "disk_write"):
                t.add(link, n_stream * C * F32, not c.deferred)
    elif c.opt != DEVICE:
        direct = c.ptier != DISK
        slot_grads = not grads_to_host(c.opt, c.ptier, c.async_copies)
        if c.async_copies:  # on a CPU pinned chunks are updated in place (engine._in_slot)
            t.add("d2h", sum(ch.capacity for ch in pinned) * F32, True)  # their gradients to the host
            t.add("h2d", sum(ch.capacity for ch in pinned) * F32, not c.deferred)  # refreshed master copies
        n_home = c.late if c.in_slot else n_stream  # chunks whose gradient goes home for a later update
        if c.in_slot:  # the updated parameters go home
            t.add("d2h" if c.ptier == HOST else "disk_write", (n_stream - c.late) * C * F32, True)
        if n_home and slot_grads:  # gradients to the host (else: handed over)
            t.add("d2h", n_home * C * F32, True, direct)
            if c.ptier == DISK:
                t.add("disk_write", n_home * C * F32, True)  # gradients out
                beside_bwd = not (c.deferred or c.late)
                t.add("disk_write", n_home * C * F32, beside_bwd)  # updated parameters back
                # gradients for the update, and parameters — except for a clipped update: it runs in the next
                # forward's fetch of the chunk (ChunkState.pending), whose read is counted with the fetches
                t.add("disk_read", (1 if c.deferred else 2) * n_home * C * F32, beside_bwd)
    if c.opt == DISK:
        moments = sum(8 * ch.capacity for ch in chunks)
        moments_late = moments if c.deferred else 8 * C * c.late
        for link in ("disk_read", "disk_write"):
            t.add(link, moments - moments_late, True)
            t.add(link, moments_late, False)


def _spill_traffic(c: _Candidate, t: _Traffic) -> None:
    """Spilled activations: out in the forward, back for the backward (a pipeline rank's: every micro-batch's
    spilled checkpoints, once each way)."""
    costs = c.costs
    if c.inflight:
        moved = c.n_micro * sum(costs.spill_bytes) if c.acts == SPILL else 0
        t.add("h2d", moved, True)
        t.add("d2h", moved, False)
        return
    spilled_bytes = c.n_micro * sum(costs.spill_bytes[i] for i in c.spilled) if c.acts == SPILL else 0
    if c.acts == SPILL and c.disk_spilled:  # written in the forward, read back for the backward, except the last
        # RING blocks written: still in the ring's buffers when their backward comes (act_ring.py)
        in_ring = set(sorted(c.disk_spilled)[-RING:])
        t.add("disk_write", c.n_micro * sum(round_up(costs.spill_bytes[i]) for i in c.disk_spilled), False)
        t.add("disk_read", c.n_micro * sum(round_up(costs.spill_bytes[i]) for i in c.disk_spilled - in_ring), True)
    t.add("h2d", spilled_bytes, True)
    t.add("d2h", spilled_bytes, False)


def _hidden_fraction(c: _Candidate) -> float:
    """The fraction of the shorter of compute and transfers that prefetch overlaps with the longer."""
    n_stream, need_max = len(c.stream), c.layout.max_chunks_per_block()
    if c.k == 0 or (n_stream and c.slots <= need_max):
        return 0.0  # no free slot to prefetch into while a block holds its chunks: transfers are not overlapped
    # prefetch overlaps transfers with compute, window by window; deeper prefetch hides more of the per-access
    # latency, and only as many chunks as there are slots beside the running block's can be in flight (adjacent
    # blocks share a chunk), so few free slots overlap only part of the transfers
    need = need_max if n_stream else 1
    in_flight = 1.0 if not n_stream else min(1.0, (c.slots - need) / max(need - 1, 1))
    return min(1.0, 0.5 + 0.25 * c.k) * in_flight


def _step_seconds(c: _Candidate, t: _Traffic, n_params: int, bw: Bandwidths) -> tuple[float, float]:
    """(predicted step seconds, compute seconds) at the measured bandwidths."""
    costs = c.costs
    fwd = c.n_micro * sum(costs.f)
    bwd = c.n_micro * (sum(costs.b) + sum(costs.f[i] for i in c.recomputed))
    rate = bw.adam_params_per_s
    if runs_inline(c.async_copies, c.opt, c.ptier) and bw.adam_inline_params_per_s > 0:
        rate = bw.adam_inline_params_per_s
    adam = n_params / max(rate, 1.0)

    def moved(tr: dict[str, float]) -> float:
        disk = tr["disk_read"] / max(bw.disk_read, 1.0) + tr["disk_write"] / max(bw.disk_write, 1.0)
        if not c.async_copies:  # a CPU's host↔device bytes are memcpys, counted with compute below
            return disk
        return disk + tr["h2d"] / max(bw.h2d, 1.0) + tr["d2h"] / max(bw.d2h, 1.0)
    if not c.async_copies:
        # On a CPU compute keeps every core busy: a memcpy (a spill, a chunk fetched from host RAM) takes its time
        # from compute wherever it runs, so it is added to the step, never overlapped.
        rate_hd = max(min(bw.h2d, bw.d2h), 1.0)
        fwd += t.memcpy[False] / rate_hd
        bwd += t.memcpy[True] / rate_hd
    hidden = _hidden_fraction(c)

    def window(comp: float, m: float) -> float:
        return max(comp, m) + (1 - hidden) * min(comp, m)
    step = window(fwd, moved(t.forward())) + window(bwd, moved(t.back)) + adam
    return step, fwd + bwd


def predict(layout: Layout, *, R: int, opt: str, ptier: str, k: int, acts: str, costs: Costs,
            bw: Bandwidths | None, n_micro: int, deferred: bool, n_params: int,
            spilled: frozenset[int] | None = None, disk_spilled: frozenset[int] = frozenset(),
            deferred_chunks: frozenset[int] = frozenset(), kept: frozenset[int] = frozenset(),
            inflight: tuple[int, ...] = (), half: bool = False,
            chunk_grads: bool = False) -> tuple[dict, dict, float, float, float]:
    """(peak bytes per tier, traffic per step, predicted step seconds, compute seconds, activation bytes).
    ``R`` device chunk slots, ``opt`` the optimizer's tier, ``ptier`` the parameters' home, ``k`` prefetch depth,
    ``acts`` keep | offload | recompute; ``deferred``: clipped updates (after the whole backward).
    ``spilled``: with acts = offload, the blocks spilled (None = all); the others are recomputed, except
    ``kept`` (Placement.kept_blocks: a suffix of the blocks, neither spilled nor recomputed).
    ``disk_spilled``: those of them spilled to disk through the activation ring rather than to the host.
    ``deferred_chunks``: see Placement.deferred_chunks (only used where updates otherwise run in the slot).
    ``inflight``: Placement.inflight (a pipeline rank's micro-batches in flight per block; empty: one).
    ``half``: Placement.half_params (16-bit chunks on the device, gradients to the host: ``half_chunks``); the
    activation bytes are then the ones the profile measured on 16-bit parameters, where it did.
    ``chunk_grads``: Placement.chunk_grads (with ``half``: the per-chunk gradient hand-off, grad_handoff.py)."""
    if half:
        costs = costs.on_half_params()
    L = len(costs.act_bytes)
    kept = kept if acts == SPILL else frozenset()
    c = _Candidate(layout=layout, R=R, opt=opt, ptier=ptier, k=k, acts=acts, costs=costs, bw=bw, n_micro=n_micro,
                   deferred=deferred, spilled=(frozenset(range(L)) if spilled is None else spilled) - kept,
                   disk_spilled=disk_spilled - kept, deferred_chunks=deferred_chunks, kept=kept, inflight=inflight,
                   half=half, chunk_grads=half and chunk_grads)
    act = _activation_bytes(c)
    peaks = _peaks(c, act)
    t = _Traffic()
    if c.stream and c.slots > 0:
        _stream_traffic(c, t)
    _update_traffic(c, t)
    _spill_traffic(c, t)
    if bw is None:
        compute = n_micro * (sum(costs.f) + sum(costs.b) + sum(costs.f[i] for i in c.recomputed))
        return peaks, t.total, compute, compute, act
    step, compute = _step_seconds(c, t, n_params, bw)
    return peaks, t.total, step, compute, act


def predict_placement(layout: Layout, plan: Placement, *, costs: Costs, bw: Bandwidths | None, n_micro: int,
                      deferred: bool, n_params: int) -> tuple[dict, dict, float, float, float]:
    """:func:`predict` for ``plan``'s choices (``layout`` = its chunk layout)."""
    return predict(layout, R=plan.resident_chunks, opt=plan.optimizer_tier, ptier=plan.param_tier,
                   k=plan.prefetch_depth, acts=plan.activations, costs=costs, bw=bw, n_micro=n_micro,
                   deferred=deferred, n_params=n_params,
                   spilled=None if plan.spill_blocks is None else frozenset(plan.spill_blocks),
                   disk_spilled=frozenset(plan.disk_spill_blocks), deferred_chunks=frozenset(plan.deferred_chunks),
                   kept=frozenset(plan.kept_blocks), inflight=plan.inflight, half=plan.half_params,
                   chunk_grads=plan.chunk_grads)
