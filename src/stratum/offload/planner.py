"""The offload planner: chunk size × device-resident chunks × optimizer placement × prefetch depth × activations.

A bounded, exhaustive search over a small candidate grid (at most a few thousand cheap evaluations, never a
loop that can fail to end): for every candidate the device/host/disk peak bytes are computed exactly as the
engine allocates them, the transfers per step follow from simulating OPT eviction on the step's access
sequence, and the step time from the profile's block times and the bandwidths measured at start-up. Of the
candidates that fit all budgets, those predicted within TIE of the fastest count as equally fast (the model is
not more precise than that); of those, the ones also fastest on a slower disk (SLOW_DISK) stay, and the one moving
the fewest bytes on the fastest tiers wins. If none fits, the error names the smallest budget that would work.
Once a candidate fits, the search stops after MAX_EVALUATIONS candidates (the plan then says so); until then it
goes on through the finite grid. The bound counts work, not seconds, so a plan is the same on a busy machine as on
an idle one.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

from stratum.errors import StratumError
from stratum.ir.costs import Costs
from stratum.model.blockseq import BlockSeq
from stratum.offload.act_ring import RING
from stratum.offload.belady import simulate_step
from stratum.offload.chunks import Layout, pack, param_order
from stratum.offload.tiers import DEVICE, DISK, F32, HOST, TIERS, Bandwidths, round_up
from stratum.units import fmt_at_least, fmt_bytes

PREFETCH_DEPTHS = (0, 1, 2, 4)
KEEP, SPILL, RECOMPUTE = "keep", "offload", "recompute"
ACTIVATIONS = (KEEP, SPILL, RECOMPUTE)
"""What happens to a block's saved activations between its forward and backward: kept on the device, spilled to
the host tier and copied back (activations.py), or dropped and recomputed from the block's input."""
MAX_EVALUATIONS = 8_000
"""Candidates the search evaluates at most once one fits: a count, not seconds, so the chosen plan does not depend
on the machine's load. GPT small's whole grid is 4,000-6,500 candidates (under a second on one core), GPT-2 774M's
7,000-8,000 (6-10 s); a larger grid is cut here, at the same candidate on every machine."""
TIE = 0.01
"""Predicted step times within this fraction of the fastest are a tie, decided by traffic, then tiers: a step
predicted a microsecond faster with the parameters on disk must not beat one with everything on the device
(seen for a 2 ms step under a budget of ten times the training state)."""
SLOW_DISK = 0.5
"""Tied plans are first compared at this fraction of the probed disk bandwidths: a shared disk's rate moves
(probed 1.1-2.65 GB/s read on this machine within one day). Beyond RAM, a probe at 2.65 GB/s tied a plan with no
deferred updates (less traffic) with ones deferring 14-27 chunks; the first won, and at the disk's usual rate its
backward was disk-bound (0.78x plain; backward 13.6-15.1 s against 11.5-12.2 s with 14 chunks deferred)."""


