"""Belady's OPT eviction on a recorded access sequence, and a simulator of it for the planner.

The sequence repeats every step, so the next use of a chunk after the last position wraps around to its first
position plus the sequence length.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass


class NextUse:
    """Answers "when is chunk c next used after position t?" on a cyclic sequence."""

    def __init__(self, seq: Sequence[tuple[int, ...]]):
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
    """The candidate used farthest in the future (OPT), the first of equals in ``candidates``' order; ``None`` if
    there is none."""
    return max(candidates, key=lambda c: nxt.after(c, t), default=None)


@dataclass(frozen=True)
class Traffic:
    """What one step of the engine's residency policy moves, in chunks (the steady state)."""
    fetches: int
    """Chunks copied to the device (parameters)."""
    grad_reads: int = 0
    """Gradients so far copied back with a chunk whose access adds to them (a later micro-batch's backward)."""
    grad_writes: int = 0
    """Gradients so far written home by an eviction before the chunk's gradient was complete."""
    grad_writes_fwd: int = 0
    """Of ``grad_writes``, those made by forward accesses."""


def simulate_step(seq: list[tuple[int, ...]], slots: int, *, wants: list[bool] | None = None,
                  consumed: dict[int, int] | None = None, stale: frozenset[int] = frozenset(),
                  steps: int = 2) -> Traffic:
    """One step of the engine's policy on the cyclic access sequence ``seq`` with ``slots`` device slots, in the
    steady state (the last of ``steps`` steps): OPT eviction; ``stale`` chunks are not resident at a step's start
    (their update ran at home, so the device copy is old). With ``wants`` (per access: it is a backward's or an
    update's, which adds to or reads the chunks' gradients) it also counts the gradients' round trips: a chunk's
    gradient starts a step empty, stays in its slot while resident, goes home when the chunk is evicted and comes
    back with the next access that wants it — until the access at ``consumed[c]`` (its completion), after which
    the engine's update takes it (counted by the planner, not here)."""
    return _simulate(tuple(seq), slots, tuple(wants) if wants else None,
                     tuple(sorted(consumed.items())) if consumed is not None else None, frozenset(stale), steps)


# The planner prices many candidates that differ only where the chunks' traffic does not (activations,
# deferred updates of other tiers): a few dozen distinct simulations among thousands of calls.
@functools.lru_cache(maxsize=512)
def _simulate(seq: tuple[tuple[int, ...], ...], slots: int, wants: tuple[bool, ...] | None,
              consumed_items: tuple[tuple[int, int], ...] | None, stale: frozenset[int], steps: int) -> Traffic:
    consumed = dict(consumed_items) if consumed_items is not None else None
    nxt = NextUse(seq)
    resident: set[int] = set()
    out = Traffic(0)
    for _ in range(steps):
        resident -= stale
        fetches = reads = writes = writes_fwd = 0
        grad: dict[int, str] = {}  # chunk → "dev" (in its slot) or "home"; absent: none this step (or consumed)
        for t, cs in enumerate(seq):
            want = bool(wants and wants[t])
            for c in cs:
                if c not in resident:
                    if len(resident) >= slots:
                        v = choose_victim([r for r in resident if r not in cs], t, nxt)
                        if v is None:
                            raise ValueError("not enough slots for one access")
                        resident.discard(v)
                        if grad.get(v) == "dev":
                            grad[v] = "home"
                            writes += 1
                            writes_fwd += not want
                    resident.add(c)
                    fetches += 1
                if want:
                    if grad.get(c) == "home":
                        reads += 1
                    grad[c] = "dev"
                if consumed is not None and consumed.get(c) == t:
                    grad.pop(c, None)
        out = Traffic(fetches, reads, writes, writes_fwd)
    return out
