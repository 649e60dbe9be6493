"""Schedule generators: GPipe, 1F1B, interleaved 1F1B, Hanayo wave, and zero-bubble (split backward) variants.

Every generator takes ``ranks`` (P >= 1) and ``microbatches`` (m >= 1, also m < P) and returns a validated
:class:`Schedule`. Three construction methods are used:

- *Merge* (GPipe, 1F1B, interleaved): each rank has a forward order and a backward order; it runs ``warmup``
  forwards, then alternates one forward and one backward, then drains the backwards. GPipe is warmup = all.
  This reproduces the textbook (Megatron) schedules exactly, so their closed-form bubbles hold.
- *List scheduling* (zb-1f1b, and inside the wave generators; :mod:`stratum.schedule.list_schedule`): an event
  simulation with unit costs (F=1, B=2, I=1, W=1 per stage) in which a rank that falls idle picks among the
  actions whose inputs are ready. The order in which the actions ran is the schedule, so it is deadlock-free by
  construction, whatever the real costs.
- *Wave* (wave, zb-wave; see :func:`stratum.schedule.wave_order.capped_order`): Hanayo's zig-zag placement, ordered
by the same
  kind of event simulation under a cap on the stage activations a rank holds (interleaved v=2W's peak). The
  rule for the full-backward wave is *paced*: every action has a target time on an ideal timeline where
  micro-batch k enters at ``pace * k`` and rides its waves down, through the local turns and back; a free rank
  runs its ready action with the earliest target. With free messages this reaches the zig-zag's lower bound
  (docs/schedules.md; the same as interleaved's (P-1)/(vm+P-1) once m >= 2P) at every m <= 4P, P <= 8 for
  W=1, and for W=2 at m = P and every m >= 3P/2 there. A few pace / offset / tie
  parameters are tried (for W=2 also some with per-half-wave offsets, an admission rule and message delays
  in the steady state only, which leave slack for messages) and the order with the least makespan with free
  messages, then with messages costing
  ``NOMINAL_MSG`` of a rank's forward, is kept.
  zb-wave runs I in B's place, defers W to fill bubbles and keeps the candidate with the least regret over
  the two link models, within 1F1B's P micro-batches too; for W=1 only among the candidates no longer with
  free messages than the fill-first V order (:mod:`stratum.schedule.vfill`), which sits on the V's lower bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from stratum.errors import StratumError
from stratum.schedule.ir import Action, Schedule
from stratum.schedule.list_schedule import POLICIES, list_schedule
from stratum.schedule.validate import _deadlock, validate
from stratum.schedule.vfill import fill_first_order
from stratum.schedule.wave_order import WaveRule, capped_order
from stratum.sim.pipeline import Costs, simulate


def _check_pm(ranks: int, microbatches: int) -> None:
    if not isinstance(ranks, int) or ranks < 1:
        raise StratumError(f"ranks must be an integer >= 1, got {ranks!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise StratumError(f"microbatches must be an integer >= 1, got {microbatches!r}")


def _merge(f_orders: Sequence[Sequence[Action]], b_orders: Sequence[Sequence[Action]],
           warmups: Sequence[int]) -> list[list[Action]]:
    """Per rank: ``warmup`` forwards, then (F, B) pairs while forwards remain, then the remaining backwards."""
    out = []
    for fs, bs, w in zip(f_orders, b_orders, warmups):
        w = min(w, len(fs))
        acts = list(fs[:w])
        fi, bi = w, 0
        while fi < len(fs):
            acts.append(fs[fi])
            fi += 1
            acts.append(bs[bi])
            bi += 1
        acts.extend(bs[bi:])
        out.append(acts)
    return out


def gpipe(ranks: int, microbatches: int) -> Schedule:
    """GPipe: all forwards, then all backwards (latest micro-batch first). Rank r holds stage r."""
    _check_pm(ranks, microbatches)
    P, m = ranks, microbatches
    fs = [[Action("F", r, k) for k in range(m)] for r in range(P)]
    bs = [[Action("B", r, k) for k in reversed(range(m))] for r in range(P)]
    s = Schedule(name="gpipe", stage_to_rank=tuple(range(P)), num_microbatches=m,
                 actions=_merge(fs, bs, [m] * P))
    validate(s)
    return s


def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): rank r runs P-r-1 warm-up forwards, then alternates F and B, then drains."""
    _check_pm(ranks, microbatches)
    P, m = ranks, microbatches
    fs = [[Action("F", r, k) for k in range(m)] for r in range(P)]
    bs = [[Action("B", r, k) for k in range(m)] for r in range(P)]
    s = Schedule(name="1f1b", stage_to_rank=tuple(range(P)), num_microbatches=m,
                 actions=_merge(fs, bs, [P - r - 1 for r in range(P)]))
    validate(s)
    return s