@dataclass(kw_only=True)
class Placement:
    chunk_elems: int
    """fp32 elements per chunk."""
    resident_chunks: int
    """Device chunk slots for streamed chunks (ignored when param_tier = device: all chunks stay there)."""
    optimizer_tier: str
    """Where AdamW's moments live and the update runs: device, host or disk."""
    param_tier: str
    """Home of parameters (and spilled gradients) not on the device: device (all resident), host or disk."""
    prefetch_depth: int
    """Accesses fetched ahead of use (0 = on demand)."""
    activations: str = KEEP
    """keep | offload | recompute (see ACTIVATIONS)."""
    spill_blocks: tuple[int, ...] | None = None
    """With activations = offload: the blocks whose activations are spilled (None = all); the others are
    recomputed — what the host budget cannot hold is recomputed (or spilled to disk) rather than refused."""
    disk_spill_blocks: tuple[int, ...] = ()
    """Of the spilled blocks, those whose activations go to disk (act_ring.py) rather than the host tier."""
    kept_blocks: tuple[int, ...] = ()
    """With activations = offload: the last blocks of the forward, whose activations stay on the device instead
    (neither spilled nor recomputed): their backward comes first, so a spill would be copied straight back. The
    last block is free (its activations are on the device when the backward starts anyway); more cost device bytes
    that would otherwise hold chunk slots."""
    recomputes_some: bool = False
    """With activations = offload: some blocks are recomputed (not every block is in spill_blocks)."""
    deferred_chunks: tuple[int, ...] = ()
    """On a CPU without clipping: chunks whose gradient goes home and whose update runs beside the next forward
    instead of in the backward (the first whose gradients complete). The backward is where a disk plan's
    traffic piles up (moments read and written, parameters re-read); this moves some of it to the forward."""
    device_budget: int | None = None
    host_budget: int | None = None
    n_chunks: int = 0
    act_bytes: float = 0
    predicted_peak: dict = field(default_factory=dict)
    """Tier → predicted peak bytes (device includes activations)."""
    predicted_traffic: dict = field(default_factory=dict)
    """Link → bytes per step: h2d, d2h, disk_read, disk_write."""
    predicted_step_s: float = 0.0
    compute_s: float = 0.0
    disk_s: float = 0.0
    """Seconds of this step's disk traffic at the measured bandwidths (the physical bound of a disk plan)."""
    copy_s: float = 0.0
    """Seconds of this step's host↔device copies at the measured bandwidths."""
    candidates: int = 0
    search_cut: bool = False
    """The search stopped at its bound (MAX_EVALUATIONS candidates) before trying every candidate."""

    @property
    def recompute(self) -> bool:
        return self.activations == RECOMPUTE

    @property
    def uses_disk(self) -> bool:
        return self.param_tier == DISK or self.optimizer_tier == DISK or bool(self.disk_spill_blocks)

    @property
    def needs_staging(self) -> bool:
        return self.optimizer_tier == DISK or (self.param_tier == DISK and self.optimizer_tier != DEVICE)

    def to_dict(self) -> dict:
        return asdict(self)

    def spilled(self, n_blocks: int) -> frozenset[int]:
        """The blocks whose activations this plan spills (none unless activations = offload)."""
        if self.activations != SPILL:
            return frozenset()
        every = frozenset(range(n_blocks)) if self.spill_blocks is None else frozenset(self.spill_blocks)
        return every - frozenset(self.kept_blocks)

    def kept(self) -> frozenset[int]:
        """The blocks whose activations stay on the device between forward and backward under this plan."""
        return frozenset(self.kept_blocks) if self.activations == SPILL else frozenset()

    def _acts_text(self) -> str:
        keep = f", kept on the device for the last {len(self.kept_blocks)}" if self.kept_blocks else ""
        if self.activations != SPILL or self.spill_blocks is None:
            return self.activations + (keep if self.activations == SPILL else "")
        disk = len(self.disk_spill_blocks)
        text = f"offload for {len(self.spill_blocks) - disk - len(self.kept_blocks)} blocks"
        if disk:
            text += f", to disk for {disk}"
        return text + keep + (", recompute for the rest" if self.recomputes_some else "")

    def _updates_text(self) -> str:
        if not self.deferred_chunks:
            return ""
        return f"; updates of {len(self.deferred_chunks)} chunks beside the next forward"

    def describe(self) -> str:
        tr = self.predicted_traffic
        res = "all" if self.param_tier == DEVICE else str(self.resident_chunks)
        lines = [
            f"offload plan: {self.n_chunks} chunks of {fmt_bytes(self.chunk_elems * F32)}; device-resident chunks "
            f"{res}; parameters' home {self.param_tier}; optimizer state on {self.optimizer_tier}; prefetch depth "
            f"{self.prefetch_depth}; activations: {self._acts_text()}{self._updates_text()} ({self.candidates} "
            f"candidates{f'; the search stopped at its bound of {MAX_EVALUATIONS:,}' if self.search_cut else ''})",
            f"  {'tier':<7} {'budget':>12} {'predicted peak':>15}",
        ]
        budgets = {DEVICE: self.device_budget, HOST: self.host_budget, DISK: None}
        for t in TIERS:
            lines.append(f"  {t:<7} {fmt_bytes(budgets[t]):>12} {fmt_bytes(self.predicted_peak.get(t, 0)):>15}")
        lines.append(f"  traffic per step: host→device {fmt_bytes(tr.get('h2d', 0))}, device→host "
                     f"{fmt_bytes(tr.get('d2h', 0))}, disk read {fmt_bytes(tr.get('disk_read', 0))}, disk write "
                     f"{fmt_bytes(tr.get('disk_write', 0))}")
        lines.append(f"  predicted step time {self.predicted_step_s:.3f} s (compute {self.compute_s:.3f} s; disk "
                     f"{self.disk_s:.3f} s and host↔device copies {self.copy_s:.3f} s at the measured bandwidths; "
                     f"activations {fmt_bytes(self.act_bytes)} per micro-batch)")
        return "\n".join(lines)


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


