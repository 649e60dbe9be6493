"""A burst plan's step with each block's gradient all-reduce beside the backward of the blocks before it.

Data-parallel runtimes on GPUs (PyTorch DDP, DeepSpeed, DeepPool's own) launch a block's all-reduce as soon as
its backward has produced the gradient, on a communication stream, while the backward goes on with the earlier
blocks. :func:`stratum.plan.burst.price_burst` prices the all-reduces one after another with the compute, as
Stratum's burst executor runs them; the cluster simulator prices the jobs it schedules as such runtimes run
them, with this timeline:

- forward: blocks 0 … n−1 one after another, each after its input has moved in from the previous width;
- backward: blocks n−1 … 0, each followed by its input gradient moving back; block i's all-reduce starts when
  its backward ends and the previous all-reduce is done (one communication stream per rank) and runs beside the
  backward of blocks i−1 … 0 (moves and all-reduces are assumed not to slow each other);
- the step ends when the last backward and the last all-reduce have.

A block's backward is its share of the block's compute in the profile (``b / (f + b)``). A rank is busy while
it computes, moves or all-reduces (the union of those intervals, so an all-reduce hidden behind compute is not
counted twice); a device carrying a narrow block's idle ranks is free for multiplexing.

:func:`plan_burst_overlapped` starts from the programme's plans with every all-reduce exposed and with every
one hidden (the two extremes the overlap lies between) and from plain data parallelism, and moves one block's width
at a time while the overlapped step gets shorter (fewer
device-seconds among equals): a local search, not an exact optimum — the overlap makes a block's price depend on
the blocks after it, which the programme's per-block sums cannot express. On small random cases (2–4 blocks,
2 or 4 devices) it finds the brute-force optimum 96 % of the time, within 15 % otherwise
(tests/test_plan_burst_overlap.py holds it to 90 % and 20 %).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from stratum.ir.costs import Costs
from stratum.plan.burst import BurstPlan, Compute, Links, allowed, default_widths, plan_burst, price_burst

Interval = tuple[float, float, int]
"""(start, end, width): ranks 0 … width−1 are busy from start to end."""


@dataclass(frozen=True, kw_only=True)
class OverlappedStep:
    """A burst plan and what its step takes with the all-reduces beside the backward."""

    plan: BurstPlan
    step_s: float
    """Seconds per step (see the module docstring)."""
    rank_busy_s: tuple[float, ...]
    """Per rank 0 … devices−1: seconds busy per step (the union of its compute, moves and all-reduces)."""

    @property
    def device_s(self) -> float:
        """Device-seconds busy per step, summed over the devices."""
        return sum(self.rank_busy_s)

    @property
    def idle_s(self) -> float:
        return self.plan.devices * self.step_s - self.device_s

    @property
    def exposed_s(self) -> float:
        """Seconds the step runs past its compute and moves: the all-reduce time not hidden."""
        return self.step_s - (sum(self.plan.compute_s) + sum(self.plan.move_s))


def backward_shares(costs: Costs) -> list[float]:
    """Per block, the backward's share of its forward + backward (a block without profiled time: 2/3, the
    backward's two matrix products to the forward's one)."""
    return [b / (f + b) if f + b > 0 else 2 / 3 for f, b in zip(costs.f, costs.b)]


def timeline(plan: BurstPlan, back: Sequence[float]) -> tuple[float, list[Interval]]:
    """(step seconds, busy intervals) of ``plan`` with ``back[i]`` the backward's share of block i's compute."""
    w, busy, t = plan.widths, [], 0.0
    for i, k in enumerate(w):
        if i and plan.move_s[i]:
            busy.append((t, t + plan.move_s[i] / 2, max(k, w[i - 1])))
            t += plan.move_s[i] / 2
        fwd = plan.compute_s[i] * (1 - back[i])
        busy.append((t, t + fwd, k))
        t += fwd
    comm = 0.0
    for i in reversed(range(len(w))):
        bwd = plan.compute_s[i] * back[i]
        busy.append((t, t + bwd, w[i]))
        t += bwd
        start = max(comm, t)
        comm = start + plan.allreduce_s[i]
        busy.append((start, comm, w[i]))
        if i and plan.move_s[i]:
            busy.append((t, t + plan.move_s[i] / 2, max(w[i], w[i - 1])))
            t += plan.move_s[i] / 2
    return max(t, comm), busy


def union_s(intervals: Sequence[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def overlapped(plan: BurstPlan, costs: Costs) -> OverlappedStep:
    """``plan``'s step with its all-reduces beside the backward (``costs``: the costs it was priced from)."""
    step, busy = timeline(plan, backward_shares(costs))
    ranks, below = [0.0] * plan.devices, 0
    for k in sorted({k for _, _, k in busy}):
        # ranks below … k−1 take part in every interval of width ≥ k and in no other
        ranks[below:k] = [union_s([(a, b) for a, b, width in busy if width >= k and b > a])] * (k - below)
        below = k
    return OverlappedStep(plan=plan, step_s=step, rank_busy_s=tuple(ranks))


def improves(a: OverlappedStep, b: OverlappedStep) -> bool:
    """``a`` is shorter than ``b``, or as short with fewer device-seconds (beyond float rounding)."""
    tol = 1e-12
    return a.step_s < b.step_s * (1 - tol) or (a.step_s <= b.step_s * (1 + tol) and a.device_s < b.device_s * (1 - tol))


def plan_burst_overlapped(costs: Costs, *, devices: int, link: Links, amplification: float,
                          compute: Compute | None = None) -> OverlappedStep:
    """The shortest overlapped step (fewest device-seconds among equals) the local search finds from its
    starting plans, under the amplification limit (see the module docstring;
    ``compute``: as :func:`~stratum.plan.burst.plan_burst`'s, default the profiled device)."""
    compute = compute or Compute()
    options = [allowed(costs, i, default_widths(devices), link, amplification, compute)
               for i in range(costs.num_stages)]
    hidden = replace(costs, param_bytes=[0] * costs.num_stages)  # every all-reduce hidden: the other extreme
    seeds = [plan_burst(c, devices=devices, link=link, amplification=amplification, compute=compute).widths
             for c in (costs, hidden)] + [(devices,) * costs.num_stages]
    seeds = [s for s in seeds if all(k in o for k, o in zip(s, options))]

    def price(widths: Sequence[int]) -> OverlappedStep:
        return overlapped(price_burst(costs, widths, devices=devices, link=link, compute=compute), costs)

    best = price(seeds[0])
    for cand in map(price, seeds[1:]):
        best = cand if improves(cand, best) else best
    better = True
    while better:
        better = False
        for i, opts in enumerate(options):
            for k in opts:
                if k == best.plan.widths[i]:
                    continue
                cand = price(best.plan.widths[:i] + (k,) + best.plan.widths[i + 1:])
                if improves(cand, best):
                    best, better = cand, True
    return best
