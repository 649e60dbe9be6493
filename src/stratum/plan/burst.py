"""Burst parallelism's planner: DeepPool's dynamic programme over blocks × device counts.

Block i at width k (one of the allowed counts, powers of two up to N by default) runs its micro-batch's samples
split k ways. Its price, per micro-batch step on the profiled batch (seconds, from :class:`~stratum.ir.costs.Costs`
and :mod:`stratum.ir.prices`):

- compute: the block's forward + backward on ``1/k`` of the batch, priced by the device model
  (:func:`stratum.ir.work.share_s`, given as a :class:`Compute`): on a device with a ``peak_flops``,
  ``max(K·L, (F·s/k + K·W½)/P)`` from the block's kernel count K and FLOPs F per sample — a block of many small
  kernels gains less from a smaller share than one of a few large matrix products; on the profiled device its
  profiled time ``(f + b)/k``, floored by ``K·L`` where the kernel counts are known;
- its gradient's ring all-reduce over its k ranks (``param_bytes``), after its backward, not overlapped, over
  the link of ranks 0 … k−1 (:data:`Links`: a narrow block may sit inside one node);
- between blocks i and i+1 of different widths, the boundary activation (``out_bytes``) is redistributed point to
  point (:func:`overlaps`: each sample range from the rank holding it to the rank running it next) in the
  forward, and its gradient back in the backward: the busiest rank's messages, sent one after another, twice.

Blocks run one after another, so the step is the sum of all of it. The amplification limit bounds a block's
device-seconds ``k · (compute + all-reduce)`` by ``amplification`` × its width-1 cost: DeepPool's knob that stops
a block from taking many devices for a small gain (the devices it leaves are what multiplexing fills).

The programme keeps, per block and width, the best (step seconds, device-seconds) of the blocks so far, ordered
lexicographically (faster first, then fewer device-seconds): O(blocks · widths²).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import product
from typing import TypeAlias, TypeVar

from stratum.errors import StratumError
from stratum.ir.costs import Costs
from stratum.ir.hardware import Device, Link
from stratum.ir.prices import allreduce_s, transfer_s
from stratum.ir.work import Work, share_s


@dataclass(frozen=True, kw_only=True)
class Compute:
    """What the planner prices a block's forward + backward on (:func:`stratum.ir.work.share_s`)."""

    device: Device = Device(name="profiled", memory_bytes=1)
    """The device the blocks run on (a group's slowest); default: the device the costs were profiled on."""
    work: Work | None = None
    """Per block kernel counts and FLOPs per sample; None: unknown (profiled times, no launch floor)."""
    samples: float = 1.0
    """Samples in the costs' batch: block i at width k runs ``samples / k`` of them."""


_V = TypeVar("_V", int, float)  # sample counts, or fractions of a batch
Links: TypeAlias = Link | Callable[[int], Link]
"""The link between ranks: one for every group, or per width k the link of the first k ranks (block i at width k
runs on ranks 0 … k−1, so a narrow block may sit inside a node while a wide one crosses nodes)."""


def spans(total: int, k: int) -> list[tuple[int, int]]:
    """``total`` samples cut into ``k`` contiguous shares as evenly as possible (earlier shares take the rest)."""
    out, start = [], 0
    for i in range(k):
        size = total // k + (i < total % k)
        out.append((start, start + size))
        start += size
    return out


def overlaps(src: Sequence[tuple[_V, _V]], dst: Sequence[tuple[_V, _V]]) -> list[tuple[int, int, _V, _V]]:
    """The messages that turn shares ``src`` (rank s holds ``src[s]``) into shares ``dst``: (from rank, to rank,
    start, stop) for every non-empty intersection, a rank's message to itself included (it is a local copy)."""
    return [(s, d, max(a, c), min(b, e)) for s, (a, b) in enumerate(src) for d, (c, e) in enumerate(dst)
            if max(a, c) < min(b, e)]


def compute_s(costs: Costs, i: int, k: int, compute: Compute) -> float:
    """Seconds of block ``i``'s forward and backward on a ``1/k`` share of the costs' batch."""
    return share_s(compute.work, i, compute.samples / k, compute.device, (costs.f[i] + costs.b[i]) / k)