def predict(layout: Layout, *, R: int, opt: str, ptier: str, k: int, acts: str, costs: Costs,
            bw: Bandwidths | None, n_micro: int, deferred: bool, n_params: int,
            spilled: frozenset[int] | None = None, disk_spilled: frozenset[int] = frozenset(),
            deferred_chunks: frozenset[int] = frozenset(),
            kept: frozenset[int] = frozenset()) -> tuple[dict, dict, float, float, float]:
    """(peak bytes per tier, traffic per step, predicted step seconds, compute seconds, activation bytes).
    ``spilled``: with acts = offload, the blocks spilled (None = all); the others are recomputed, except
    ``kept`` (Placement.kept_blocks: a suffix of the blocks, neither spilled nor recomputed).
    ``disk_spilled``: those of them spilled to disk through the activation ring rather than to the host.
    ``deferred_chunks``: see Placement.deferred_chunks (only used where updates otherwise run in the slot)."""
    L = len(costs.act_bytes)
    kept = kept if acts == SPILL else frozenset()
    spilled = (frozenset(range(L)) if spilled is None else spilled) - kept
    disk_spilled = disk_spilled - kept
    recomputed = [] if acts == KEEP else [i for i in range(L)
                                          if acts == RECOMPUTE or (i not in spilled and i not in kept)]
    chunks = layout.chunks
    C = layout.chunk_elems
    stream = [c for c in chunks if not c.tied and ptier != DEVICE]
    pinned = [c for c in chunks if c.tied or ptier == DEVICE]
    n_stream = len(stream)
    slots = min(R, n_stream)
    one_block = max(costs.act_bytes, default=0)
    async_copies = bw is not None and bw.async_copies
    if acts == KEEP:
        act = sum(costs.act_bytes)
    elif acts == RECOMPUTE:  # the kept block inputs + one block's saved tensors at a time
        act = one_block + sum(costs.out_bytes)
    else:  # the kept block boundaries + the block being run (+ the next one's copy-back on a GPU)
        restore = (2 if async_copies else 1) * one_block
        # with some blocks recomputed, a recomputed block's saved tensors meet the restore buffer, which lives
        # from the first spilled block's backward to the last one's
        # Kept blocks' activations pile up from the first one's forward on: the forward's peak is the block running
        # plus the kept ones before it. They are all released before the first restore (the kept blocks are the
        # last of the forward, the first of the backward).
        fwd_peak = max((costs.act_bytes[j] + sum(costs.act_bytes[k] for k in kept if k < j) for j in range(L)),
                       default=0)
        act = max(restore + (one_block if recomputed else 0), fwd_peak) + sum(costs.out_bytes)
    dev = sum(8 * c.capacity for c in pinned) + slots * slot_bytes(C, opt, ptier, bw) + act
    if n_micro > 1:  # a tied chunk's per-micro-batch gradient buffer (same rounding as the plain engine)
        dev += sum(4 * c.capacity for c in chunks if c.tied)
    host: float = 0
    disk: float = 0
    if opt != DEVICE and async_copies:  # a GPU's pinned chunks keep fp32 master params + grads on the host
        host += sum(8 * c.capacity for c in pinned)
    if ptier == HOST:
        host += sum(8 * c.capacity for c in stream)
    elif ptier == DISK:
        disk += sum(8 * c.capacity for c in stream)
    if opt == DEVICE:
        dev += sum(8 * c.capacity for c in chunks)
    elif opt == HOST:
        host += sum(8 * c.capacity for c in chunks)
    else:
        disk += sum(8 * c.capacity for c in chunks)
    if acts == SPILL:  # one micro-batch's spilled activations (micro-batches run one after another)
        host += sum(costs.spill_bytes[i] for i in spilled - disk_spilled)
        if disk_spilled:
            host += RING * max(round_up(costs.spill_bytes[i]) for i in disk_spilled)
            disk += sum(round_up(costs.spill_bytes[i]) for i in disk_spilled)
    if opt == DISK:  # staging for the moments of the chunk being updated, in pieces of one chunk
        host += 2 * C * F32
    # A CPU slot is host memory: without clipping a streamed chunk's host/disk update runs in place on its slot
    # as soon as its gradient is complete, and only the new parameters go home (engine._grad_complete) — except
    # the deferred chunks', whose gradients go home and whose updates run beside the next forward.
    in_slot = opt != DEVICE and not deferred and not async_copies
    late = len(deferred_chunks) if in_slot else 0
    if ptier == DISK and opt != DEVICE and n_stream and (not in_slot or late):  # staging: params and gradients
        host += 2 * C * F32
    if ptier == DISK and n_stream and async_copies:  # a GPU's pinned buffer for its disk ↔ device copies
        host += C * F32
    tr: dict[str, float] = {"h2d": 0, "d2h": 0, "disk_read": 0, "disk_write": 0}
    # Bytes moved while the backward runs (the rest moves beside the forward): a clipped (deferred) host/disk
    # update pass runs beside the next step's forward, so its traffic loads the forward's window, not the
    # backward's — which decides, e.g., whether activations are better spilled to disk or recomputed.
    back: dict[str, float] = dict.fromkeys(tr, 0)
    # Of the host↔device bytes, those a CPU moves by memcpy (on the cores that train: not overlapped with compute),
    # forward and backward; a disk-home chunk is read into its CPU slot directly (disk traffic only).
    memcpy: dict[bool, float] = {False: 0, True: 0}

    def add(link: str, nbytes: float, in_backward: bool, copy: bool = True) -> None:
        tr[link] += nbytes
        if in_backward:
            back[link] += nbytes
        if copy and link in ("h2d", "d2h"):
            memcpy[in_backward] += nbytes
    direct = ptier != DISK  # chunk parameters/gradients move by memcpy on a CPU (disk plans: by the disk's I/O)
    slot_grads = not grads_to_host(opt, ptier, async_copies)  # else autograd's gradients are handed to the host
    if n_stream and slots > 0:
        acc = access_sequence(layout, n_micro, deferred, opt)
        tied = {c.index for c in chunks if c.tied}
        seq = [tuple(c for c in cs if c not in tied) for cs in acc.seq]
        # A host/disk update outside the slot leaves the device copy stale: such chunks start a step not resident
        # (the model used to keep the last backward's chunks for the next forward: 30 fetches a step predicted for
        # GPT small at 25 %, 34 made). Gradients held in slots make round trips between micro-batches.
        stale = frozenset(c.index for c in stream) if opt != DEVICE and not in_slot else frozenset(deferred_chunks)
        sim = simulate_step(seq, slots, wants=acc.wants if slot_grads else None, consumed=acc.consumed,
                            stale=stale)
        fetches = sim.fetches
        half = fetches // 2  # forward and backward touch every block once each
        add("h2d", half * C * F32, False, direct)
        add("h2d", (fetches - half) * C * F32, True, direct)
        add("h2d", sim.grad_reads * C * F32, True, direct)
        add("d2h", (sim.grad_writes - sim.grad_writes_fwd) * C * F32, True, direct)
        add("d2h", sim.grad_writes_fwd * C * F32, False, direct)
        if opt == DEVICE:  # each updated chunk is written back once
            add("d2h", n_stream * C * F32, not deferred, direct)
        if ptier == DISK:
            add("disk_read", half * C * F32, False)
            add("disk_read", (fetches - half + sim.grad_reads) * C * F32, True)
            add("disk_write", (sim.grad_writes - sim.grad_writes_fwd) * C * F32, True)
            add("disk_write", sim.grad_writes_fwd * C * F32, False)
            if opt == DEVICE:
                add("disk_write", n_stream * C * F32, not deferred)
    if opt != DEVICE:
        if async_copies:  # on a CPU pinned chunks are updated in place (engine._in_slot)
            add("d2h", sum(c.capacity for c in pinned) * F32, True)  # their gradients to the host
            add("h2d", sum(c.capacity for c in pinned) * F32, not deferred)  # refreshed master copies
        n_home = late if in_slot else n_stream  # chunks whose gradient goes home for a later update
        if in_slot:  # the updated parameters go home
            add("d2h" if ptier == HOST else "disk_write", (n_stream - late) * C * F32, True)
        if n_home and slot_grads:  # gradients to the host (else: handed over)
            add("d2h", n_home * C * F32, True, direct)
            if ptier == DISK:
                add("disk_write", n_home * C * F32, True)  # gradients out
                beside_bwd = not (deferred or late)
                add("disk_write", n_home * C * F32, beside_bwd)  # updated parameters back
                # gradients for the update, and parameters — except for a clipped update: it runs in the next
                # forward's fetch of the chunk (ChunkState.pending), whose read is counted with the fetches
                add("disk_read", (1 if deferred else 2) * n_home * C * F32, beside_bwd)
    if opt == DISK:
        moments = sum(8 * c.capacity for c in chunks)
        moments_late = moments if deferred else 8 * C * late
        for link in ("disk_read", "disk_write"):
            add(link, moments - moments_late, True)
            add(link, moments_late, False)
    spilled_bytes = n_micro * sum(costs.spill_bytes[i] for i in spilled) if acts == SPILL else 0
    if acts == SPILL and disk_spilled:  # written in the forward, read back for the backward, except the last
        # RING blocks written: still in the ring's buffers when their backward comes (act_ring.py)
        in_ring = set(sorted(disk_spilled)[-RING:])
        add("disk_write", n_micro * sum(round_up(costs.spill_bytes[i]) for i in disk_spilled), False)
        add("disk_read", n_micro * sum(round_up(costs.spill_bytes[i]) for i in disk_spilled - in_ring), True)
    add("h2d", spilled_bytes, True)
    add("d2h", spilled_bytes, False)
    fwd = n_micro * sum(costs.f)
    bwd = n_micro * (sum(costs.b) + sum(costs.f[i] for i in recomputed))
    compute = fwd + bwd
    if bw is None:
        return {DEVICE: dev, HOST: host, DISK: disk}, tr, compute, compute, act
    rate = bw.adam_params_per_s
    if runs_inline(async_copies, opt, ptier) and bw.adam_inline_params_per_s > 0:
        rate = bw.adam_inline_params_per_s
    adam = n_params / max(rate, 1.0)

    def moved(t: dict) -> float:
        disk = t["disk_read"] / max(bw.disk_read, 1.0) + t["disk_write"] / max(bw.disk_write, 1.0)
        if not async_copies:  # a CPU's host↔device bytes are memcpys, counted with compute below
            return disk
        return disk + t["h2d"] / max(bw.h2d, 1.0) + t["d2h"] / max(bw.d2h, 1.0)
    m_b = moved(back)
    m_f = moved({key: tr[key] - back[key] for key in tr})
    if not async_copies:
        # On a CPU compute keeps every core busy: a memcpy (a spill, a chunk fetched from host RAM) takes its time
        # from compute wherever it runs. Counted as overlapped, fetches looked free: the plan at a 25 % budget
        # predicted 0.23 s for a 0.25 s step.
        rate_hd = max(min(bw.h2d, bw.d2h), 1.0)
        fwd += memcpy[False] / rate_hd
        bwd += memcpy[True] / rate_hd
        compute = fwd + bwd
    if n_stream and slots <= layout.max_chunks_per_block():
        k = 0  # no free slot to prefetch into while a block holds its chunks: transfers are not overlapped
    hidden = 0.0
    if k > 0:
        # prefetch overlaps transfers with compute, window by window; deeper prefetch hides more of the
        # per-access latency, and only as many chunks as there are slots beside the running block's can be in
        # flight (adjacent blocks share a chunk): 5 slots for 4-chunk blocks measured 31 s/step with 10 s of
        # waits where full overlap predicted 21 s
        need = layout.max_chunks_per_block() if n_stream else 1
        in_flight = 1.0 if not n_stream else min(1.0, (slots - need) / max(need - 1, 1))
        hidden = min(1.0, 0.5 + 0.25 * k) * in_flight

    def window(c: float, m: float) -> float:
        return max(c, m) + (1 - hidden) * min(c, m)
    step = window(fwd, m_f) + window(bwd, m_b) + adam
    return {DEVICE: dev, HOST: host, DISK: disk}, tr, step, compute, act


