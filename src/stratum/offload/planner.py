"""The offload planner: chunk size × device-resident chunks × optimizer placement × prefetch depth × activations.

A bounded, exhaustive search over a small candidate grid (at most a few thousand cheap evaluations, never a
loop that can fail to end): every candidate is priced by the step model (:mod:`stratum.offload.step_model`:
device/host/disk peak bytes exactly as the engine allocates them, transfers from simulating OPT eviction, step
time from the profile and the bandwidths measured at start-up). Of the candidates that fit all budgets, those
predicted within TIE of the fastest count as equally fast (the model is not more precise than that); of those, the
ones also fastest on a slower disk (SLOW_DISK) stay, and the one moving the fewest bytes on the fastest tiers wins.
If none fits, the error names the smallest budget that would work. Once a candidate fits, the search stops after
MAX_EVALUATIONS candidates (the placement then says so); until then it goes on through the finite grid. The bound
counts work, not seconds, so a placement is the same on a busy machine as on an idle one.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from stratum.errors import StratumError
from stratum.ir.costs import Costs
from stratum.model.blockseq import BlockSeq
from stratum.offload.act_ring import RING
from stratum.offload.chunks import Layout, outliers, pack, param_order
from stratum.offload.grad_handoff import per_chunk
from stratum.offload.placement import ACTIVATIONS, SPILL, Placement
from stratum.offload.step_model import half_chunks, predict, predict_placement, slot_bytes
from stratum.offload.tiers import DEVICE, DISK, HOST, TIERS, Bandwidths, round_up
from stratum.units import fmt_at_least, fmt_bytes

PREFETCH_DEPTHS = (0, 1, 2, 4)
MAX_EVALUATIONS = 8_000
"""Candidates the search evaluates at most once one fits: a count, not seconds, so the chosen plan does not depend
on the machine's load. GPT small's whole grid is 4,000-6,500 candidates (under a second on one core), GPT-2 774M's
7,000-8,000 (6-10 s); a larger grid is cut here, at the same candidate on every machine."""
TIE = 0.01
"""Predicted step times within this fraction of the fastest are a tie, decided by traffic, then tiers: a step
predicted a microsecond faster with the parameters on disk must not beat one with everything on the device
(seen for a 2 ms step under a budget of ten times the training state)."""
SLOW_DISK = 0.5
"""Tied plans are first compared at this fraction of the probed disk bandwidths: a shared disk's rate moves by
more than a factor of two from one probe to the next, and a plan tied at a fast probe (less traffic, nothing
deferred) can be disk-bound at the disk's usual rate where one deferring updates is not (docs/offload.md)."""


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
                        n_micro: int, deferred: bool, n_params: int, bw: Bandwidths | None, staged: bool,
                        half: bool):
    """(activations, spilled blocks or None = all, of those the ones on disk) to try. Offload is tried three
    ways when the host budget is bounded: all blocks on the host; what the host holds there and the rest
    recomputed; what the host holds there (beside the disk ring's buffers) and the rest on disk. A pipeline
    rank (``staged``) spills every block's checkpoint to the host or none (Placement.inflight)."""
    if half:  # (the bytes of 16-bit chunks' blocks, and the host bytes of their placement)
        costs = costs.on_half_params()
    L = len(costs.spill_bytes)
    for rc in recs:
        if rc != SPILL or host_budget is None or staged:
            yield rc, None, frozenset()
            continue
        base, _, _, _, _ = predict(layout, R=0, opt=opt, ptier=ptier, k=0, acts=rc, costs=costs, bw=bw,
                                   n_micro=n_micro, deferred=deferred, n_params=n_params, spilled=frozenset(),
                                   half=half)
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


def _kept_options(acts: str, n_blocks: int, fixed: int | None, staged: bool) -> list[frozenset[int]]:
    """Placement.kept_blocks to try with spilled activations: the last 0, 1, 2, … blocks (bounded: a few sizes), or
    the last ``fixed``; none on a pipeline rank (``staged``: its stages' blocks interleave with other
    micro-batches', so no block's backward follows its forward)."""
    if acts != SPILL or staged:
        return [frozenset()]
    sizes = KEPT_SUFFIXES if fixed is None else (fixed,)
    return [frozenset(range(n_blocks - n, n_blocks)) for n in sizes if n < n_blocks]