def reshard_s(nbytes: float, a: int, b: int, link: Link) -> float:
    """Seconds to move an ``nbytes`` tensor held in ``a`` even shares into ``b`` shares, one way: the busiest
    rank's sends (or receives), one after another."""
    if a == b or nbytes == 0:
        return 0.0
    unit = [(s / a, (s + 1) / a) for s in range(a)], [(d / b, (d + 1) / b) for d in range(b)]
    sent, got = [0.0] * max(a, b), [0.0] * max(a, b)
    for s, d, lo, hi in overlaps(*unit):
        if s != d:
            cost = transfer_s(nbytes * (hi - lo), link)
            sent[s] += cost
            got[d] += cost
    return max(sent + got)


@dataclass(frozen=True, kw_only=True)
class BurstPlan:
    """A width per block and what the cost model predicts for one micro-batch step."""

    widths: tuple[int, ...]
    devices: int
    compute_s: tuple[float, ...]
    """Per block: forward + backward seconds at its width."""
    allreduce_s: tuple[float, ...]
    """Per block: its gradient's all-reduce over its width."""
    move_s: tuple[float, ...]
    """Per block: seconds moving its input in (and its gradient back) from the previous block's width."""
    step_s: float
    """Predicted seconds of a step of one micro-batch (every block, all-reduce and move, one after another;
    :meth:`step_for` more micro-batches)."""
    device_s: float
    """Device-seconds busy per step; ``devices · step_s − device_s`` is idle (multiplexing's room)."""

    @property
    def idle_s(self) -> float:
        return self.devices * self.step_s - self.device_s

    def step_for(self, microbatches: int) -> float:
        """Predicted seconds of a step of ``microbatches`` micro-batches: their blocks and moves one after
        another, the gradient all-reduces once at the end."""
        reduce = sum(self.allreduce_s)
        return microbatches * (self.step_s - reduce) + reduce

    def table(self) -> str:
        head = f"{'block':>5}  {'width':>5}  {'compute s':>10}  {'allreduce s':>11}  {'move s':>9}  {'device-s':>10}"
        rows = [head, "-" * len(head)]
        for i, k in enumerate(self.widths):
            busy = k * (self.compute_s[i] + self.allreduce_s[i]) + \
                (max(k, self.widths[i - 1]) * self.move_s[i] if i else 0.0)
            rows.append(f"{i:>5}  {k:>5}  {self.compute_s[i]:>10.4g}  {self.allreduce_s[i]:>11.4g}  "
                        f"{self.move_s[i]:>9.4g}  {busy:>10.4g}")
        rows.append(f"a step of one micro-batch {self.step_s:.4g} s on {self.devices} devices; busy "
                    f"{self.device_s:.4g} device-s, "
                    f"idle {self.idle_s:.4g} device-s "
                    f"({100 * self.idle_s / max(self.devices * self.step_s, 1e-30):.0f} %)")
        return "\n".join(rows)


def width_link(link: Links, k: int) -> Link:
    """The link a group of the first ``k`` ranks talks over: ``link`` itself, or ``link(k)``."""
    return link(k) if callable(link) else link


def _block(costs: Costs, i: int, k: int, link: Links, compute: Compute) -> tuple[float, float]:
    """(seconds, device-seconds) of block ``i`` at width ``k``: compute and all-reduce."""
    t = compute_s(costs, i, k, compute) + allreduce_s(costs.param_bytes[i], k, width_link(link, k))
    return t, k * t


def _move(costs: Costs, i: int, a: int, b: int, link: Links) -> tuple[float, float]:
    """(seconds, device-seconds) of block ``i``'s input moving from width ``a`` to ``b`` and its gradient back."""
    t = 2 * reshard_s(costs.out_bytes[i - 1], a, b, width_link(link, max(a, b)))
    return t, max(a, b) * t


def price_burst(costs: Costs, widths: Sequence[int], *, devices: int, link: Links,
                compute: Compute = Compute()) -> BurstPlan:
    """What the cost model predicts for ``widths`` (one per block); no amplification limit applied."""
    if len(widths) != costs.num_stages or any(not 1 <= k <= devices for k in widths):
        raise StratumError(f"burst widths {list(widths)} must give one width in 1..{devices} per block "
                           f"({costs.num_stages} blocks)")
    _check_work(costs, compute)
    step = busy = 0.0
    moves = []
    for i, k in enumerate(widths):
        mt, md = _move(costs, i, widths[i - 1], k, link) if i else (0.0, 0.0)
        bt, bd = _block(costs, i, k, link, compute)
        step, busy = step + mt + bt, busy + md + bd
        moves.append(mt)
    return BurstPlan(widths=tuple(widths), devices=devices,
                     compute_s=tuple(compute_s(costs, i, k, compute) for i, k in enumerate(widths)),
                     allreduce_s=tuple(allreduce_s(costs.param_bytes[i], k, width_link(link, k))
                                       for i, k in enumerate(widths)),
                     move_s=tuple(moves), step_s=step, device_s=busy)