def predict_placement(layout: Layout, plan: Placement, *, costs: Costs, bw: Bandwidths | None, n_micro: int,
                 deferred: bool, n_params: int) -> tuple[dict, dict, float, float, float]:
    """:func:`predict` for ``plan``'s choices (``layout`` = its chunk layout)."""
    return predict(layout, R=plan.resident_chunks, opt=plan.optimizer_tier, ptier=plan.param_tier,
                   k=plan.prefetch_depth, acts=plan.activations, costs=costs, bw=bw, n_micro=n_micro,
                   deferred=deferred, n_params=n_params,
                   spilled=None if plan.spill_blocks is None else frozenset(plan.spill_blocks),
                   disk_spilled=frozenset(plan.disk_spill_blocks), deferred_chunks=frozenset(plan.deferred_chunks),
                   kept=frozenset(plan.kept_blocks))


def _spill_choice(costs: Costs, room: float) -> frozenset[int]:
    """The blocks to spill within ``room`` host bytes: most recompute seconds saved per byte first (greedy)."""
    order = sorted(range(len(costs.spill_bytes)), key=lambda i: -costs.f[i] / max(costs.spill_bytes[i], 1))
    chosen: list[int] = []
    used: float = 0
    for i in order:
        if used + costs.spill_bytes[i] <= room:
            chosen.append(i)
            used += costs.spill_bytes[i]
    return frozenset(chosen)


