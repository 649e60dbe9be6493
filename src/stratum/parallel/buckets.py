"""The replicate node's mean reduction: gradients summed over the replicas in buckets, started during the backward.

Parameters are grouped, in reverse order (the order a backward finishes them), into buckets of about
:data:`BUCKET_BYTES`. Where the child's gradients are final once autograd has accumulated them for the step's
last micro-batch (``GradEngine.grads_final_in_backward``), a post-accumulate-grad hook counts each parameter's
accumulations and a bucket's asynchronous all-reduce starts as soon as its last gradient is final, beside the rest
of the backward — the overlap torch's DDP reducer gives, for an executor DDP cannot wrap (its forward is not a
module call the reducer can see). Elsewhere (a pipeline stage's split backward accumulates outside autograd, and
tied gradients are summed after it) every bucket starts after the child's backward. :meth:`finish` starts what
is left, waits for all with the world's timeout, and writes the sums back.

A parameter the step leaves without a gradient on a replica sends zeros and a flag (:mod:`stratum.parallel.presence`):
where no replica had one, it ends the step without a gradient, as under the plain engine.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from stratum.dist.world import World
from stratum.parallel import presence
from stratum.runtime.tensors import local_part

BUCKET_BYTES = 25 * 2**20
"""Gradient bytes per all-reduce: big enough to amortise a collective's latency, small enough to overlap."""


class GradBuckets:
    """Sums ``params``' gradients (the trainable ones: a frozen parameter takes no hook) over ``world``'s replica
    group (see the module docstring)."""

    def __init__(self, params: list[nn.Parameter], world: World, *, overlap: bool):
        self.world = world
        self.group = world.group("replica")
        self.buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in reversed(params):
            nbytes = local_part(p).numel() * p.element_size()
            if size and size + nbytes > BUCKET_BYTES:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.buckets = [b for b in self.buckets if b]  # (none at all where every parameter is frozen)
        self.bucket_of = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self.expect = 0
        self.count: dict[int, int] = {}
        self.left: list[int] = []
        self.started: dict[int, tuple[object, torch.Tensor, list[int]]] = {}
        """Bucket → (its all-reduce, the packed gradients and presence flags, where this replica had none)."""
        if overlap and self.group is not None:
            for p in params:
                p.register_post_accumulate_grad_hook(self._accumulated)

    def arm(self, backwards: int) -> None:
        """A step begins in which every parameter takes ``backwards`` accumulations."""
        self.expect = backwards
        self.count = {}
        self.left = [len(b) for b in self.buckets]
        self.started = {}

    def _accumulated(self, p: nn.Parameter) -> None:
        if self.expect == 0:  # not armed: a backward outside a replicated step
            return
        n = self.count.get(id(p), 0) + 1
        self.count[id(p)] = n
        if n == self.expect:
            k = self.bucket_of[id(p)]
            self.left[k] -= 1
            if self.left[k] == 0:
                self._start(k)

    def _start(self, k: int) -> None:
        flat, missing = presence.pack(self.buckets[k])
        self.started[k] = (dist.all_reduce(flat, group=self.group, async_op=True), flat, missing)

    def finish(self) -> None:
        """Start the buckets not started yet, wait for every one, write the sums into the gradients (and drop
        the gradient no replica had)."""
        if self.group is None:
            return
        for k in range(len(self.buckets)):
            if k not in self.started:
                self._start(k)
        for k, (work, flat, missing) in self.started.items():
            self.world.wait(work, "the gradient all-reduce")
            presence.unpack(self.buckets[k], flat, missing)
        self.expect = 0
