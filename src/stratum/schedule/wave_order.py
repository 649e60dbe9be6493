"""The wave generators' order: an event simulation of a zig-zag pipeline under a per-rank cap on the stage
activations a rank holds (see :func:`capped_order`). Like list scheduling, the order in which the actions ran is
the schedule, deadlock-free whatever the real costs; heaps of ready actions keep it O(n log n).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from stratum.schedule.ir import Action

EPS = 1e-9


@dataclass(frozen=True, kw_only=True)
class WaveRule:
    """The rule a free rank picks its next action by, and the limits it runs under (see :func:`capped_order`)."""

    cap: int
    reserve: int = 0
    msg: float = 0.0
    rule: str = "deepest"
    f_ties: bool = False
    pace: float = 0.0
    b_off: float = 0.0
    wave_f: Sequence[float] = ()
    wave_b: Sequence[float] = ()
    owed_slack: int | None = None
    msg_window: tuple[float, float] | None = None


class _CappedSim:
    """The simulation's state: per rank its ready actions (heaps), live activations, forwards owed and deferred
    weight gradients; the events (an action's end, an input's arrival) in time order."""

    def __init__(self, stage_to_rank: tuple[int, ...], m: int, split: bool, w: WaveRule):
        S, P = len(stage_to_rank), max(stage_to_rank) + 1
        self.s2r, self.S, self.P, self.w, self.split = stage_to_rank, S, P, w, split
        self.bk = "I" if split else "B"
        self.cost = {"F": 1.0, self.bk: 1.0 if split else 2.0, "W": 1.0}
        self.first = [min(s for s in range(S) if stage_to_rank[s] == r) for r in range(P)]
        self.n_local = [sum(1 for x in stage_to_rank if x == r) for r in range(P)]
        self.owed = [0] * P  # forwards this rank still has to run for the micro-batches it has admitted
        self.admit_room = math.inf if w.owed_slack is None else w.owed_slack
        # ready[r]: [backwards, forwards into a later stage, forwards into the rank's first stage]
        self.ready: list[list[list[tuple]]] = [[[], [], []] for _ in range(P)]
        self.need: dict[tuple[int, int], int] = {}  # backward of (stage, mb): inputs still missing
        self.pend_w: list[deque[tuple[int, int]]] = [deque() for _ in range(P)]
        self.live = [0] * P
        self.free = [0.0] * P
        self.order: list[list[Action]] = [[] for _ in range(P)]
        self.events: list[tuple[float, int, str, int, int]] = []  # (time, seq, what became ready, stage, mb)
        self.seq = 0
        # Ranks whose pick may have changed: freed, or handed a ready action. A free rank that found nothing
        # to run finds nothing again until one of those happens, so each time step looks only at these.
        self.dirty: set[int] = set(range(P))
        self.total = S * m * (3 if split else 2)
        for k in range(m):
            heapq.heappush(self.ready[stage_to_rank[0]][2], (self.prio("F", 0, k), "F", 0, k))

    def prio(self, kind: str, s: int, k: int) -> tuple:
        w, is_f = self.w, kind == "F"
        if w.rule == "paced":
            half = s // self.P  # which half-wave (down, up, down, ...) the stage is on
            bc = self.cost[self.bk]
            target = (s + (w.wave_f[half] if w.wave_f else 0.0) if is_f else
                      self.S + w.b_off + bc * (self.S - 1 - s) + (w.wave_b[half] if w.wave_b else 0.0)) + w.pace * k
            return (target, is_f != w.f_ties, -s, k)
        if w.rule == "b-first":
            return (is_f, -s, k)
        return (-s, is_f != w.f_ties, k)

    def make_ready(self, kind: str, s: int, k: int) -> None:
        r = self.s2r[s]
        self.dirty.add(r)
        if kind == "F":
            heapq.heappush(self.ready[r][2 if s == self.first[r] else 1], (self.prio("F", s, k), "F", s, k))
            return
        n = self.need.get((s, k), 1 if s == self.S - 1 else 2) - 1
        self.need[(s, k)] = n
        if n == 0:
            heapq.heappush(self.ready[r][0], (self.prio(self.bk, s, k), self.bk, s, k))

    def pick(self, r: int) -> tuple[str, int, int] | None:
        """Rank r's next action: the best ready one its cap admits, else a deferred W, else None."""
        w, live = self.w, self.live[r]
        rb, rf, rf0 = self.ready[r]
        best, src = None, None
        if rb:
            best, src = rb[0], rb
        if rf and live < w.cap and (best is None or rf[0] < best):
            best, src = rf[0], rf
        if rf0 and live < w.cap - w.reserve and live + self.owed[r] < w.cap + self.admit_room and \
                (best is None or rf0[0] < best):
            best, src = rf0[0], rf0
        if best is not None:
            assert src is not None
            heapq.heappop(src)
            _, kind, s, k = best
            return kind, s, k
        if self.pend_w[r]:
            s, k = self.pend_w[r].popleft()
            return "W", s, k
        return None

    def _push(self, at: float, kind: str, s: int, k: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, s, k))

    def _hop(self, end: float, r: int, s_next: int) -> float:
        """The message delay to stage ``s_next`` of a result ready at ``end`` on rank r."""
        window = self.w.msg_window
        in_window = window is None or window[0] <= end <= window[1]
        return self.w.msg if self.s2r[s_next] != r and in_window else 0.0

    def run_action(self, r: int, t: float, kind: str, s: int, k: int) -> None:
        end = t + self.cost[kind]
        self.free[r] = end
        self.order[r].append(Action(kind, s, k))
        self._push(end, "", r, 0)  # the rank is free again
        if kind == "F":
            self.live[r] += 1
            self.owed[r] += self.n_local[r] - 1 if s == self.first[r] else -1
            self._push(end, self.bk, s, k)  # its own backward has its activation
            if s + 1 < self.S:
                self._push(end + self._hop(end, r, s + 1), "F", s + 1, k)
        elif kind == self.bk:
            if self.split:
                self.pend_w[r].append((s, k))
            else:
                self.live[r] -= 1
            if s > 0:
                self._push(end + self._hop(end, r, s - 1), self.bk, s - 1, k)
        else:
            self.live[r] -= 1

    def run(self) -> list[list[Action]] | None:
        t, n_done = 0.0, 0
        while n_done < self.total:
            for r in sorted(self.dirty):
                if self.free[r] > t + EPS:
                    continue
                picked = self.pick(r)
                if picked is not None:
                    self.run_action(r, t, *picked)
                    n_done += 1
            self.dirty.clear()
            if not self.events:
                return None
            t = max(t, self.events[0][0])
            while self.events and self.events[0][0] <= t + EPS:
                _, _, kind, s, k = heapq.heappop(self.events)
                if kind:
                    self.make_ready(kind, s, k)
                else:
                    self.dirty.add(s)  # the event of a rank falling free carries the rank as its stage
        return self.order


def capped_order(stage_to_rank: tuple[int, ...], m: int, *, split: bool,
                 rule: WaveRule) -> list[list[Action]] | None:
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
    return _CappedSim(stage_to_rank, m, split, rule).run()