def _activation_options(recs, host_budget: int | None, layout: Layout, opt: str, ptier: str, costs: Costs,
                        n_micro: int, deferred: bool, n_params: int, bw: Bandwidths | None):
    """(activations, spilled blocks or None = all, of those the ones on disk) to try. Offload is tried three
    ways when the host budget is bounded: all blocks on the host; what the host holds there and the rest
    recomputed; what the host holds there (beside the disk ring's buffers) and the rest on disk."""
    L = len(costs.spill_bytes)
    for rc in recs:
        if rc != SPILL or host_budget is None:
            yield rc, None, frozenset()
            continue
        base, _, _, _, _ = predict(layout, R=0, opt=opt, ptier=ptier, k=0, acts=rc, costs=costs, bw=bw,
                                   n_micro=n_micro, deferred=deferred, n_params=n_params, spilled=frozenset())
        room = host_budget - base[HOST]
        yield rc, None, frozenset()  # refused later if the host cannot hold it all
        host_set = _spill_choice(costs, room)
        if host_set and len(host_set) < L:  # an empty set is plain recompute, tried on its own
            yield rc, host_set, frozenset()
        ring = RING * max((round_up(b) for b in costs.spill_bytes), default=0)
        if len(host_set) < L and room >= ring and ring > 0:
            on_host = _spill_choice(costs, room - ring)
            yield rc, frozenset(range(L)), frozenset(range(L)) - on_host


