"""Auto plan search: every Plan tree for N devices, priced on the one cost model, ranked best first.

The space, for N devices: every factorisation N = replicas × pipeline ranks × splits; replicate with and without
``shard=true``; every pipeline schedule kind (:data:`stratum.schedule.generators.KINDS`) with the partitions even,
balanced and — where the workload names its profile file — the profiled cut; split sizes the model's layers
divide into; where no such tree fits the devices' memory and the workload offers the offload leaf, the memory
engine on every device in each of those tree shapes — alone, under split (each rank's engine planning its
shards), pipeline (each pipeline rank's engine its stages) and replicate, and their nestings — priced by its own
planner. Adasum is left out (it trains a
different model from the plain engine's). Each tree is priced by
:func:`stratum.plan.predict.predict`; trees the model or the step cannot run (micro-batches that do not divide
over the replicas, too few blocks for the stages, split and shard together) and trees that do not fit the
devices' memory are listed with the reason. The search stops at ``time_limit_s`` and says so.

The predictions are SIMULATED: the cost model's figures from a profile and a hardware spec, to be compared with a
real run (``summary.json`` holds both when a chosen plan trains).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from stratum.errors import StratumError
from stratum.ir.hardware import Hardware
from stratum.ir.plan import Local, Offload, Pipeline, Plan, Replicate, Split, check
from stratum.plan.predict import Prediction, Workload, predict
from stratum.schedule.generators import KINDS
from stratum.units import fmt_bytes

SCHEDULES = tuple(k for k in KINDS)
"""Schedule kinds the search tries (interleaved with 2 stages per rank, wave with one wave)."""
DEFAULT_TIME_LIMIT_S = 20.0


@dataclass(frozen=True, kw_only=True)
class Refused:
    """A tree the search could not price (the model, the step or the engines cannot run it)."""

    plan: Plan
    why: str


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """The priced trees, best first, and what was left out."""

    devices: int
    ranked: tuple[Prediction, ...]
    """Trees that fit, fastest predicted step first."""
    too_big: tuple[Prediction, ...]
    """Trees whose predicted peak memory exceeds a device's."""
    refused: tuple[Refused, ...]
    examined: int
    complete: bool
    """False when the time limit stopped the search before every tree was priced."""

    @property
    def best(self) -> Prediction:
        if not self.ranked:
            why = (self.too_big[0].why if self.too_big else "every tree priced was refused" if self.examined
                   else "the search stopped at its time limit before it priced a tree")
            raise StratumError(f"no plan for {self.devices} devices fits: {why}")
        return self.ranked[0]

    def table(self, top: int = 20, label=str) -> str:
        """Ranked trees (at most ``top``), then the ones that do not fit and the refused ones; ``label`` writes a
        plan (e.g. shortening a profile path)."""
        shown = [*self.ranked[:top], *self.too_big]
        w = max([len(label(p.plan)) for p in shown] + [len(label(x.plan)) for x in self.refused] + [4])
        head = (f"{'#':>3}  {'plan':<{w}} {'step s':>9} {'compute':>9} {'reduce':>8} {'update':>8} {'overhead':>8} "
                f"{'bubble':>6} {'peak/device':>12}")
        lines = [f"plan search over {self.devices} devices: {self.examined} trees priced"
                 + ("" if self.complete else " (stopped at the time limit: not every tree was priced)")
                 + "  (SIMULATED: cost-model predictions)", head, "-" * len(head)]
        for i, p in enumerate(self.ranked[:top], 1):
            lines.append(f"{i:>3}  {label(p.plan):<{w}} {p.step_s:>9.4f} {p.compute_s:>9.4f} {p.reduce_s:>8.4f} "
                         f"{p.update_s:>8.4f} {p.overhead_s:>8.4f} {p.bubble:>6.3f} {fmt_bytes(max(p.peak_bytes)):>12}")
        if len(self.ranked) > top:
            lines.append(f"     … {len(self.ranked) - top} more that fit")
        for p in self.too_big:
            lines.append(f"  -  {label(p.plan):<{w}} does not fit: {p.why}")
        for x in self.refused:
            lines.append(f"  -  {label(x.plan):<{w}} cannot run: {x.why}")
        return "\n".join(lines)