def default_widths(devices: int) -> tuple[int, ...]:
    """Powers of two up to ``devices``, and ``devices`` itself."""
    return tuple(sorted({2 ** e for e in range(int(math.log2(devices)) + 1)} | {devices}))


def allowed(costs: Costs, i: int, widths: Sequence[int], link: Links, amplification: float,
            compute: Compute) -> list[int]:
    """The widths block ``i`` may take under the amplification limit."""
    base = _block(costs, i, 1, link, compute)[1]
    return [k for k in widths if _block(costs, i, k, link, compute)[1] <= amplification * base * (1 + 1e-12)]


def _checked(costs: Costs, devices: int, amplification: float, widths: Sequence[int] | None,
             compute: Compute) -> tuple[int, ...]:
    if devices < 1:
        raise StratumError(f"burst planning needs at least 1 device, got {devices}")
    if not amplification >= 1.0:
        raise StratumError(f"burst amplification must be >= 1, got {amplification}")
    ws = tuple(sorted(set(widths))) if widths is not None else default_widths(devices)
    if not ws or any(not 1 <= k <= devices for k in ws):
        raise StratumError(f"burst widths {list(ws)} must be in 1..{devices}")
    if costs.num_stages == 0:
        raise StratumError("burst planning needs at least one block")
    _check_work(costs, compute)
    return ws


def _check_work(costs: Costs, compute: Compute) -> None:
    if compute.work is not None and compute.work.num_blocks != costs.num_stages:
        raise StratumError(f"burst: the work counts {compute.work.num_blocks} blocks, the costs "
                           f"{costs.num_stages}; count the same model")


def plan_burst(costs: Costs, *, devices: int, link: Links, amplification: float,
               widths: Sequence[int] | None = None, compute: Compute = Compute()) -> BurstPlan:
    """The fastest width per block (fewest device-seconds among equals) from ``widths`` (default: powers of two
    up to ``devices``) under the amplification limit; see the module docstring."""
    ws = _checked(costs, devices, amplification, widths, compute)
    n = costs.num_stages
    options = [allowed(costs, i, ws, link, amplification, compute) for i in range(n)]
    for i, opts in enumerate(options):
        if not opts:
            raise StratumError(f"burst: block {i} fits no width of {list(ws)} under amplification "
                               f"{amplification:g}; allow width 1 or raise the amplification")
    # best[i][k] = ((step, busy), previous width) of blocks 0..i with block i at width k
    best: list[dict[int, tuple[tuple[float, float], int]]] = [{}]
    for k in options[0]:
        best[0][k] = (_block(costs, 0, k, link, compute), 0)
    for i in range(1, n):
        best.append({})
        for k in options[i]:
            bt, bd = _block(costs, i, k, link, compute)
            cands = []
            for j, ((st, sd), _) in best[i - 1].items():
                mt, md = _move(costs, i, j, k, link)
                cands.append((((st + mt) + bt, (sd + md) + bd), j))
            best[i][k] = min(cands)
    k = min(best[-1], key=lambda w: best[-1][w][0])
    chosen = [k]
    for i in range(n - 1, 0, -1):
        k = best[i][k][1]
        chosen.append(k)
    return price_burst(costs, chosen[::-1], devices=devices, link=link, compute=compute)


def brute_force(costs: Costs, *, devices: int, link: Links, amplification: float,
                widths: Sequence[int] | None = None, compute: Compute = Compute()) -> BurstPlan:
    """:func:`plan_burst`'s answer by trying every assignment (small cases: the programme's check)."""
    ws = _checked(costs, devices, amplification, widths, compute)
    options = [allowed(costs, i, ws, link, amplification, compute) for i in range(costs.num_stages)]
    plans = [price_burst(costs, c, devices=devices, link=link, compute=compute) for c in product(*options)]
    if not plans:
        raise StratumError("burst: some block fits no width under the amplification limit")
    return min(plans, key=lambda p: (p.step_s, p.device_s))