KEPT_SUFFIXES = (0, 1, 2, 3, 4, 6, 8)


def _kept_options(acts: str, n_blocks: int, fixed: int | None) -> list[frozenset[int]]:
    """Placement.kept_blocks to try with spilled activations: the last 0, 1, 2, … blocks (bounded: a few sizes), or
    the last ``fixed``."""
    if acts != SPILL:
        return [frozenset()]
    sizes = KEPT_SUFFIXES if fixed is None else (fixed,)
    return [frozenset(range(n_blocks - n, n_blocks)) for n in sizes if n < n_blocks]


def _deferral_options(layout: Layout, opt: str, ptier: str, deferred: bool,
                      bw: Bandwidths | None) -> list[frozenset[int]]:
    """Sets of chunks whose update may run beside the next forward (Placement.deferred_chunks): none, and the first
    1/8 … 1/2 of the streamed chunks to complete their gradients. Only where updates otherwise run in the slot
    during the backward: a CPU, a host/disk optimizer, streamed parameters, no clipping."""
    if opt == DEVICE or ptier == DEVICE or deferred or (bw is not None and bw.async_copies):
        return [frozenset()]
    order = sorted((c.index for c in layout.chunks if not c.tied), key=lambda i: -layout.ready_block[i])
    sets = {frozenset(order[:round(len(order) * f)]) for f in (0, 1 / 8, 1 / 4, 3 / 8, 1 / 2)}
    return sorted(sets, key=len)