def _factorisations(n: int) -> Iterator[tuple[int, int, int]]:
    for r in range(1, n + 1):
        if n % r:
            continue
        for p in range(1, n // r + 1):
            if (n // r) % p == 0:
                yield r, p, n // r // p


def candidates(work: Workload, n: int) -> Iterator[Plan]:
    """Every in-memory tree the search considers for ``n`` devices, cheapest to price first."""
    return _trees(work, n, Local(), shards=(False, True))


def offload_candidates(work: Workload, hw: Hardware, n: int) -> Iterator[Plan]:
    """The memory engine on each of ``n`` devices in every tree the in-memory search tries — alone, under split,
    pipeline, replicate and their nestings (replicate without ``shard=true``, which the search does not price
    over the leaf): its device budget the smallest device's memory, its host budget an equal share of the
    host's."""
    leaf = Offload(device_budget=str(min(d.memory_bytes for d in hw.devices[:n])),
                   host_budget=str(max(1, hw.host_bytes // n)))
    return _trees(work, n, leaf, shards=(False,))


def _trees(work: Workload, n: int, leaf: Local | Offload, *, shards: tuple[bool, ...]) -> Iterator[Plan]:
    if n < 1:
        raise StratumError(f"--devices must be >= 1, got {n}")
    partitions = ["even", "balanced"] + ([work.profile_path] if work.profile_path else [])
    for r, p, s in sorted(_factorisations(n), key=lambda t: (t[1] > 1, t)):
        if s > 1 and s not in work.split_sizes:
            continue
        inner = Split(n=s, child=leaf) if s > 1 else leaf
        middles = [inner] if p == 1 else [Pipeline(ranks=p, schedule=k, partition=part, child=inner)
                                          for k in SCHEDULES for part in partitions]
        for mid in middles:
            if r == 1:
                yield _checked(mid)
            else:
                for shard in shards:
                    if not (shard and s > 1):
                        yield _checked(Replicate(n=r, shard=shard, child=mid))


def _checked(root) -> Plan:
    check(root)
    return Plan(root)


def _same_run(pred: Prediction) -> tuple:
    """What makes two trees run differently: the tree with the pipeline's partition replaced by its cut."""
    return _without_partition(pred.plan), pred.stages


def _without_partition(plan: Plan) -> str:
    node = plan.pipeline
    return str(plan) if node is None else str(plan).replace(f"partition={node.partition}", "")


@dataclass
class _Priced:
    """The search's tally: trees that fit, trees too big, refused trees, and what has been priced."""

    fit: list[Prediction] = field(default_factory=list)
    big: list[Prediction] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    seen: set[tuple] = field(default_factory=set)

    def price(self, plans: Iterator[Plan], work: Workload, hw: Hardware, deadline: float) -> bool:
        """Price ``plans`` until ``deadline``; False when it stopped them there."""
        for plan in plans:
            if time.perf_counter() > deadline:
                return False
            try:
                pred = predict(plan, work, hw)
            except StratumError as e:
                key = (_without_partition(plan), str(e))
                if key not in self.seen:  # refused whatever the cut: listed once
                    self.seen.add(key)
                    self.refused.append(Refused(plan=plan, why=str(e)))
                continue
            key = _same_run(pred)
            if key in self.seen:  # two partitions that cut alike run alike: keep the first (even, balanced, profiled)
                continue
            self.seen.add(key)
            (self.fit if pred.fits else self.big).append(pred)
        return True


def check_device_count(n: int, hw: Hardware) -> None:
    """``n`` devices must be in the spec."""
    if n > hw.num_devices:
        raise StratumError(f"{n} devices asked for (--devices or parallel.devices) but the hardware spec has "
                           f"{hw.num_devices}; ask for at most that many, or describe more in the spec")


def search(work: Workload, hw: Hardware, n: int, *, time_limit_s: float = DEFAULT_TIME_LIMIT_S) -> SearchResult:
    """Price every candidate tree for ``n`` devices of ``hw`` (at most ``time_limit_s`` seconds) and rank them;
    where none fits in memory and the workload offers the offload leaf, the memory engine's trees too."""
    check_device_count(n, hw)
    deadline = time.perf_counter() + time_limit_s
    t = _Priced()
    complete = t.price(candidates(work, n), work, hw, deadline)
    if not t.fit and work.offload is not None and complete:
        complete = t.price(offload_candidates(work, hw, n), work, hw, deadline)
    t.fit.sort(key=lambda p: (p.step_s, max(p.peak_bytes), str(p.plan)))
    t.big.sort(key=lambda p: max(b - lim for b, lim in zip(p.peak_bytes, p.limit_bytes)))
    return SearchResult(devices=n, ranked=tuple(t.fit), too_big=tuple(t.big), refused=tuple(t.refused),
                        examined=len(t.fit) + len(t.big) + len(t.refused), complete=complete)
