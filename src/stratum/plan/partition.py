"""Cut a BlockSeq into pipeline stages — the one partitioner module: even cuts, weight-balanced cuts, and the
profiled cut that balances time over ranks under per-rank memory limits.

Input: a :class:`~stratum.profile.Profile` (per-block ``fwd_s``, ``bwd_s``, parameter/gradient/optimizer bytes,
``act_saved_bytes``), a stage→rank map (``Schedule.stage_to_rank``: one stage per rank for GPipe/1F1B, several
for interleaved and wave), optional relative rank speeds (mixed hardware, Whale-style: ``[1.0, 2.0]`` = rank 1
runs a block in half the time) and optional per-rank memory limits in bytes.

Model (per micro-batch):

- a stage's compute time is the sum of its blocks' ``fwd_s + bwd_s``; a rank's time is the sum over its stages
  divided by its speed. The **bottleneck** is the largest rank time: in a pipeline's steady state every rank
  does its share once per micro-batch, so the slowest rank sets the pace.
- a rank's memory is, over its stages, ``param + grad + optim`` bytes of the blocks plus
  ``act_saved_bytes × inflight[stage]``: the activations of the micro-batches a stage holds at once.
  ``inflight`` comes from the schedule (:func:`inflight_from_schedule`: per-stage peak count in a unit-cost
  simulation; summing per-stage peaks over-estimates a rank's peak when its stages peak at different times,
  so the check is conservative) or is given: ``P`` for every stage is 1F1B's worst rank.

Method: dynamic programming over the contiguous cuts, stage by stage (``best[s][j]`` = the states reachable
with the first ``s`` stages covering blocks ``0..j-1``). A state holds the worst time of the ranks whose stages
are all placed, and the accumulated time and memory of the ranks that still get stages later ("open" ranks).
For one stage per rank no rank stays open and the DP is the classic exact min-max cut. With several stages per
rank the state keeps the Pareto front of (worst closed time, open ranks' times and memories); that is still
exact; states that already exceed a known solution (the heuristic below) are pruned. If a front still grows
past ``beam`` states the exact search stops and the heuristic's cut is returned with ``exact=False``. The
heuristic: give every stage an equal share of its rank's time (exact min-max DP over stages, each weighted by
its rank's stage count and speed), then move single stage boundaries while that lowers the bottleneck.

When no cut fits the memory limits the same DP, with memory as the objective, finds the smallest per-rank
limit that any contiguous cut can meet, and the error names it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from stratum.errors import StratumError
from stratum.ir.costs import Costs
from stratum.profile.profile import Profile
from stratum.schedule.ir import Schedule
from stratum.sim.pipeline import simulate

DEFAULT_BEAM = 64


# ---- cuts without a profile: equal block counts, or weights (parameter counts) over ranks of given speeds ----
def even_partition(num_blocks: int, num_stages: int) -> list[range]:
    """Split ``num_blocks`` blocks into ``num_stages`` contiguous ranges whose sizes differ by at most one."""
    if num_stages < 1 or num_stages > num_blocks:
        raise StratumError(f"cannot cut {num_blocks} blocks into {num_stages} non-empty stages")
    q, rem = divmod(num_blocks, num_stages)
    out, a = [], 0
    for s in range(num_stages):
        n = q + (1 if s < rem else 0)
        out.append(range(a, a + n))
        a += n
    return out


def balanced_partition(weights: list[float], num_stages: int, speeds: list[float] | None = None) -> list[range]:
    """Contiguous cut of blocks with ``weights`` into ``num_stages`` non-empty stages minimising the heaviest
    stage's weight divided by its ``speeds`` entry (all 1 by default; dynamic programming, ties go to the
    earliest cut)."""
    speeds = speeds or [1.0] * num_stages
    n = len(weights)
    if num_stages < 1 or num_stages > n:
        raise StratumError(f"cannot cut {n} blocks into {num_stages} non-empty stages")
    pre = [0.0]
    for w in weights:
        pre.append(pre[-1] + w)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], (pre[j] - pre[i]) / speeds[s - 1])
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    out, j = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        out.append(range(i, j))
        j = i
    return out[::-1]


@dataclass(frozen=True, kw_only=True)
class Partition:
    """Stages as block ranges, placed on ranks, with the predicted per-rank time and memory."""

    stages: tuple[range, ...]
    """Block range of every stage (contiguous, in order, covering all blocks)."""
    stage_to_rank: tuple[int, ...]
    speeds: tuple[float, ...]
    """Relative speed of every rank (time of a block on rank r = profiled time / speeds[r])."""
    inflight: tuple[float, ...]
    """Micro-batches whose activations each stage holds at once (used for the memory figures)."""
    rank_time_s: tuple[float, ...]
    """Compute seconds per micro-batch (forward + backward) of every rank, speed included."""
    rank_state_bytes: tuple[int, ...]
    """Parameters + gradients + optimizer state held by every rank."""
    rank_act_bytes: tuple[float, ...]
    """Saved activations of every rank: sum over its stages of act_saved_bytes x inflight."""
    mem_limits: tuple[float, ...] | None = None
    exact: bool = True
    """False when the exact DP was too large and the heuristic's cut was used (see the module docstring)."""
    method: str = "dp"
    """How the cut was found: ``dp`` (exact DP), ``heuristic`` or ``given`` (see :func:`evaluate`)."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_ranks(self) -> int:
        return len(self.speeds)

    @property
    def rank_bytes(self) -> tuple[float, ...]:
        """Predicted memory per rank: state + activations."""
        return tuple(a + b for a, b in zip(self.rank_state_bytes, self.rank_act_bytes))

    @property
    def bottleneck_s(self) -> float:
        """The slowest rank's seconds per micro-batch."""
        return max(self.rank_time_s)

    def blocks_of(self, rank: int) -> list[int]:
        return sorted(i for s, r in enumerate(self.stage_to_rank) if r == rank for i in self.stages[s])

    def table(self) -> str:
        """Two fixed-width tables: stages (blocks, rank) and ranks (time, memory)."""
        lines = [f"partition ({self.method}): {self.num_stages} stages on "
                 f"{self.num_ranks} ranks, bottleneck {self.bottleneck_s * 1e3:.3f} ms per micro-batch",
                 f"{'stage':>5} {'blocks':>10} {'rank':>4} {'inflight':>8}"]
        for s, rg in enumerate(self.stages):
            blocks = f"{rg.start}-{rg.stop - 1}" if len(rg) > 1 else f"{rg.start}"
            lines.append(f"{s:>5} {blocks:>10} {self.stage_to_rank[s]:>4} {self.inflight[s]:>8g}")
        lines.append(f"{'rank':>5} {'speed':>6} {'time ms':>10} {'state B':>14} {'act B':>14} {'total B':>14}"
                     + (f" {'limit B':>14}" if self.mem_limits else ""))
        for r in range(self.num_ranks):
            row = (f"{r:>5} {self.speeds[r]:>6g} {self.rank_time_s[r] * 1e3:>10.3f} {self.rank_state_bytes[r]:>14,} "
                   f"{self.rank_act_bytes[r]:>14,.0f} {self.rank_bytes[r]:>14,.0f}")
            if self.mem_limits:
                row += f" {self.mem_limits[r]:>14,.0f}"
            lines.append(row)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# ---- inputs -------------------------------------------------------------------------------------------------