def _chunk_candidates(seq: BlockSeq) -> list[int]:
    tied = {g.owner for g in seq.tied}
    params = [p.numel() for n, p in param_order(seq) if n not in tied]
    if not params:
        return [1]
    biggest = max(params)
    total = sum(params)
    cands = {biggest}
    for n in (2, 4, 8, 16, 32, 64, 128):
        cands.add(max(biggest, -(-total // n)))
    for f in (1.02, 1.1, 1.5, 2.0, 3.0):  # a little slack lets small params (norms, biases) share a big one's chunk
        cands.add(int(biggest * f))
    return sorted(cands)


def grads_to_host(opt: str, ptier: str, async_copies: bool) -> bool:
    """Streamed chunks hand autograd's gradient tensors straight to the host optimizer (engine._grads_home):
    on a CPU (no asynchronous copies: host RAM is the device's memory too) with parameters and moments on the
    host."""
    return not async_copies and ptier == HOST and opt == HOST


def runs_inline(async_copies: bool, *tiers: str) -> bool:
    """Work that touches only ``tiers`` runs on the training thread (prefetch.Inline), not on a thread beside it:
    on a CPU, unless the work waits on the disk. There compute keeps every core busy, and a thread beside it adds
    only contention: same-process A/B at a 25 % budget (GPT ``small``), chunk fetches 2 % and AdamW 1-2 % faster
    in place than on their threads. A disk read or write waits on the device, and compute goes on beside it."""
    return not async_copies and DISK not in tiers


def slot_bytes(C: int, opt: str, ptier: str, bw: Bandwidths | None) -> int:
    """Bytes of one device slot: parameters and gradients, or parameters only (``grads_to_host``)."""
    return (4 if grads_to_host(opt, ptier, bw is not None and bw.async_copies) else 8) * C


def choose(fits: list[tuple[float, tuple, Placement]], slow=None):
    """The plan of ``fits`` (predicted step seconds, tie-break key, plan): of those within TIE of the fastest, the
    one with the smallest key. Comparing with the fastest, not pairwise, so a chain of near-ties cannot drift.
    ``slow(plan)``: its predicted step on a slower disk (SLOW_DISK); given, the tied plans are narrowed first to
    those within TIE of the fastest there."""
    fastest = min(step for step, _, _ in fits)
    near = [f for f in fits if f[0] <= fastest * (1 + TIE)]
    if slow is not None and len(near) > 1:
        at_slow = [slow(f[2]) for f in near]
        best = min(at_slow)
        near = [f for f, t in zip(near, at_slow) if t <= best * (1 + TIE)]
    return min(near, key=lambda f: f[1])[2]


def make_placement(seq: BlockSeq, *, device_budget: int | None, host_budget: int | None, disk_free: int | None,
              bandwidths: Bandwidths | None, profile=None, n_micro: int = 1, grad_clip: float = 0.0,
              chunk_elems: int | None = None, resident_chunks: int | None = None,
              optimizer_tier: str | None = None, prefetch_depth: int | None = None,
              activations: str | None = None, kept_blocks: int | None = None) -> Placement:
    """The fastest predicted placement under the budgets; ``None`` arguments are the planner's to choose
    (``kept_blocks``: how many of the last blocks keep their activations on the device, Placement.kept_blocks)."""
    costs = Costs.blocks(profile) if profile is not None else Costs.zeros(len(seq))
    n_params = sum(p.numel() for _, p in param_order(seq))
    deferred = grad_clip > 0
    sizes = [chunk_elems] if chunk_elems else _chunk_candidates(seq)
    opts = [optimizer_tier] if optimizer_tier else [DEVICE, HOST, DISK]
    depths = [prefetch_depth] if prefetch_depth is not None else list(PREFETCH_DEPTHS)
    recs = [activations] if activations is not None else list(ACTIVATIONS)
    fits: list[tuple[float, tuple, Placement]] = []  # (predicted step, tie-break key, plan) of every plan that fits
    layouts: dict[int, Layout] = {}  # chunk elements → layout (to predict tied plans again on a slower disk)
    tried = 0
    cut = False
    smallest: dict[str, int | None] = {DEVICE: None, HOST: None}
    for C in sizes:
        layout = pack(seq, C)
        layouts[layout.chunk_elems] = layout
        n_stream = len(layout.streamable)
        need = max(layout.max_chunks_per_block(), 1)
        for opt in opts:
            for ptier in (DEVICE, HOST, DISK):
                if ptier == DEVICE and resident_chunks is not None and resident_chunks < n_stream:
                    continue
                defer_options = _deferral_options(layout, opt, ptier, deferred, bandwidths)
                for rc, spill_set, disk_set in _activation_options(recs, host_budget, layout, opt, ptier, costs,
                                                                   n_micro, deferred, n_params, bandwidths):
                    before = None  # the best step with one kept block fewer
                    for kept in _kept_options(rc, len(seq), kept_blocks):
                        here = float("inf")
                        if ptier == DEVICE:
                            r_options = [n_stream]
                        elif resident_chunks is not None:
                            r_options = [resident_chunks]
                        else:
                            # the most slots the device budget allows (more slots never cost time), else the fewest
                            base, _, _, _, _ = predict(layout, R=0, opt=opt, ptier=ptier, k=0, acts=rc, costs=costs,
                                                       bw=bandwidths, n_micro=n_micro, deferred=deferred,
                                                       n_params=n_params, spilled=spill_set, disk_spilled=disk_set,
                                                       kept=kept)
                            per = slot_bytes(C, opt, ptier, bandwidths)
                            rmax = n_stream if device_budget is None else (device_budget - base[DEVICE]) // per
                            r_options = sorted({need, max(need, min(rmax, n_stream))})
                        for R, k, late in itertools.product(r_options, depths, defer_options):
                            if R < need and ptier != DEVICE:
                                continue
                            # the bound applies once a plan fits (the grid is finite: the search ends anyway);
                            # cut before that, a model would be refused a budget that fits
                            if fits and tried >= MAX_EVALUATIONS:
                                cut = True
                                break
                            tried += 1
                            peak, tr, step, comp, act = predict(layout, R=R, opt=opt, ptier=ptier, k=k, acts=rc,
                                                                costs=costs, bw=bandwidths, n_micro=n_micro,
                                                                deferred=deferred, n_params=n_params,
                                                                spilled=spill_set, disk_spilled=disk_set,
                                                                deferred_chunks=late, kept=kept)
                            host_ok = host_budget is None or peak[HOST] <= host_budget
                            dev_ok = device_budget is None or peak[DEVICE] <= device_budget
                            disk_ok = disk_free is None or peak[DISK] <= disk_free
                            if host_ok and disk_ok and (smallest[DEVICE] is None or peak[DEVICE] < smallest[DEVICE]):
                                smallest[DEVICE] = peak[DEVICE]
                            if dev_ok and disk_ok and (smallest[HOST] is None or peak[HOST] < smallest[HOST]):
                                smallest[HOST] = peak[HOST]
                            if not (host_ok and dev_ok and disk_ok):
                                continue
                            here = min(here, step)
                            # ties (TIE): less traffic, faster tiers, then deeper prefetch (fetches ahead cost no
                            # memory: the slots are the plan's; depth 4 against 2 measured 1-2 % faster on a CPU
                            # where both predict full overlap)
                            key = (sum(tr.values()), TIERS.index(ptier), TIERS.index(opt), peak[DISK], peak[HOST],
                                   peak[DEVICE], -C, -k, step)
                            fits.append((step, key, Placement(
                                chunk_elems=layout.chunk_elems, resident_chunks=R if ptier != DEVICE else n_stream,
                                optimizer_tier=opt, param_tier=ptier, prefetch_depth=k, activations=rc,
                                device_budget=device_budget,
                                spill_blocks=None if spill_set is None else tuple(sorted(spill_set)),
                                disk_spill_blocks=tuple(sorted(disk_set - kept)), kept_blocks=tuple(sorted(kept)),
                                recomputes_some=spill_set is not None and bool(
                                    frozenset(range(len(seq))) - spill_set - kept),
                                deferred_chunks=tuple(sorted(late)), host_budget=host_budget,
                                n_chunks=len(layout.chunks), act_bytes=act, predicted_peak=peak,
                                predicted_traffic=tr, predicted_step_s=step, compute_s=comp)))
                        # more kept blocks take slots: stop once keeping one more stops shortening the step (keeps
                        # the search short; GPT-2 774M has 36 candidate suffixes' worth of blocks)
                        if before is not None and here >= before:
                            break
                        before = here
    if not fits:
        parts = []
        low_dev, low_host = smallest[DEVICE], smallest[HOST]
        if low_dev is not None:
            parts.append(f"the smallest offload.device_budget that works with this host budget is "
                         f"{fmt_at_least(low_dev, device_budget)} ({low_dev:,} bytes)")
        if low_host is not None and (low_dev is None or host_budget is not None):
            parts.append(f"the smallest offload.host_budget that works with this device budget is "
                         f"{fmt_at_least(low_host, host_budget)} ({low_host:,} bytes)")
        if not parts:
            parts.append("no placement fits even with the largest chunks on disk; raise both budgets "
                         "or free disk space under offload.disk_dir")
        raise StratumError(f"offload: no placement fits offload.device_budget = {fmt_bytes(device_budget)} and "
                           f"offload.host_budget = {fmt_bytes(host_budget)} (with the overrides given); "
                           + "; ".join(parts))
    slow_bw = None if bandwidths is None else replace(bandwidths, disk_read=bandwidths.disk_read * SLOW_DISK,
                                                      disk_write=bandwidths.disk_write * SLOW_DISK)

    def on_slow_disk(p: Placement) -> float:
        return predict_placement(layouts[p.chunk_elems], p, costs=costs, bw=slow_bw, n_micro=n_micro, deferred=deferred,
                            n_params=n_params)[2]
    plan = choose(fits, on_slow_disk if bandwidths is not None else None)
    plan.candidates = tried
    plan.search_cut = cut
    if bandwidths is not None:
        tr, bw = plan.predicted_traffic, bandwidths
        plan.disk_s = tr["disk_read"] / max(bw.disk_read, 1.0) + tr["disk_write"] / max(bw.disk_write, 1.0)
        plan.copy_s = tr["h2d"] / max(bw.h2d, 1.0) + tr["d2h"] / max(bw.d2h, 1.0)
    return plan
