"""Running statistics (BatchNorm's) kept as the plain engine keeps them, when replicas share out a step.

The plain engine runs the step's k micro-batches one after another, and a BatchNorm layer moves its running mean
and variance once per micro-batch: ``r ← (1 − m)·r + m·s_j``. A replica runs only its consecutive share
``[a, b)`` of them, so on its own it ends with its share's statistics alone — the replicas would disagree, and
each would differ from the plain engine's. The update is linear in the batch statistics, so each replica's part
of the plain engine's result can be read off its own: with ``r0`` the value before the step and ``r_i`` the
replica's after its ``b − a`` updates,

    plain = (1 − m)^k · r0 + Σ_i (1 − m)^(k − b_i) · (r_i − (1 − m)^(b_i − a_i) · r0)

one sum over the replicas (one all-reduce a step, in float64). A layer with ``momentum=None`` keeps a cumulative
average instead, ``r = (N0·r0 + Σ s_j) / (N0 + k)`` with ``N0`` the batches counted before the step, and the
replicas' sums of ``s_j`` are read off the same way. ``num_batches_tracked`` adds the replicas' counts. Every
replica then holds the plain engine's statistics, to the rounding of the regrouped sum.

Other buffers a forward changes are not statistics this rule knows: :meth:`RunningStats.check_unchanged` refuses
them after the first step rather than let the replicas drift apart silently.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from stratum.dist.world import World
from stratum.errors import StratumError

STATS = ("running_mean", "running_var")
BUFFERS = (*STATS, "num_batches_tracked")
"""A tracked layer's buffers this module keeps: its statistics and its batch count."""


def _tracked(module: nn.Module) -> bool:
    return (isinstance(module, _NormBase) and module.track_running_stats and module.running_mean is not None
            and not module.running_mean.is_meta)


def _count(module: _NormBase) -> torch.Tensor:
    t = module.num_batches_tracked
    assert t is not None  # (a layer that tracks running statistics counts its batches)
    return t


class RunningStats:
    """The running statistics of this rank's normalisation layers among ``modules`` (skipping blocks held
    elsewhere, on ``meta``), combined over ``world``'s replica group after each step."""

    def __init__(self, modules: list[nn.Module], world: World):
        self.world = world
        seen: set[int] = set()
        self.layers: list[_NormBase] = []
        for root in modules:
            for m in root.modules():
                if id(m) not in seen and _tracked(m):
                    seen.add(id(m))
                    self.layers.append(m)  # type: ignore[arg-type]  # (_tracked checked the type)
        self.before: list[dict[str, torch.Tensor]] = []
        mine = {id(getattr(m, name)) for m in self.layers for name in BUFFERS}
        self.first: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] | None = [
            (mod, name, t, t.detach().to("cpu", copy=True)) for root in modules for mod in root.modules()
            for name, t in mod._buffers.items()
            if t is not None and not t.is_meta and id(t) not in mine and name not in mod._non_persistent_buffers_set]
        """The other persistent buffers before the first step (host copies: no device memory the plan did not
        count), to find one a forward changes."""

    def begin(self) -> None:
        """Before the step's forwards: remember every statistic's value."""
        self.before = [{name: getattr(m, name).detach().clone() for name in BUFFERS}
                       for m in self.layers]

    def combine(self, counts: list[int], index: int) -> None:
        """After this replica ran its ``counts[index]`` micro-batches (replica i runs ``counts[i]``, in order):
        every statistic set to what the plain engine's pass over all of them gives; after the first step, the
        other buffers checked (:meth:`check_unchanged`)."""
        if self.world.group("replica") is None:
            return
        if self.layers:
            self._sum(counts, index)
        self.check_unchanged()

    def _sum(self, counts: list[int], index: int) -> None:
        k, b = sum(counts), sum(counts[:index + 1])
        n = counts[index]
        parts = []
        for m, r0 in zip(self.layers, self.before):
            n0 = r0["num_batches_tracked"].double()
            for name in STATS:
                now, was = getattr(m, name).double(), r0[name].double()
                if m.momentum is None:  # cumulative average: this replica's sum of batch statistics
                    parts.append(now * (n0 + n) - was * n0)
                else:
                    keep = 1.0 - m.momentum
                    parts.append(keep ** (k - b) * (now - keep ** n * was))
            parts.append((_count(m) - r0["num_batches_tracked"]).double().reshape(1))
        flat = self.world.all_reduce(torch.cat([p.reshape(-1) for p in parts]), "replica",
                                     "the running statistics' all-reduce")
        off = 0
        with torch.no_grad():
            for m, r0 in zip(self.layers, self.before):
                n0 = r0["num_batches_tracked"].double()
                for name in STATS:
                    t, was = getattr(m, name), r0[name].double()
                    summed = flat[off:off + t.numel()].view_as(t)
                    off += t.numel()
                    if m.momentum is None:
                        t.copy_((was * n0 + summed) / (n0 + k))
                    else:
                        t.copy_((1.0 - m.momentum) ** k * was + summed)
                _count(m).copy_(r0["num_batches_tracked"] + flat[off].round().long())
                off += 1

    def check_unchanged(self) -> None:
        """After the first step: a persistent buffer the step changed that is not a statistic above is one the
        replicas cannot keep equal — refused in one line (checked once; the copies are then dropped)."""
        first, self.first = self.first, None
        for mod, name, t, value in first or []:
            if mod._buffers.get(name) is t and not torch.equal(t.detach().cpu(), value):
                raise StratumError(f"{type(mod).__name__}'s buffer {name!r} changes in training, and replicas "
                                   "cannot combine it (only BatchNorm-style running statistics are); train this "
                                   "model on a plan without replicate (local, pipeline)")