def _check_map(stage_to_rank: Sequence[int], num_blocks: int) -> tuple[tuple[int, ...], int]:
    s2r = tuple(int(r) for r in stage_to_rank)
    if not s2r:
        raise StratumError("stage_to_rank is empty; give the rank of every stage")
    if min(s2r) < 0:
        raise StratumError(f"stage_to_rank {list(s2r)} has a negative rank")
    P = max(s2r) + 1
    missing = [r for r in range(P) if r not in s2r]
    if missing:
        raise StratumError(f"stage_to_rank {list(s2r)} gives no stage to rank(s) {missing}")
    if len(s2r) > num_blocks:
        raise StratumError(f"cannot cut {num_blocks} blocks into {len(s2r)} non-empty stages; use fewer stages "
                           "(ranks, waves or virtual stages) or a deeper model")
    return s2r, P


def _per_rank(name: str, values, P: int, default: float) -> tuple[float, ...]:
    if values is None:
        return (float(default),) * P
    vals = tuple(float(x) for x in values)
    if len(vals) != P:
        raise StratumError(f"{name} has {len(vals)} entries but there are {P} ranks; give one per rank")
    if any(not x > 0 for x in vals) or (name == "speeds" and any(math.isinf(x) for x in vals)):
        raise StratumError(f"{name} must be positive numbers, got {list(vals)}")
    return vals


def _inflight(inflight, S: int, P: int) -> tuple[float, ...]:
    if inflight is None:
        return (float(P),) * S
    if isinstance(inflight, (int, float)):
        vals = (float(inflight),) * S
    else:
        vals = tuple(float(x) for x in inflight)
    if len(vals) != S:
        raise StratumError(f"inflight has {len(vals)} entries but there are {S} stages; give one per stage")
    if any(x < 0 or math.isnan(x) for x in vals):
        raise StratumError(f"inflight must be >= 0 micro-batches, got {list(vals)}")
    return vals


