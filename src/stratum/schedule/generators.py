"""Schedule generators: GPipe, 1F1B, interleaved 1F1B, Hanayo wave, and zero-bubble (split backward) variants.

Every generator takes ``ranks`` (P >= 1) and ``microbatches`` (m >= 1, also m < P) and returns a validated
:class:`Schedule`. Three construction methods are used:

- *Merge* (GPipe, 1F1B, interleaved): each rank has a forward order and a backward order; it runs ``warmup``
  forwards, then alternates one forward and one backward, then drains the backwards. GPipe is warmup = all.
  This reproduces the textbook (Megatron) schedules exactly, so their closed-form bubbles hold.
- *List scheduling* (zb-1f1b, and inside the wave generators): an event simulation with unit costs (F=1, B=2,
  I=1, W=1 per stage) in which a rank that falls idle picks among the actions whose inputs are ready. The order
  in which the actions ran is the schedule, so it is deadlock-free by construction, whatever the real costs.
- *Wave* (wave, zb-wave; see :func:`_capped_list_schedule`): Hanayo's zig-zag placement, ordered by the same
  kind of event simulation under a cap on the stage activations a rank holds (interleaved v=2W's peak). The
  rule for the full-backward wave is *paced*: every action has a target time on an ideal timeline where
  micro-batch k enters at ``pace * k`` and rides its waves down, through the local turns and back; a free rank
  runs its ready action with the earliest target. With free messages this reaches the zig-zag's lower bound
  (docs/schedules.md; the same as interleaved's (P-1)/(vm+P-1) once m >= 2P) at every m <= 4P, P <= 8 for
  W=1, and for W=2 at m = P and every m >= 3P/2 there. A few pace / offset / tie
  parameters are tried (for W=2 also some with per-half-wave offsets, an admission rule and message delays
  in the steady state only, which leave slack for messages) and the order with the least makespan with free messages, then with messages costing
  ``NOMINAL_MSG`` of a rank's forward, is kept.
  zb-wave runs I in B's place, defers W to fill bubbles and keeps the candidate with the least regret over
  the two link models, within 1F1B's P micro-batches too; for W=1 only among the candidates no longer with
  free messages than the fill-first V order (:mod:`stratum.schedule.vfill`), which sits on the V's lower bound.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from stratum.errors import StratumError
from stratum.schedule.ir import Action, Schedule
from stratum.schedule.validate import _deadlock, validate
from stratum.schedule.vfill import fill_first_order


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
UNIT_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
POLICIES = ("b-first", "f-first", "alternate")
"""When a rank is free: ``b-first`` runs a ready backward before a forward; ``f-first`` a forward (within the
activation limit) before a backward; ``alternate`` switches kind after each backward. W always comes last."""


def _list_schedule(name: str, stage_to_rank: tuple[int, ...], m: int, *, split: bool, limits: Sequence[int],
                   f_key: Callable[[Action], tuple], cost: dict[str, float] | None = None,
                   policy: str = "b-first") -> Schedule:
    """Greedy list scheduling (see the module docstring).

    ``limits[r]`` bounds the micro-batches rank r holds activations for: a micro-batch is admitted by its F
    on the rank's first stage and released when its last B (or W) on the rank has been issued. Counting whole
    micro-batches rather than stage activations keeps a rank from spending its budget on first-stage
    forwards of new micro-batches while the later stages of admitted ones wait (which stalls the pipeline).
    """
    cost = cost or UNIT_COST
    S, P = len(stage_to_rank), max(stage_to_rank) + 1
    bk = "I" if split else "B"
    pending_f = [sorted((Action("F", s, k) for s in range(S) if stage_to_rank[s] == r for k in range(m)),
                        key=f_key) for r in range(P)]
    pending_b: list[list[Action]] = [[] for _ in range(P)]   # backwards whose stage forward has been issued
    pending_w: list[list[Action]] = [[] for _ in range(P)]   # weight grads whose I has been issued
    done_at: dict[Action, float] = {}
    first_stage = [min(s for s in range(S) if stage_to_rank[s] == r) for r in range(P)]
    n_local = [sum(1 for s in range(S) if stage_to_rank[s] == r) for r in range(P)]
    live = [0] * P                      # admitted micro-batches per rank
    released: dict[tuple[int, int], int] = {}   # (rank, mb) -> stages whose activation is freed
    busy_until = [0.0] * P
    order: list[list[Action]] = [[] for _ in range(P)]
    total = S * m * (3 if split else 2)
    n_issued, t = 0, 0.0

    def ready(a: Action) -> bool:
        s, k = a.stage, a.mb
        if a.kind == "F":
            return s == 0 or done_at.get(Action("F", s - 1, k), float("inf")) <= t
        need = [Action("F", s, k)] + ([Action(bk, s + 1, k)] if s + 1 < S else [])
        return all(done_at.get(d, float("inf")) <= t for d in need)

    def issue(r: int, a: Action) -> None:
        nonlocal n_issued
        order[r].append(a)
        done_at[a] = t + cost[a.kind]
        busy_until[r] = t + cost[a.kind]
        n_issued += 1
        if a.kind == "F":
            live[r] += a.stage == first_stage[r]
            pending_b[r].append(Action(bk, a.stage, a.mb))
        elif a.kind == "I":
            pending_w[r].append(Action("W", a.stage, a.mb))
        if a.kind in "BW":
            n = released[(r, a.mb)] = released.get((r, a.mb), 0) + 1
            live[r] -= n == n_local[r]

    def next_f(r: int, force: bool) -> Action | None:
        for i, a in enumerate(pending_f[r]):
            if ready(a) and (a.stage != first_stage[r] or live[r] < limits[r] or force):
                return pending_f[r].pop(i)
        return None

    def pick(r: int, force: bool) -> Action | None:
        bs = [a for a in pending_b[r] if ready(a)]
        if policy == "f-first" or (policy == "alternate" and order[r] and order[r][-1].kind != "F"):
            f = next_f(r, force)
            if f is not None:
                return f
        if bs:
            # Smallest micro-batch, then the later stage: the one the ranks upstream are waiting on.
            a = min(bs, key=lambda a: (a.mb, -a.stage))
            pending_b[r].remove(a)
            return a
        f = next_f(r, force)
        if f is not None:
            return f
        if pending_w[r]:
            return pending_w[r].pop(0)
        return None

    while n_issued < total:
        started = False
        for r in range(P):
            if busy_until[r] <= t:
                a = pick(r, force=False)
                if a is not None:
                    issue(r, a)
                    started = True
        future = [b for b in busy_until if b > t]
        if future:
            t = min(future)
        elif not started:
            # Every rank idle and blocked only by its activation limit: let the first rank with a ready
            # forward exceed it, so the generator always terminates (the schedule just uses more memory).
            for r in range(P):
                a = pick(r, force=True)
                if a is not None:
                    issue(r, a)
                    break
            else:  # pragma: no cover - impossible: some F or some backward is always ready
                raise RuntimeError("list scheduler stuck")
            t = min(b for b in busy_until if b > t)
    return Schedule(name=name, stage_to_rank=stage_to_rank, num_microbatches=m, actions=order)


def _fuse_backward(sched: Schedule, name: str) -> Schedule:
    """Turn a split schedule into a full-backward one: B where I was, W dropped. Still deadlock-free (B has
    exactly I's dependencies and nothing depends on W), and activations are freed earlier."""
    acts = [[Action("B", a.stage, a.mb) if a.kind == "I" else a for a in acts if a.kind != "W"]
            for acts in sched.actions]
    return Schedule(name=name, stage_to_rank=sched.stage_to_rank, num_microbatches=sched.num_microbatches,
                    actions=acts)


def _unit_sim(sched: Schedule, stages_per_rank: int) -> tuple[float, float]:
    """(makespan, max per-rank peak activation) under unit costs, activation 1 per rank-micro-batch."""
    from stratum.sim.pipeline import Costs, simulate  # local: stratum.sim imports this package

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
            s = _list_schedule(name, stage_to_rank, m, split=True, limits=limits, f_key=f_key, policy=policy)
            if not split:
                # Fusing a good split order often packs better than list-scheduling full backwards directly.
                cands.append(_fuse_backward(s, name))
                s = _list_schedule(name, stage_to_rank, m, split=False, limits=limits, f_key=f_key, policy=policy)
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


def _capped_list_schedule(stage_to_rank: tuple[int, ...], m: int, *, split: bool, cap: int, reserve: int = 0,
                          msg: float = 0.0, rule: str = "deepest", f_ties: bool = False, pace: float = 0.0,
                          b_off: float = 0.0, wave_f: Sequence[float] = (), wave_b: Sequence[float] = (),
                          owed_slack: int | None = None,
                          msg_window: tuple[float, float] | None = None) -> list[list[Action]] | None:
    """The wave's order: an event simulation of the zig-zag pipeline under a per-rank activation cap.

    Unit costs per stage action (F=1, B=2, I=W=1) and a message delay ``msg`` between stages on different ranks
    (0 = free; > 0 leaves the slack a real link needs; with ``msg_window`` only for results produced in that
    time window, so that the warm-up and the cool-down stay packed as with free messages while the steady
    state in between keeps slack on its hops). When a rank is free it starts the ready action that
    comes first under ``rule``:

    - ``"paced"`` (the wave rule): each action has a target time on an ideal timeline in which micro-batch k
      enters at ``pace * k`` and rides straight through the forward waves and back (F of stage s at s, its
      backward ``b_off`` after the last forward, one backward cost per stage on the way back); the earliest
      target runs first, a backward winning a tie unless ``f_ties``. With pace = v (a rank's forward work per
      micro-batch) the warm-up fills each rank with forwards up to the cap, which is what lets the rank holding
      the middle turn (the one with no slack at the lower bound) stay busy until its first backward comes
      back; afterwards the targets interleave forwards and backwards so that each backward wave keeps moving.
      ``wave_f`` / ``wave_b`` shift the targets of the forwards / backwards on each half-wave (stages
      [jP, (j+1)P)), which moves slack onto the hops between ranks;
    - ``"deepest"``: the action of the deepest stage first, forward or backward, then the oldest micro-batch;
    - ``"b-first"``: any ready backward (deepest first), else the deepest ready forward.

    A forward needs the rank to hold fewer than ``cap`` stage activations (``cap - reserve`` for a new
    micro-batch entering the rank's first stage, which keeps room for the ones already inside; with
    ``owed_slack`` also only while live activations plus the forwards the rank still owes its admitted
    micro-batches stay below ``cap + owed_slack``, so that their later waves are not locked out); with nothing
    else to do a rank runs a deferred weight gradient W (oldest first). The order in which actions ran is the
    schedule (deadlock-free whatever the real costs). Returns per-rank action lists, or None if the cap starves
    the pipeline. Heaps of ready actions keep this O(n log n): a few ms for P=8, m=32.
    """
    S, P = len(stage_to_rank), max(stage_to_rank) + 1
    bk = "I" if split else "B"
    cost = {"F": 1.0, bk: 1.0 if split else 2.0, "W": 1.0}
    eps = 1e-9
    first = [min(s for s in range(S) if stage_to_rank[s] == r) for r in range(P)]
    bc = cost[bk]
    n_local = [sum(1 for x in stage_to_rank if x == r) for r in range(P)]
    owed = [0] * P      # forwards this rank still has to run for the micro-batches it has admitted
    admit_room = math.inf if owed_slack is None else owed_slack

    def in_window(x: float) -> bool:
        return msg_window is None or msg_window[0] <= x <= msg_window[1]

    def prio(kind: str, s: int, k: int) -> tuple:
        is_f = kind == "F"
        if rule == "paced":
            w = s // P   # which half-wave (down, up, down, ...) the stage is on
            target = (s + (wave_f[w] if wave_f else 0.0) if is_f else
                      S + b_off + bc * (S - 1 - s) + (wave_b[w] if wave_b else 0.0)) + pace * k
            return (target, is_f != f_ties, -s, k)
        if rule == "b-first":
            return (is_f, -s, k)
        return (-s, is_f != f_ties, k)

    # ready[r]: [backwards, forwards into a later stage, forwards into the rank's first stage]
    ready: list[list[list[tuple]]] = [[[], [], []] for _ in range(P)]
    need: dict[tuple[int, int], int] = {}   # backward of (stage, mb): inputs still missing
    pend_w: list[list[tuple[int, int]]] = [[] for _ in range(P)]
    live = [0] * P
    free = [0.0] * P
    order: list[list[Action]] = [[] for _ in range(P)]
    events: list[tuple[float, int, str, int, int]] = []   # (time, seq, what became ready, stage, mb)
    seq = 0
    for k in range(m):
        heapq.heappush(ready[stage_to_rank[0]][2], (prio("F", 0, k), "F", 0, k))

    def make_ready(kind: str, s: int, k: int) -> None:
        r = stage_to_rank[s]
        if kind == "F":
            heapq.heappush(ready[r][2 if s == first[r] else 1], (prio("F", s, k), "F", s, k))
            return
        n = need.get((s, k), 1 if s == S - 1 else 2) - 1
        need[(s, k)] = n
        if n == 0:
            heapq.heappush(ready[r][0], (prio(bk, s, k), bk, s, k))

    t, n_done, total = 0.0, 0, S * m * (3 if split else 2)
    while n_done < total:
        for r in range(P):
            if free[r] > t + eps:
                continue
            rb, rf, rf0 = ready[r]
            best, src = None, None
            if rb:
                best, src = rb[0], rb
            if rf and live[r] < cap and (best is None or rf[0] < best):
                best, src = rf[0], rf
            if rf0 and live[r] < cap - reserve and live[r] + owed[r] < cap + admit_room and \
                    (best is None or rf0[0] < best):
                best, src = rf0[0], rf0
            if best is not None:
                assert src is not None
                heapq.heappop(src)
                _, kind, s, k = best
            elif pend_w[r]:
                kind, (s, k) = "W", pend_w[r].pop(0)
            else:
                continue
            end = t + cost[kind]
            free[r] = end
            n_done += 1
            order[r].append(Action(kind, s, k))
            seq += 1
            heapq.heappush(events, (end, seq, "", r, 0))   # the rank is free again
            if kind == "F":
                live[r] += 1
                owed[r] += n_local[r] - 1 if s == first[r] else -1
                seq += 1
                heapq.heappush(events, (end, seq, bk, s, k))          # its own backward has its activation
                if s + 1 < S:
                    d = msg if stage_to_rank[s + 1] != r and in_window(end) else 0.0
                    seq += 1
                    heapq.heappush(events, (end + d, seq, "F", s + 1, k))
            elif kind == bk:
                if split:
                    pend_w[r].append((s, k))
                else:
                    live[r] -= 1
                if s > 0:
                    d = msg if stage_to_rank[s - 1] != r and in_window(end) else 0.0
                    seq += 1
                    heapq.heappush(events, (end + d, seq, bk, s - 1, k))
            else:
                live[r] -= 1
        if not events:
            return None
        t = max(t, events[0][0])
        while events and events[0][0] <= t + eps:
            _, _, kind, s, k = heapq.heappop(events)
            if kind:
                make_ready(kind, s, k)
    return order


def _order_times(stage_to_rank: tuple[int, ...], order: list[list[Action]], msg: float) -> tuple[float, int]:
    """(makespan, max per-rank peak stage activations) of per-rank orders under the unit costs and a message
    delay ``msg``, with the simulator's semantics (an action starts when its rank is free and its inputs are
    there). The same numbers as :func:`stratum.sim.simulate` with ``Costs.unit`` (times v), much faster."""
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


def _wave_grid(v: int, top: int, split: bool, span: float = 0.0) -> list[dict]:
    """The candidate rule parameters of :func:`_wave` (see :func:`_capped_list_schedule`); ``span`` is the
    free-message lower bound in slots, which the W=2 message windows are fractions of."""
    if not split:
        out = [dict(rule="paced", cap=top, pace=p * v, b_off=o * v / 2, f_ties=ft) for p, o, ft in _WAVE_PACED]
        if v == 4:
            out += [dict(rule="paced", cap=top, pace=v, wave_f=wf, wave_b=wb, b_off=o, owed_slack=sl, f_ties=ft)
                    for wf, wb, o, sl, ft in _WAVE2_LAGGED]
            out += [dict(rule="paced", cap=top, pace=v, wave_f=wf, wave_b=wb, b_off=o, owed_slack=sl, f_ties=ft,
                         msg=d * NOMINAL_MSG * v, msg_window=(a * span, b * span))
                    for (a, b), d, wf, wb, o, sl, ft in _WAVE2_WINDOWED]
        return out
    out = [dict(rule="paced", cap=max(1, top - j), pace=p * v, b_off=o * v / 2, f_ties=ft)
           for p, o, ft, j in _ZB_PACED]
    out += [dict(rule=rule, cap=max(1, top - j), reserve=res, f_ties=ft, msg=NOMINAL_MSG * v * slack)
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
    """Orders from :func:`_capped_list_schedule` over a short list of rule parameters; keep, among those within
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
    orders = [_capped_list_schedule(s2r, m, split=split, **kw) for kw in grid]
    if not split:
        # With m close to P the step is all warm-up and cool-down; there, admitting whole micro-batches
        # oldest-first (scheduled with split backwards, then fused) packs tighter than the paced rule at W=2
        # (it reaches the m = P bound of docs/schedules.md, the paced rule ends a quarter forward later).
        sc = _fuse_backward(_list_schedule(name, s2r, m, split=True, limits=[P] * P, f_key=_wave_key,
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