def _deferral_options(layout: Layout, opt: str, ptier: str, deferred: bool, bw: Bandwidths | None,
                      half: bool = False) -> list[frozenset[int]]:
    """Sets of chunks whose update may run beside the next forward (Placement.deferred_chunks): none, and the first
    1/8 … 1/2 of the streamed chunks to complete their gradients. Only where updates otherwise run in the slot
    during the backward: a CPU, a host/disk optimizer, streamed parameters, no clipping, fp32 chunks (``half``:
    updates run on the host masters, never in a slot)."""
    if opt == DEVICE or ptier == DEVICE or deferred or half or (bw is not None and bw.async_copies):
        return [frozenset()]
    order = sorted((c.index for c in layout.chunks if not c.pinned), key=lambda i: -layout.ready_block[i])
    sets = {frozenset(order[:round(len(order) * f)]) for f in (0, 1 / 8, 1 / 4, 3 / 8, 1 / 2)}
    return sorted(sets, key=len)


def _chunk_candidates(seq: BlockSeq) -> list[int]:
    """Chunk sizes to try: from the largest streamed parameter up to an eighth of them all; where some parameters
    are outliers, also the sizes below them (the outliers then pinned, chunks.pack)."""
    tied = {g.owner for g in seq.tied}
    big = outliers(seq)
    every = [(n, p.numel()) for n, p in param_order(seq) if n not in tied]
    cands: set[int] = set()
    for params in {tuple(k for _, k in every), tuple(k for n, k in every if n not in big)}:
        if not params:
            continue
        biggest = max(params)
        total = sum(params)
        cands.add(biggest)
        for n in (2, 4, 8, 16, 32, 64, 128):
            cands.add(max(biggest, -(-total // n)))
        for f in (1.02, 1.1, 1.5, 2.0, 3.0):  # a little slack lets small params (norms, biases) share a big one's chunk
            cands.add(int(biggest * f))
    return sorted(cands) or [1]


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


@dataclass(frozen=True, kw_only=True)
class _Job:
    """What every candidate of one search shares: the model's costs, the budgets and the user's overrides."""

    seq: BlockSeq
    costs: Costs
    n_params: int
    n_micro: int
    deferred: bool
    bw: Bandwidths | None
    device_budget: int | None
    host_budget: int | None
    disk_free: int | None
    resident_chunks: int | None
    depths: list[int]
    kept_blocks: int | None
    inflight: tuple[int, ...]
    """Placement.inflight (empty: not a pipeline rank)."""
    precision: str
    """train.precision: bf16 places 16-bit chunks on the device where the tiers allow (``half_chunks``); fp16 only
    places 16-bit chunks (its loss scaling is built on them), its updates all after the backward (``deferred``:
    they wait for the overflow check)."""

    delayed: bool
    """offload.delayed_update: only the placements it runs on (16-bit chunks, masters and moments in host RAM)."""
    chunk_grads: bool
    """offload.grad_handoff resolved for this machine (``grad_handoff.per_chunk``): 16-bit placements hand their
    gradients to the host a chunk at a time (Placement.chunk_grads)."""

    def halves(self, opt: str, ptier: str) -> tuple[bool, ...]:
        """Placement.half_params to try with these tiers: 16-bit chunks where the tiers allow them (``half_chunks``;
        fp16: nothing else). Under bf16 with the parameters' home on disk fp32 chunks are tried too: their
        gradients go to disk, so the host holds no 16-bit copies of the masters and no fp32 gradient accumulators
        (6 bytes per parameter) — a host budget too small for those still trains. The delayed update runs on
        16-bit chunks with masters and moments in host RAM alone."""
        half = half_chunks(self.precision, opt, ptier)
        if self.delayed:
            return (True,) if half and opt == HOST and ptier != DISK else ()
        if self.precision == "fp16":
            return (True,) if half else ()
        return (True, False) if half and ptier == DISK else (half,)

    def chunks_down(self, half: bool) -> bool:
        """Placement.chunk_grads of a candidate with 16-bit chunks (``half``) or not."""
        return self.chunk_grads and half


@dataclass
class _Search:
    """The search's running state: every placement that fits, and the smallest peaks seen (for the error)."""

    fits: list[tuple[float, tuple, Placement]] = field(default_factory=list)
    """(predicted step, tie-break key, placement) of every candidate that fits."""
    layouts: dict[int, Layout] = field(default_factory=dict)
    """id of a fitting placement → the layout it was priced on (to predict tied placements again on a slower disk;
    one chunk size packs into several layouts, as the tier choices pin chunks)."""
    tried: int = 0
    cut: bool = False
    smallest: dict[str, int | None] = field(default_factory=lambda: {DEVICE: None, HOST: None})

    def note_peaks(self, peak: dict, ok: dict[str, bool]) -> None:
        """Keep the smallest device peak among candidates whose other tiers fit, and likewise for the host."""
        if ok[HOST] and ok[DISK] and (self.smallest[DEVICE] is None or peak[DEVICE] < self.smallest[DEVICE]):
            self.smallest[DEVICE] = peak[DEVICE]
        if ok[DEVICE] and ok[DISK] and (self.smallest[HOST] is None or peak[HOST] < self.smallest[HOST]):
            self.smallest[HOST] = peak[HOST]


@dataclass(frozen=True)
class _Tiers:
    """One candidate's tier choices before slots, prefetch and deferral: its layout, optimizer and parameter
    tiers, activations (with the spilled, disk-spilled and kept blocks)."""

    layout: Layout
    opt: str
    ptier: str
    acts: str
    spill_set: frozenset[int] | None
    disk_set: frozenset[int]
    kept: frozenset[int]
    half: bool
    """Placement.half_params (:meth:`_Job.halves`)."""


def _slot_options(job: _Job, t: _Tiers) -> list[int]:
    """Device chunk slots to try: the most the device budget allows (more slots never cost time), and the fewest."""
    n_stream = len(t.layout.streamable)
    if t.ptier == DEVICE:
        return [n_stream]
    if job.resident_chunks is not None:
        return [job.resident_chunks]
    need = max(t.layout.max_chunks_per_block(), 1)
    base, _, _, _, _ = predict(t.layout, R=0, opt=t.opt, ptier=t.ptier, k=0, acts=t.acts, costs=job.costs,
                               bw=job.bw, n_micro=job.n_micro, deferred=job.deferred, n_params=job.n_params,
                               spilled=t.spill_set, disk_spilled=t.disk_set, kept=t.kept, inflight=job.inflight,
                               half=t.half, chunk_grads=job.chunks_down(t.half))
    per = slot_bytes(t.layout.chunk_elems, t.opt, t.ptier, job.bw, t.half)
    rmax = n_stream if job.device_budget is None else (job.device_budget - base[DEVICE]) // per
    return sorted({need, max(need, min(rmax, n_stream))})


def _placement(job: _Job, t: _Tiers, R: int, k: int, late: frozenset[int], predicted: tuple) -> Placement:
    peak, tr, step, comp, act = predicted
    n_stream = len(t.layout.streamable)
    return Placement(
        chunk_elems=t.layout.chunk_elems, resident_chunks=R if t.ptier != DEVICE else n_stream,
        optimizer_tier=t.opt, param_tier=t.ptier, prefetch_depth=k, activations=t.acts,
        device_budget=job.device_budget,
        spill_blocks=None if t.spill_set is None else tuple(sorted(t.spill_set)),
        disk_spill_blocks=tuple(sorted(t.disk_set - t.kept)), kept_blocks=tuple(sorted(t.kept)),
        recomputes_some=t.spill_set is not None and bool(frozenset(range(len(job.seq))) - t.spill_set - t.kept),
        deferred_chunks=tuple(sorted(late)), host_budget=job.host_budget, n_chunks=len(t.layout.chunks),
        pinned_elems=sum(c.capacity for c in t.layout.chunks if c.pinned),
        inflight=job.inflight, half_params=t.half, chunk_grads=job.chunks_down(t.half),
        act_bytes=act, predicted_peak=peak, predicted_traffic=tr, predicted_step_s=step, compute_s=comp)


def _try_tiers(job: _Job, t: _Tiers, defer_options: list[frozenset[int]], search: _Search) -> float:
    """Price every slot count × prefetch depth × deferral of ``t``; the fastest fitting step (inf if none)."""
    here = float("inf")
    need = max(t.layout.max_chunks_per_block(), 1)
    for R, k, late in itertools.product(_slot_options(job, t), job.depths, defer_options):
        if R < need and t.ptier != DEVICE:
            continue
        # the bound applies once a plan fits (the grid is finite: the search ends anyway); cut before that, a
        # model would be refused a budget that fits
        if search.fits and search.tried >= MAX_EVALUATIONS:
            search.cut = True
            break
        search.tried += 1
        predicted = predict(t.layout, R=R, opt=t.opt, ptier=t.ptier, k=k, acts=t.acts, costs=job.costs, bw=job.bw,
                            n_micro=job.n_micro, deferred=job.deferred, n_params=job.n_params,
                            spilled=t.spill_set, disk_spilled=t.disk_set, deferred_chunks=late, kept=t.kept,
                            inflight=job.inflight, half=t.half, chunk_grads=job.chunks_down(t.half))
        peak, tr, step = predicted[0], predicted[1], predicted[2]
        ok = {DEVICE: job.device_budget is None or peak[DEVICE] <= job.device_budget,
              HOST: job.host_budget is None or peak[HOST] <= job.host_budget,
              DISK: job.disk_free is None or peak[DISK] <= job.disk_free}
        search.note_peaks(peak, ok)
        if not all(ok.values()):
            continue
        here = min(here, step)
        # ties (TIE): less traffic, faster tiers, then deeper prefetch (fetches ahead cost no memory: the slots
        # are the plan's, and a deeper queue absorbs the jitter a full-overlap prediction leaves out)
        key = (sum(tr.values()), TIERS.index(t.ptier), TIERS.index(t.opt), peak[DISK], peak[HOST], peak[DEVICE],
               -t.layout.chunk_elems, -k, step)
        placement = _placement(job, t, R, k, late, predicted)
        search.layouts[id(placement)] = t.layout
        search.fits.append((step, key, placement))
    return here


def _tier_options(job: _Job, layout: Layout, opts: list[str], recs: list[str]) -> Iterator[tuple[_Tiers, bool]]:
    """Every tier choice of ``layout``, kept-block suffixes innermost; with each, whether it starts a new run of
    kept-block suffixes (the search stops a run once keeping one more block stops shortening the step)."""
    n_stream = len(layout.streamable)
    for opt in opts:
        for ptier in (DEVICE, HOST, DISK):
            if ptier == DEVICE and job.resident_chunks is not None and job.resident_chunks < n_stream:
                continue
            for half in job.halves(opt, ptier):
                for rc, spill_set, disk_set in _activation_options(recs, job.host_budget, layout, opt, ptier,
                                                                   job.costs, job.n_micro, job.deferred, job.n_params,
                                                                   job.bw, bool(job.inflight), half):
                    for i, kept in enumerate(_kept_options(rc, len(job.seq), job.kept_blocks, bool(job.inflight))):
                        yield _Tiers(layout, opt, ptier, rc, spill_set, disk_set, kept, half), i == 0


class NoFit(StratumError):
    """No placement fits the budgets; ``smallest_device``: the smallest device budget that fits at this host
    budget, where one does (a pipeline's ranks compare theirs)."""

    def __init__(self, message: str, smallest_device: int | None):
        super().__init__(message)
        self.smallest_device = smallest_device


def _no_fit(search: _Search, device_budget: int | None, host_budget: int | None, overrides: list[str]) -> NoFit:
    """The error when no candidate fits: the smallest budgets that would (under the expert ``overrides`` given,
    named since they narrow the search)."""
    parts = []
    low_dev, low_host = search.smallest[DEVICE], search.smallest[HOST]
    if low_dev is not None:
        parts.append(f"the smallest offload.device_budget that works with this host budget is "
                     f"{fmt_at_least(low_dev, device_budget)} ({low_dev:,} bytes)")
    if low_host is not None and (low_dev is None or host_budget is not None):
        parts.append(f"the smallest offload.host_budget that works with this device budget is "
                     f"{fmt_at_least(low_host, host_budget)} ({low_host:,} bytes)")
    if not parts and overrides and device_budget is None and host_budget is None:
        parts.append("the budgets are unlimited: unset the overrides to let the planner choose")
    elif not parts:
        parts.append("no placement fits even with the largest chunks on disk; raise both budgets "
                     "or free disk space under offload.disk_dir")
    return NoFit(f"offload: no placement fits offload.device_budget = {fmt_bytes(device_budget)} and "
                 f"offload.host_budget = {fmt_bytes(host_budget)}"
                 + (f" (with {', '.join(overrides)} as given)" if overrides else "") + "; " + "; ".join(parts),
                 low_dev)


def _pick(job: _Job, search: _Search) -> Placement:
    """The chosen placement of a search with fits, its search figures and its predicted transfer seconds."""
    bw = job.bw
    slow_bw = None if bw is None else replace(bw, disk_read=bw.disk_read * SLOW_DISK,
                                              disk_write=bw.disk_write * SLOW_DISK)

    def on_slow_disk(p: Placement) -> float:
        return predict_placement(search.layouts[id(p)], p, costs=job.costs, bw=slow_bw, n_micro=job.n_micro,
                                 deferred=job.deferred, n_params=job.n_params)[2]
    plan = choose(search.fits, on_slow_disk if bw is not None else None)
    plan.candidates = search.tried
    plan.search_bound = MAX_EVALUATIONS if search.cut else None
    if bw is not None:
        tr = plan.predicted_traffic
        plan.disk_s = tr["disk_read"] / max(bw.disk_read, 1.0) + tr["disk_write"] / max(bw.disk_write, 1.0)
        plan.copy_s = tr["h2d"] / max(bw.h2d, 1.0) + tr["d2h"] / max(bw.d2h, 1.0)
    return plan


def make_placement(seq: BlockSeq, *, device_budget: int | None, host_budget: int | None, disk_free: int | None,
                   bandwidths: Bandwidths | None, profile=None, n_micro: int = 1, grad_clip: float = 0.0,
                   chunk_elems: int | None = None, resident_chunks: int | None = None,
                   optimizer_tier: str | None = None, prefetch_depth: int | None = None,
                   activations: str | None = None, kept_blocks: int | None = None,
                   inflight: tuple[int, ...] = (), precision: str = "fp32", grad_handoff: str = "auto",
                   delayed_update: bool = False) -> Placement:
    """The fastest predicted placement under the budgets; ``None`` arguments are the planner's to choose
    (``kept_blocks``: how many of the last blocks keep their activations on the device, Placement.kept_blocks).
    ``inflight``: on a pipeline rank, Placement.inflight (the profile's blocks are then stage_profile's).
    ``precision``: train.precision (bf16: 16-bit chunks on the device where the tiers allow, Placement.half_params;
    fp16: only such placements, every update after the backward). ``grad_handoff``: offload.grad_handoff (16-bit
    placements' gradients a chunk at a time — auto: where copies are asynchronous, unless the chunks' buffers
    leave no placement that fits — or a tensor at a time). ``delayed_update``: offload.delayed_update (only the
    placements it runs on)."""
    job = _Job(seq=seq, costs=Costs.blocks(profile) if profile is not None else Costs.zeros(len(seq)),
               n_params=sum(p.numel() for _, p in param_order(seq)), n_micro=n_micro,
               deferred=grad_clip > 0 or precision == "fp16",
               bw=bandwidths, device_budget=device_budget, host_budget=host_budget, disk_free=disk_free,
               resident_chunks=resident_chunks,
               depths=[prefetch_depth] if prefetch_depth is not None else list(PREFETCH_DEPTHS),
               kept_blocks=kept_blocks, inflight=tuple(inflight), precision=precision, delayed=delayed_update,
               chunk_grads=per_chunk(grad_handoff, bandwidths is not None and bandwidths.async_copies))
    opts = [optimizer_tier] if optimizer_tier else [DEVICE, HOST, DISK]
    recs = [activations] if activations is not None else list(ACTIVATIONS)
    search = _search(job, opts, recs, chunk_elems)
    if not search.fits and job.chunk_grads and grad_handoff == "auto":
        # the per-chunk hand-off's device buffers may be what does not fit: a tensor at a time needs none
        job = replace(job, chunk_grads=False)
        search = _search(job, opts, recs, chunk_elems)
    if not search.fits:
        given = {"offload.chunk_size": chunk_elems, "offload.resident_chunks": resident_chunks,
                 "offload.optimizer_tier": optimizer_tier, "offload.prefetch_depth": prefetch_depth,
                 "offload.activations": activations, "kept_blocks": kept_blocks}
        err = _no_fit(search, device_budget, host_budget, [k for k, v in given.items() if v is not None])
        if delayed_update:
            raise NoFit(f"{err}; offload.delayed_update keeps the fp32 masters and AdamW in host RAM (set it to "
                        "false for the other placements)", err.smallest_device)
        if precision == "fp16":  # (its candidates keep the optimizer state off the device: half_chunks)
            raise NoFit(f"{err}; train.precision = fp16 keeps the fp32 masters and AdamW off the device",
                        err.smallest_device)
        raise err
    return _pick(job, search)


def _search(job: _Job, opts: list[str], recs: list[str], chunk_elems: int | None) -> _Search:
    """Every candidate placement of ``job`` over chunk sizes, tiers, activation policies and deferrals."""
    search = _Search()
    for C in [chunk_elems] if chunk_elems else _chunk_candidates(job.seq):
        layout = pack(job.seq, C)
        before = stop_run = None  # the best step with one kept block fewer; the run of suffixes being skipped
        for t, first in _tier_options(job, layout, opts, recs):
            if first:
                before, stop_run = None, False
            if stop_run:
                continue
            defer = _deferral_options(layout, t.opt, t.ptier, job.deferred, job.bw, t.half)
            here = _try_tiers(job, t, defer, search)
            # more kept blocks take slots: stop once keeping one more stops shortening the step (keeps the search
            # short; GPT-2 774M has 36 candidate suffixes' worth of blocks)
            if before is not None and here >= before:
                stop_run = True
            before = here
    return search