def inflight_from_schedule(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches whose activations it holds at once when ``schedule`` runs with unit
    costs (F=1, B=2, I=W=1 per rank, split over the rank's stages) and free messages: from the start of a
    forward to the end of its backward (of W for a split backward)."""
    v = max(1, schedule.num_stages // schedule.num_ranks)
    res = simulate(schedule, Costs.unit(schedule.num_stages, stages_per_rank=v))
    events: list[list[tuple[float, int]]] = [[] for _ in range(schedule.num_stages)]
    for rec in res.records:
        a = rec.action
        if a.kind == "F":
            events[a.stage].append((rec.start, 1))
        elif a.kind in "BW":
            events[a.stage].append((rec.end, -1))
    out = []
    for ev in events:
        cur = best = 0
        for _, d in sorted(ev):   # frees (-1) sort before allocations (+1) at equal times
            cur += d
            best = max(best, cur)
        out.append(best)
    return out


# ---- the DP -------------------------------------------------------------------------------------------------
def _dp(n: int, s2r: tuple[int, ...], P: int, stage_obj, stage_mem, obj_scale: Sequence[float],
        limits: Sequence[float] | None, beam: int, upper: float = math.inf):
    """Minimise max over ranks of (sum of ``stage_obj(s, i, j)`` over its stages) * ``obj_scale[r]`` subject to
    (sum of ``stage_mem(s, i, j)``) <= ``limits[r]``. Returns (value, cuts, exact) or (inf, None, exact).

    States whose partial bottleneck already exceeds ``upper`` (a known solution's value) are dropped: they
    cannot lead to a better cut, so this keeps the DP exact while shrinking the fronts."""
    S = len(s2r)
    last_stage = {r: max(s for s in range(S) if s2r[s] == r) for r in range(P)}
    # Ranks still open after placing stages 0..s (they get a stage later): sorted tuple, used as state index.
    open_after = []
    for s in range(S):
        open_after.append(tuple(r for r in range(P) if any(s2r[t] == r for t in range(s + 1)) and last_stage[r] > s))
    exact = True
    # front[s][j]: dict state -> back pointer (prev j, prev state). state = (closed_max, loads..., mems...)
    fronts: list[dict[int, dict[tuple, tuple]]] = [dict() for _ in range(S + 1)]
    fronts[0][0] = {(0.0,): (None, None)}
    prev_open: tuple[int, ...] = ()
    for s in range(S):
        r = s2r[s]
        now_open = open_after[s]
        lo, hi = s + 1, n - (S - s - 1)        # block end j of stage s: leave >= 1 block per later stage
        for j in range(lo, hi + 1):
            cands: dict[tuple, tuple] = {}
            for i, states in fronts[s].items():
                if i >= j:
                    continue
                o, mem = stage_obj(s, i, j), stage_mem(s, i, j)
                for st, _ in states.items():
                    closed = st[0]
                    k = len(prev_open)
                    loads = dict(zip(prev_open, st[1:1 + k]))
                    mems = dict(zip(prev_open, st[1 + k:1 + 2 * k]))
                    load_r = loads.get(r, 0.0) + o
                    mem_r = mems.get(r, 0.0) + mem
                    if limits is not None and mem_r > limits[r] * (1 + 1e-12):
                        continue
                    loads[r], mems[r] = load_r, mem_r
                    if r not in now_open:
                        closed = max(closed, load_r * obj_scale[r])
                    new = (closed,) + tuple(loads[q] for q in now_open) + tuple(mems[q] for q in now_open)
                    if _bound(new, now_open, obj_scale) > upper * (1 + 1e-9):
                        continue
                    if new not in cands:
                        cands[new] = (i, st)
            if not cands:
                continue
            if len(cands) > 8 * beam:   # front too large for an exact search: give up, caller falls back
                return math.inf, None, False
            front = _pareto(cands, now_open, obj_scale)
            if len(front) > beam:
                return math.inf, None, False
            fronts[s + 1][j] = front
        prev_open = now_open
    final = fronts[S].get(n)
    if not final:
        return math.inf, None, exact
    best_state = min(final, key=lambda st: st[0])
    # walk back
    cuts = [n]
    st, j = best_state, n
    for s in range(S, 0, -1):
        i, pst = fronts[s][j][st]
        cuts.append(i)
        st, j = pst, i
    return best_state[0], cuts[::-1], exact


def _bound(state: tuple, open_ranks: tuple[int, ...], scale: Sequence[float]) -> float:
    return max([state[0]] + [state[1 + q] * scale[r] for q, r in enumerate(open_ranks)])


def _pareto(cands: dict[tuple, tuple], open_ranks: tuple[int, ...], scale) -> dict[tuple, tuple]:
    """Drop states dominated component-wise (closed max, open loads, open memories)."""
    if not open_ranks:   # only the worst closed time matters: keep the best state
        best = min(cands, key=lambda st: st[0])
        return {best: cands[best]}
    items = sorted(cands.items(), key=lambda kv: kv[0])
    kept: list[tuple[tuple, tuple]] = []
    for st, bp in items:
        if any(all(a <= b for a, b in zip(k, st)) for k, _ in kept):
            continue
        kept.append((st, bp))
    return dict(kept)


def _heuristic(n, s2r, P, stage_obj, stage_mem, obj_scale, limits):
    """A quick upper bound for multi-stage-per-rank maps: give every stage an equal share of its rank (exact
    min-max DP over stages, stage s weighted by k_r * obj_scale[r], memory share limits[r] / k_r), then move
    single boundaries while that lowers the true objective. Returns (value, cuts) or (inf, None)."""
    S = len(s2r)
    k = [s2r.count(r) for r in range(P)]
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(S + 1)]
    back = [[0] * (n + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for s in range(S):
        r = s2r[s]
        for j in range(s + 1, n - (S - s - 1) + 1):
            for i in range(s, j):
                if best[s][i] == inf:
                    continue
                if limits is not None and stage_mem(s, i, j) * k[r] > limits[r]:
                    continue
                v = max(best[s][i], stage_obj(s, i, j) * obj_scale[r] * k[r])
                if v < best[s + 1][j]:
                    best[s + 1][j], back[s + 1][j] = v, i
    if best[S][n] == inf:
        return inf, None
    cuts = [n]
    for s in range(S, 0, -1):
        cuts.append(back[s][cuts[-1]])
    cuts = cuts[::-1]

    def value(c):
        load, mem = [0.0] * P, [0.0] * P
        for s in range(S):
            load[s2r[s]] += stage_obj(s, c[s], c[s + 1])
            mem[s2r[s]] += stage_mem(s, c[s], c[s + 1])
        if limits is not None and any(mem[r] > limits[r] * (1 + 1e-12) for r in range(P)):
            return inf
        return max(load[r] * obj_scale[r] for r in range(P))

    cur = value(cuts)
    improved = True
    while improved:
        improved = False
        for q in range(1, S):
            for d in (-1, 1):
                c = list(cuts)
                c[q] += d
                if not c[q - 1] < c[q] < c[q + 1]:
                    continue
                v = value(c)
                if v < cur - 1e-15:
                    cuts, cur, improved = c, v, True
    return cur, cuts


# ---- public API ---------------------------------------------------------------------------------------------
def _block_arrays(profile):
    blocks = profile.blocks
    if not blocks:
        raise StratumError("the profile has no blocks")
    pre_t, pre_state, pre_act = [0.0], [0], [0]
    for b in blocks:
        pre_t.append(pre_t[-1] + b.fwd_s + b.bwd_s)
        pre_state.append(pre_state[-1] + b.param_bytes + b.grad_bytes + b.optim_bytes)
        pre_act.append(pre_act[-1] + b.act_saved_bytes)
    return len(blocks), pre_t, pre_state, pre_act


def evaluate(profile: Profile, stages: Sequence[range | Sequence[int]], stage_to_rank: Sequence[int], *,
             speeds: Sequence[float] | None = None, inflight: Sequence[float] | None = None,
             mem_limits: Sequence[float] | None = None,
             method: str = "given", exact: bool = True) -> Partition:
    """The :class:`Partition` of given block ranges (e.g. :func:`even_partition`)."""
    n, pre_t, pre_state, pre_act = _block_arrays(profile)
    s2r, P = _check_map(stage_to_rank, n)
    spans = [range(r.start, r.stop) if isinstance(r, range) else range(*r) for r in stages]
    if len(spans) != len(s2r):
        raise StratumError(f"{len(spans)} block ranges for {len(s2r)} stages")
    nxt = 0
    for s, rg in enumerate(spans):
        if rg.start != nxt or rg.stop <= rg.start:
            raise StratumError(f"stage {s} is blocks {rg.start}..{rg.stop - 1}, expected a non-empty range starting "
                               f"at block {nxt}")
        nxt = rg.stop
    if nxt != n:
        raise StratumError(f"the stages cover blocks 0..{nxt - 1}, but the profile has {n} blocks")
    sp = _per_rank("speeds", speeds, P, 1.0)
    infl = _inflight(inflight, len(s2r), P)
    t = [0.0] * P
    state = [0] * P
    act = [0.0] * P
    for s, rg in enumerate(spans):
        r = s2r[s]
        t[r] += (pre_t[rg.stop] - pre_t[rg.start]) / sp[r]
        state[r] += pre_state[rg.stop] - pre_state[rg.start]
        act[r] += (pre_act[rg.stop] - pre_act[rg.start]) * infl[s]
    lim = None if mem_limits is None else _per_rank("mem_limits", mem_limits, P, math.inf)
    return Partition(stages=tuple(spans), stage_to_rank=s2r, speeds=sp, inflight=infl, rank_time_s=tuple(t),
                     rank_state_bytes=tuple(state), rank_act_bytes=tuple(act), mem_limits=lim, exact=exact,
                     method=method)


def partition(profile: Profile, stage_to_rank: Sequence[int], *, speeds: Sequence[float] | None = None,
              mem_limits: Sequence[float] | None = None, inflight: Sequence[float] | None = None,
              beam: int = DEFAULT_BEAM) -> Partition:
    """Cut ``profile``'s blocks into ``len(stage_to_rank)`` contiguous stages minimising the bottleneck rank
    time under per-rank memory limits (see the module docstring for the model and the method).

    ``speeds``: relative speed per rank (default all 1). ``mem_limits``: bytes per rank (default none).
    ``inflight``: micro-batches held per stage, a number or one per stage (default: the number of ranks).
    Raises :class:`StratumError` when no cut fits the limits, naming the smallest per-rank limit that fits.
    """
    n, pre_t, pre_state, pre_act = _block_arrays(profile)
    s2r, P = _check_map(stage_to_rank, n)
    S = len(s2r)
    sp = _per_rank("speeds", speeds, P, 1.0)
    infl = _inflight(inflight, S, P)
    lim = None if mem_limits is None else _per_rank("mem_limits", mem_limits, P, math.inf)
    if beam < 1:
        raise StratumError(f"beam must be >= 1, got {beam}")

    def t_of(s, i, j):
        return pre_t[j] - pre_t[i]

    def m_of(s, i, j):
        return (pre_state[j] - pre_state[i]) + (pre_act[j] - pre_act[i]) * infl[s]

    scale = [1.0 / x for x in sp]
    upper, h_cuts = (math.inf, None) if S == P else _heuristic(n, s2r, P, t_of, m_of, scale, lim)
    _, cuts, exact = _dp(n, s2r, P, t_of, m_of, scale, lim, beam, upper)
    if not exact:   # Pareto fronts grew past ``beam``: keep the heuristic's cut (with one stage per rank: its DP)
        cuts = h_cuts if S != P else _heuristic(n, s2r, P, t_of, m_of, scale, lim)[1]
    if cuts is None:
        assert lim is not None  # without memory limits every cut fits, and the heuristic finds one
        zero = lambda s, i, j: 0.0  # noqa: E731
        up2 = math.inf if S == P else _heuristic(n, s2r, P, m_of, zero, [1.0] * P, None)[0]
        need, _, ex2 = _dp(n, s2r, P, m_of, zero, [1.0] * P, None, beam, up2)
        if not ex2:
            need = up2
        have = ", ".join(f"{x:,.0f}" for x in lim)
        raise StratumError(
            f"no cut of {n} blocks into {S} stages fits the memory limits ({have} bytes per rank); the smallest "
            f"per-rank limit that fits is {math.ceil(need):,} bytes{'' if ex2 else ' (heuristic search)'} "
            f"(state + activations x in-flight micro-batches); raise the limits, lower the in-flight "
            "micro-batches or use more ranks")
    stages = [range(cuts[s], cuts[s + 1]) for s in range(S)]
    return evaluate(profile, stages, s2r, speeds=sp, inflight=infl, mem_limits=lim,
                    method="dp" if exact else "heuristic", exact=exact)


def stage_costs(profile: Profile, part: Partition, *, latency: float = 0.0, bandwidth: float = math.inf) -> Costs:
    """:class:`Costs` of ``part``'s stages for the simulator: the profile's per-block costs summed over each stage
    (:meth:`Costs.from_profile`), times divided by the speed of the stage's rank; bytes as they are."""
    c = Costs.from_profile(profile, part.stages, latency=latency, bandwidth=bandwidth)
    k = [1.0 / part.speeds[r] for r in part.stage_to_rank]
    return replace(c, f=[x * y for x, y in zip(c.f, k)], b=[x * y for x, y in zip(c.b, k)],
                   i=[x * y for x, y in zip(c.i, k)], w=[x * y for x, y in zip(c.w, k)])