def _virtual_order(m: int, v: int, group: int, reverse_chunks: bool) -> list[tuple[int, int]]:
    """Megatron's (chunk, mb) order: micro-batches in groups of ``group``; each group runs through every
    chunk before the next group starts. The last group may be smaller (m not a multiple of ``group``)."""
    order: list[tuple[int, int]] = []
    for g0 in range(0, m, group):
        mbs = range(g0, min(g0 + group, m))
        for c in range(v):
            cc = v - 1 - c if reverse_chunks else c
            order.extend((cc, k) for k in mbs)
    return order


def _smallest_safe_warmup(name: str, stage_to_rank: tuple[int, ...], m: int, f_orders, b_orders,
                          warmups: list[int]) -> Schedule:
    """Build the merged schedule, raising the warm-up of every rank by one until it cannot deadlock.

    The textbook warm-ups are deadlock-free when m is a multiple of P; for other m a partial group can need a
    longer warm-up. Warm-up = all forwards (GPipe-like) is always safe, so the loop ends.
    """
    n_f = [len(f) for f in f_orders]
    while True:
        s = Schedule(name=name, stage_to_rank=stage_to_rank, num_microbatches=m,
                     actions=_merge(f_orders, b_orders, warmups))
        try:
            _deadlock(s)
            validate(s)
            return s
        except StratumError:
            if all(w >= n for w, n in zip(warmups, n_f)):
                raise
            warmups = [min(w + 1, n) for w, n in zip(warmups, n_f)]


