"""Belady's OPT eviction on a recorded access sequence, and a simulator of it for the planner.

The sequence repeats every step, so the next use of a chunk after the last position wraps around to its first
position plus the sequence length.
"""

from __future__ import annotations

import bisect
import math


class NextUse:
    """Answers "when is chunk c next used after position t?" on a cyclic sequence."""

    def __init__(self, seq: list[tuple[int, ...]]):
        self.n = len(seq)
        self.pos: dict[int, list[int]] = {}
        for t, cs in enumerate(seq):
            for c in cs:
                self.pos.setdefault(c, []).append(t)

    def after(self, c: int, t: int) -> float:
        ps = self.pos.get(c)
        if not ps:
            return math.inf
        k = bisect.bisect_right(ps, t)
        return ps[k] if k < len(ps) else ps[0] + self.n


def choose_victim(candidates, t: int, nxt: NextUse) -> int | None:
    """The candidate used farthest in the future (OPT); ``None`` if there is none."""
    best, best_t = None, -1.0
    for c in candidates:
        u = nxt.after(c, t)
        if u > best_t:
            best, best_t = c, u
    return best


def simulate(seq: list[tuple[int, ...]], slots: int, steps: int = 2) -> int:
    """Fetches per step under OPT with ``slots`` cache slots, in the steady state (the last of ``steps`` steps)."""
    nxt = NextUse(seq)
    resident: set[int] = set()
    fetches = 0
    for s in range(steps):
        fetches = 0
        for t, cs in enumerate(seq):
            for c in cs:
                if c in resident:
                    continue
                if len(resident) >= slots:
                    v = choose_victim([r for r in resident if r not in cs], t, nxt)
                    if v is None:
                        raise ValueError("not enough slots for one access")
                    resident.discard(v)
                resident.add(c)
                fetches += 1
    return fetches