def interleaved(ranks: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron): ``virtual`` stages per rank, stage s on rank s % P.

    Rank r warms up with 2(P-r-1) + (v-1)P forwards (Megatron's count), then alternates. Micro-batches go
    through the chunks in groups of P; with m not a multiple of P the last group is smaller and the warm-up
    grows just enough to stay deadlock-free (the closed-form bubble then no longer holds exactly).
    """
    _check_pm(ranks, microbatches)
    if not isinstance(virtual, int) or virtual < 1:
        raise StratumError(f"virtual (stages per rank) must be an integer >= 1, got {virtual!r}")
    P, m, v = ranks, microbatches, virtual
    stage_to_rank = tuple(s % P for s in range(P * v))
    group = min(P, m)
    fs = [[Action("F", c * P + r, k) for c, k in _virtual_order(m, v, group, False)] for r in range(P)]
    bs = [[Action("B", c * P + r, k) for c, k in _virtual_order(m, v, group, True)] for r in range(P)]
    warm = [2 * (P - r - 1) + (v - 1) * group for r in range(P)]
    return _smallest_safe_warmup(f"interleaved-v{v}", stage_to_rank, m, fs, bs, warm)


# ---- list scheduling ----------------------------------------------------------------------------------------
def _fuse_backward(sched: Schedule, name: str) -> Schedule:
    """Turn a split schedule into a full-backward one: B where I was, W dropped. Still deadlock-free (B has
    exactly I's dependencies and nothing depends on W), and activations are freed earlier."""
    acts = [[Action("B", a.stage, a.mb) if a.kind == "I" else a for a in acts if a.kind != "W"]
            for acts in sched.actions]
    return Schedule(name=name, stage_to_rank=sched.stage_to_rank, num_microbatches=sched.num_microbatches,
                    actions=acts)


def _unit_sim(sched: Schedule, stages_per_rank: int) -> tuple[float, float]:
    """(makespan, max per-rank peak activation) under unit costs, activation 1 per rank-micro-batch."""
    res = simulate(sched, Costs.unit(sched.num_stages, stages_per_rank=stages_per_rank))
    return res.makespan, max(res.peak_act)


def _best_of(name: str, stage_to_rank: tuple[int, ...], m: int, *, split: bool, limit_sets: list[list[int]],
             f_key: Callable[[Action], tuple], mem_bound: float, stages_per_rank: int) -> Schedule:
    """Try a few list-scheduling policies and activation limits; keep the shortest unit-cost makespan whose
    peak activation stays within ``mem_bound`` (the one with the least memory if none does).

    No single greedy rule is best everywhere: preferring backwards keeps memory low but can lock ranks into
    GPipe-like bursts, preferring forwards keeps the waves moving; the unit-cost simulation arbitrates.
    """
    cands = []
    for limits in limit_sets:
        for policy in POLICIES:
            s = list_schedule(name, stage_to_rank, m, split=True, limits=limits, f_key=f_key, policy=policy)
            if not split:
                # Fusing a good split order often packs better than list-scheduling full backwards directly.
                cands.append(_fuse_backward(s, name))
                s = list_schedule(name, stage_to_rank, m, split=False, limits=limits, f_key=f_key, policy=policy)
            cands.append(s)
    scored = []
    for k, s in enumerate(cands):
        mk, peak = _unit_sim(s, stages_per_rank)
        scored.append((peak > mem_bound + 1e-9, mk if peak <= mem_bound + 1e-9 else peak, mk, k, s))
    best = min(scored, key=lambda x: x[:4])[-1]
    validate(best)
    return best


def zb_1f1b(ranks: int, microbatches: int) -> Schedule:
    """Zero-bubble 1F1B in the ZB-H1 style: backward split into I then W, W deferred to fill the bubbles, and
    no more activation memory than 1F1B (rank r holds at most P-r micro-batches, freed at W)."""
    _check_pm(ranks, microbatches)
    P, m = ranks, microbatches
    return _best_of("zb-1f1b", tuple(range(P)), m, split=True, limit_sets=[[P - r for r in range(P)]],
                    f_key=lambda a: (a.mb,), mem_bound=min(P, m), stages_per_rank=1)


def wave_stage_to_rank(ranks: int, waves: int) -> tuple[int, ...]:
    """Hanayo's zig-zag placement of S = 2*W*P stages: rank i holds stages i, 2P-1-i, 2P+i, 4P-1-i, ..."""
    P = ranks
    return tuple(s % P if (s // P) % 2 == 0 else P - 1 - s % P for s in range(2 * waves * P))


def _interleaved_peak(ranks: int, microbatches: int, v: int) -> float:
    """Peak activation (in full micro-batches per rank) of interleaved 1F1B with v stages per rank."""
    return _unit_sim(interleaved(ranks, microbatches, v), v)[1]


def _wave_key(a: Action) -> tuple:
    # Oldest micro-batch first, and within it the furthest stage: a micro-batch rides its wave down and back
    # up the ranks without waiting behind younger ones, so its backward (and the memory it frees) comes early.
    return (a.mb, -a.stage)


def _check_waves(waves: int) -> None:
    if not isinstance(waves, int) or waves < 1:
        raise StratumError(f"waves must be an integer >= 1, got {waves!r}")


NOMINAL_MSG = 0.2
"""Message cost, in units of one rank's forward time per micro-batch, that the wave generators also score their
candidates with (besides free messages), so the order they keep tolerates a real link."""


def _order_times(stage_to_rank: tuple[int, ...], order: list[list[Action]], msg: float) -> tuple[float, int]:
    """(makespan, max per-rank peak stage activations) of per-rank orders under the unit costs and a message
    delay ``msg``, with the simulator's semantics (an action starts when its rank is free and its inputs are
    there). The same numbers as :func:`stratum.sim.pipeline.simulate` with ``Costs.unit`` (times v), much faster."""
    cost = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    S, m = len(stage_to_rank), 1 + max(a.mb for o in order for a in o)
    never = math.inf
    f_end = [[never] * m for _ in range(S)]
    b_end = [[never] * m for _ in range(S)]          # B, or I when the order splits its backwards
    ptr = [0] * len(order)
    free = [0.0] * len(order)
    total = sum(len(o) for o in order)
    n = 0
    while n < total:
        progressed = False
        for r, acts in enumerate(order):
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                kind, s, k = a.kind, a.stage, a.mb
                deps: tuple[tuple[float, int], ...]
                if kind == "F":
                    deps = ((f_end[s - 1][k], s - 1),) if s > 0 else ()
                elif kind == "W":
                    deps = ((b_end[s][k], s),)
                else:
                    deps = ((f_end[s][k], s),) + (((b_end[s + 1][k], s + 1),) if s + 1 < S else ())
                start = free[r]
                for t, ds in deps:
                    x = t + (msg if stage_to_rank[ds] != r else 0.0)
                    if x > start:
                        start = x
                if start == never:
                    break
                free[r] = start + cost[kind]
                if kind == "F":
                    f_end[s][k] = free[r]
                elif kind != "W":
                    b_end[s][k] = free[r]
                ptr[r] += 1
                n += 1
                progressed = True
        if not progressed:
            raise StratumError("wave generator produced an order that cannot run")  # pragma: no cover
    return max(free), _order_peak(order)


def _order_peak(order: list[list[Action]]) -> int:
    """Max per-rank live stage activations: +1 at F, -1 at the action that frees it (W if split, else B)."""
    frees = "W" if any(a.kind == "I" for o in order for a in o) else "B"
    peak = 0
    for acts in order:
        cur = 0
        for a in acts:
            cur += 1 if a.kind == "F" else (-1 if a.kind == frees else 0)
            peak = max(peak, cur)
    return peak


# Rule parameters the wave generators try: (pace / v, b_off / (v/2), f_ties[, top - cap for zb-wave]) for
# the paced rule, and (rule, top - cap, reserve, f_ties, message slack?) for the older rules. Chosen by a
# greedy cover over P in 2..8, m in 1..4P, W in 1..2 (unit costs, free and realistic messages): this short
# list gives the same schedules as the full grid (3 paces x 5 offsets x 2 tie rules x 2 caps + 7 older rules
# x 5 caps x 2 slacks) there, at a tenth of the cost.
_WAVE_PACED = ((1.0, -1.0, True), (1.0, 0.0, True), (1.5, 0.0, True), (1.0, 2.0, False), (1.0, 2.0, True),
               (1.0, 0.0, False), (1.25, -2.0, False), (1.0, -1.0, False))
# W=2 only (v=4), in slots of one stage forward: (forward offset per half-wave, backward offset per
# half-wave, b_off, owed_slack, f_ties). The paced rule alone packs the four half-waves with no slack, so a
# 17%-of-a-forward message on any hop delays the whole steady state (realistic makespans 3-7% above
# interleaved v=4's); pulling the up-going half-waves' forwards earlier and admitting a new micro-batch only
# while the rank can still run the forwards it owes keeps the free-message makespan at the bound and leaves
# slack on the hops. Found by a seeded random search over these five knobs (P in {2,3,4,6,8}, m in {2P,4P});
# they help at P <= 4.
_WAVE2_LAGGED = (((2, -2, 2, -3), (-3, 2, -2, -3), 2, 6, True), ((0, -2, 0, -2), (0, -1, 1, 0), 0, None, True),
                 ((2, 0, 2, 1), (2, 3, -1, 3), 2, None, False))
# W=2 with message slack only in the steady state (see ``msg_window``): (window as fractions of the
# free-message lower bound, message delay in units of NOMINAL_MSG, then as above). Scheduling the steady
# state as if messages cost something, but not the warm-up and cool-down, keeps the bound and carries the
# win to P = 6, 8 (same search, also over the window and the delay).
_WAVE2_WINDOWED = (((0.15, 0.9), 0.42, (1, -2, -2, -2), (1, 2, -1, -1), 2, 16, True),
                   ((0.25, 0.75), 0.42, (), (), 0, 12, True), ((0.15, 0.85), 0.64, (), (), 0, None, True),
                   ((0.25, 0.75), 0.42, (), (), 2, None, False), ((0.15, 0.85), 0.42, (), (), 2, None, False),
                   ((0.3, 0.75), 0.3, (-1, 2, 2, 2), (2, 1, -1, -1), 6, 16, True))
_ZB_PACED = ((1.0, 2.0, True, 0), (1.25, -1.0, False, 0), (1.25, 4.0, False, 0), (1.25, -2.0, False, 1),
             (1.25, 0.0, False, 0), (1.5, 0.0, True, 1), (1.0, 2.0, False, 1), (1.25, 2.0, True, 0),
             (1.0, 0.0, False, 0))
_ZB_OLDER = (("deepest", 0, 1, True, 1), ("deepest", 0, 2, False, 1), ("b-first", 0, 0, False, 1),
             ("deepest", 0, 0, True, 0))


def _wave_grid(v: int, top: int, split: bool, span: float = 0.0) -> list[WaveRule]:
    """The candidate rule parameters of :func:`_wave` (see :func:`capped_order`); ``span`` is the
    free-message lower bound in slots, which the W=2 message windows are fractions of."""
    if not split:
        out = [WaveRule(rule="paced", cap=top, pace=p * v, b_off=o * v / 2, f_ties=ft) for p, o, ft in _WAVE_PACED]
        if v == 4:
            out += [WaveRule(rule="paced", cap=top, pace=v, wave_f=wf, wave_b=wb, b_off=o, owed_slack=sl, f_ties=ft)
                    for wf, wb, o, sl, ft in _WAVE2_LAGGED]
            out += [WaveRule(rule="paced", cap=top, pace=v, wave_f=wf, wave_b=wb, b_off=o, owed_slack=sl, f_ties=ft,
                         msg=d * NOMINAL_MSG * v, msg_window=(a * span, b * span))
                    for (a, b), d, wf, wb, o, sl, ft in _WAVE2_WINDOWED]
        return out
    out = [WaveRule(rule="paced", cap=max(1, top - j), pace=p * v, b_off=o * v / 2, f_ties=ft)
           for p, o, ft, j in _ZB_PACED]
    out += [WaveRule(rule=rule, cap=max(1, top - j), reserve=res, f_ties=ft, msg=NOMINAL_MSG * v * slack)
            for rule, j, res, ft, slack in _ZB_OLDER]
    return out


def _zb_bound(P: int, m: int, v: int) -> float:
    """zb-wave's activation bound in micro-batches: min(interleaved v's peak, 1F1B's P). For m >= P it is P:
    interleaved's rank 0 starts min(2(P-1) + (v-1)P + 1, vm) forwards of 1/v micro-batch before its first
    backward ends (its warm-up only grows), both counts >= vP, so only m < P needs interleaved's schedule."""
    return float(P) if m >= P else min(_interleaved_peak(P, m, v), float(P))


def _free_scores(s2r: tuple[int, ...], orders: list, top: int) -> list[tuple]:
    """(over the activation bound, free-message makespan, peak, idx, order) of every order that exists; those
    within the bound, or all of them if none is."""
    scored = []
    for idx, order in enumerate(orders):
        if order is not None:
            mk0, peak = _order_times(s2r, order, 0.0)
            scored.append((peak > top, round(mk0, 9), peak, idx, order))
    return [x for x in scored if not x[0]] or scored


def _with_msg(s2r: tuple[int, ...], fits: list[tuple], v: int) -> list[tuple]:
    """(free-message makespan, NOMINAL_MSG makespan, peak, idx, order) of scored orders."""
    return [(x[1], round(_order_times(s2r, x[4], NOMINAL_MSG * v)[0], 9), x[2], x[3], x[4]) for x in fits]


def _least_regret(scored: list[tuple]) -> list[list[Action]]:
    """zb-wave's pick among :func:`_with_msg` scores: the least regret over the two link models (its W fillers
    trade free-message packing for slack on the links)."""
    b0, b1 = min(x[0] for x in scored), min(x[1] for x in scored)
    return min(scored, key=lambda x: (round(max(x[0] / b0, x[1] / b1), 9), x[0] + x[1], x[2], x[3]))[-1]


def _wave(name: str, ranks: int, microbatches: int, waves: int, split: bool) -> Schedule:
    """Orders from :func:`capped_order` over a short list of rule parameters; keep, among those within
    the activation bound (interleaved v=2W's peak; for zb-wave also 1F1B's P micro-batches), for the wave the
    smallest unit-cost makespan with free messages, then with messages costing ``NOMINAL_MSG`` of a rank's
    forward; for zb-wave the least regret over those two link models among the orders no longer with free
    messages than the fill-first V order (:mod:`stratum.schedule.vfill`, W = 1: never longer than torch's ZBV);
    deadlock-free by construction, validated."""
    _check_pm(ranks, microbatches)
    _check_waves(waves)
    P, m, v = ranks, microbatches, 2 * waves
    s2r = wave_stage_to_rank(P, waves)
    bound = _zb_bound(P, m, v) if split else _interleaved_peak(P, m, v)
    top = max(1, int(bound * v + 1e-9))               # stage activations of 1/v micro-batch each
    grid = _wave_grid(v, top, split, span=3 * v * m + 3 * (P - 1))
    orders = [capped_order(s2r, m, split=split, rule=rule) for rule in grid]
    if not split:
        # With m close to P the step is all warm-up and cool-down; there, admitting whole micro-batches
        # oldest-first (scheduled with split backwards, then fused) packs tighter than the paced rule at W=2
        # (it reaches the m = P bound of docs/schedules.md, the paced rule ends a quarter forward later).
        sc = _fuse_backward(list_schedule(name, s2r, m, split=True, limits=[P] * P, f_key=_wave_key,
                                           policy="b-first"), name)
        orders.append([list(a) for a in sc.actions])
    elif waves == 1:
        orders.append(fill_first_order(s2r, m, top))
    fits = _free_scores(s2r, orders, top)
    if split:
        # W=1: the fill-first order (index len(grid)) is the floor no pick may exceed with free messages
        floor = min([x[1] for x in fits if waves == 1 and x[3] == len(grid)], default=math.inf)
        best = _least_regret(_with_msg(s2r, [x for x in fits if x[1] <= floor] or fits, v))
    else:
        shortest = min(x[1] for x in fits)
        best = min(_with_msg(s2r, [x for x in fits if x[1] == shortest], v), key=lambda x: x[:4])[-1]
    s = Schedule(name=name, stage_to_rank=s2r, num_microbatches=m, actions=best)
    validate(s)
    return s


def wave(ranks: int, microbatches: int, waves: int = 1) -> Schedule:
    """Hanayo wave schedule: S = 2*W*P stages zig-zagged over the ranks, forward waves down and up the ranks,
    backward waves in reverse, driven by the deepest-stage-first wave rule under an activation cap: never more
    peak activation than interleaved 1F1B with v = 2W. The turn of each wave stays on one rank (no message)."""
    return _wave(f"wave-w{waves}", ranks, microbatches, waves, split=False)


def zb_wave(ranks: int, microbatches: int, waves: int = 1) -> Schedule:
    """The wave schedule with the backward split into I and W (ZB-style): I takes B's place in the wave rule, W
    is deferred and runs only when the rank has no ready F or I (it fills the bubbles); activations are freed at
    W and peak activation stays within 1F1B's (P micro-batches) and interleaved v=2W's."""
    return _wave(f"zb-wave-w{waves}", ranks, microbatches, waves, split=True)


KINDS = ("gpipe", "1f1b", "interleaved", "wave", "zb-1f1b", "zb-wave")
"""Generator names accepted by :func:`generate` and the CLI's ``--kind``."""
TORCH_PREFIX = "torch:"
"""``torch:NAME`` names a schedule class of torch.distributed.pipelining (:mod:`stratum.schedule.torch_import`)."""


def is_kind(kind: str) -> bool:
    """True when :func:`generate` knows ``kind``: one of :data:`KINDS` or ``torch:NAME``."""
    return kind in KINDS or kind.startswith(TORCH_PREFIX)


SEARCHED = ("zb-1f1b", "wave", "zb-wave")
"""Kinds whose generator simulates several candidate orders and keeps the best: slower per action than the
closed-form kinds."""


def size_knob(kind: str) -> str | None:
    """The knob that multiplies the size of a schedule of ``kind`` beyond ranks × micro-batches: ``"virtual"``
    (interleaved, torch's classes), ``"waves"`` (wave, zb-wave) or ``None``. A size cap counts only this knob,
    never one the kind ignores."""
    if kind == "interleaved" or kind.startswith(TORCH_PREFIX):
        return "virtual"
    if kind in ("wave", "zb-wave"):
        return "waves"
    return None


def _torch_schedule(name: str, ranks: int, microbatches: int, virtual: int) -> Schedule:
    # torch.distributed.pipelining takes seconds to import; only the torch: kinds pay for it
    from stratum.schedule.torch_import import from_torch

    _check_pm(ranks, microbatches)
    if not isinstance(virtual, int) or virtual < 1:
        raise StratumError(f"virtual (stages per rank) must be an integer >= 1, got {virtual!r}")
    return from_torch(name, ranks=ranks, microbatches=microbatches, virtual=virtual)


def generate(kind: str, *, ranks: int, microbatches: int, virtual: int = 2, waves: int = 1) -> Schedule:
    """Build a schedule by name (one of :data:`KINDS`, or ``torch:NAME``); ``virtual`` is for interleaved and
    torch's multi-stage classes, ``waves`` for wave."""
    if kind.startswith(TORCH_PREFIX):
        return _torch_schedule(kind[len(TORCH_PREFIX):], ranks, microbatches, virtual)
    if kind == "gpipe":
        return gpipe(ranks, microbatches)
    if kind == "1f1b":
        return one_f_one_b(ranks, microbatches)
    if kind == "interleaved":
        return interleaved(ranks, microbatches, virtual)
    if kind == "wave":
        return wave(ranks, microbatches, waves)
    if kind == "zb-1f1b":
        return zb_1f1b(ranks, microbatches)
    if kind == "zb-wave":
        return zb_wave(ranks, microbatches, waves)
    raise StratumError(f"unknown schedule kind {kind!r}; choose one of {', '.join(KINDS)} or torch:NAME "
                       "(a torch.distributed.pipelining schedule, e.g. torch:ZBVZeroBubble)")
