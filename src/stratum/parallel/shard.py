"""ZeRO-2 for a replicate node: each of n replicas keeps 1/n of the gradients and of the AdamW state.

The engine's parameters are laid end to end in one flat fp32 buffer (decaying matrices first, then the rest) and
become views of it. After the backward the gradients are copied into a flat buffer and reduce-scattered: replica
i receives the summed gradients of the i-th n-th of the buffer and frees its full ones. Its AdamW runs on that
slice only — torch's own fused AdamW over one parameter view per tensor the slice touches, with the moments as
views of two slice-sized buffers — and an all-gather brings every replica the updated parameters.

Written here rather than taken from ``fully_shard``: FSDP shards the parameters themselves and owns the forward
and backward hooks, while a replicate node must shard the optimizer of whatever executor it wraps (a pipeline
stage, a local leaf) without touching how that executor runs its blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from stratum.dist.world import World
from stratum.runtime.engine import OptimSpec
from stratum.runtime.optim import Optimizer, decays
from stratum.runtime.tensors import grad_sq_norm


@dataclass
class _Piece:
    """The part of one parameter inside this replica's slice."""

    name: str
    offset: int
    """Start in the flat buffer."""
    length: int
    param: nn.Parameter
    """A view of the flat parameter buffer: what AdamW steps."""


class ShardedAdamW(Optimizer):
    """AdamW over this replica's 1/n slice of ``named`` (see the module docstring)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], spec: OptimSpec, world: World):
        self.world = world
        self.group = world.group("replica")
        self.n, self.index = world.size("replica"), world.coord.replica
        self.named = sorted(named, key=lambda np_: not decays(*np_))  # stable: decaying matrices first
        device = world.device
        self.offsets: dict[str, int] = {}
        total = 0
        for name, p in self.named:
            self.offsets[name] = total
            total += p.numel()
        self.shard_len = -(-total // self.n)
        self.flat = torch.zeros(self.shard_len * self.n, dtype=torch.float32, device=device)
        with torch.no_grad():
            for name, p in self.named:
                view = self.flat[self.offsets[name]:self.offsets[name] + p.numel()]
                view.copy_(p.detach().flatten())
                p.data = view.view_as(p)
        lo, hi = self.index * self.shard_len, (self.index + 1) * self.shard_len
        self.lo = lo
        self.exp_avg = torch.zeros(self.shard_len, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(self.shard_len, dtype=torch.float32, device=device)
        self.grad = torch.zeros(self.shard_len, dtype=torch.float32, device=device)
        self.pieces: list[_Piece] = []
        for name, p in self.named:
            a, b = max(lo, self.offsets[name]), min(hi, self.offsets[name] + p.numel())
            if a < b:
                self.pieces.append(_Piece(name, a, b - a, nn.Parameter(self.flat[a:b])))
        decay = {n for n, p in self.named if decays(n, p)}
        groups = [{"params": [x.param for x in self.pieces if x.name in decay], "weight_decay": spec.weight_decay},
                  {"params": [x.param for x in self.pieces if x.name not in decay], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        self.opt = torch.optim.AdamW(groups or [{"params": [nn.Parameter(self.flat[:0])]}], lr=0.0,
                                     betas=spec.betas, eps=spec.eps, fused=device.type in ("cpu", "cuda"))
        self.steps = {x.name: torch.zeros((), dtype=torch.float32, device=device) for x in self.pieces}
        self.had_grad: set[str] = set()
        self._bind_state()

    def _bind_state(self) -> None:
        """AdamW's moments are views of the slice buffers, so they can be gathered and loaded as one tensor."""
        for x in self.pieces:
            r = slice(x.offset - self.lo, x.offset - self.lo + x.length)
            self.opt.state[x.param] = {"step": self.steps[x.name], "exp_avg": self.exp_avg[r],
                                       "exp_avg_sq": self.exp_avg_sq[r]}

    def state_bytes(self) -> int:
        """Bytes of AdamW state this replica holds (the two moment slices)."""
        return (self.exp_avg.numel() + self.exp_avg_sq.numel()) * 4

    # ---- the step: reduce-scatter, norm, update, all-gather ---------------------------------------------
    def reduce_scatter(self) -> None:
        """Sum the replicas' gradients into this replica's slice and drop the full ones."""
        full = torch.zeros_like(self.flat)
        self.had_grad = set()
        for name, p in self.named:
            if p.grad is not None:
                full[self.offsets[name]:self.offsets[name] + p.numel()].copy_(p.grad.flatten())
                self.had_grad.add(name)
                p.grad = None
        # every replica runs the same model, so every replica has the same parameters without gradients
        self.world.wait(dist.reduce_scatter_single(self.grad, full, group=self.group, async_op=True),
                        "the gradient reduce-scatter")
        for x in self.pieces:
            r = slice(x.offset - self.lo, x.offset - self.lo + x.length)
            x.param.grad = self.grad[r] if x.name in self.had_grad else None

    def local_sq_norm(self, counted: set[str]) -> torch.Tensor:
        """Squared norm of this slice's gradients of the ``counted`` parameters."""
        return grad_sq_norm([x.param for x in self.pieces if x.name in counted])

    def step(self, lr: float, coef: torch.Tensor) -> None:
        grads = [x.param.grad for x in self.pieces if x.param.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(self.grad.device, self.grad.dtype))
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        for x in self.pieces:
            x.param.grad = None
        mine = self.flat[self.lo:self.lo + self.shard_len].clone()
        self.world.wait(dist.all_gather_single(self.flat, mine, group=self.group, async_op=True),
                        "the parameter all-gather")

    # ---- state in canonical form --------------------------------------------------------------------
    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        full = torch.empty(self.shard_len * self.n, dtype=shard.dtype, device=shard.device)
        self.world.wait(dist.all_gather_single(full, shard.contiguous(), group=self.group, async_op=True),
                        "gathering the optimizer state")
        return full

    def export(self) -> dict[str, dict[str, torch.Tensor]]:
        m, v = self._gather(self.exp_avg), self._gather(self.exp_avg_sq)
        steps = torch.zeros(len(self.named), dtype=torch.float32, device=self.flat.device)
        for i, (name, _) in enumerate(self.named):
            if name in self.steps:
                steps[i] = self.steps[name]
        # summed over the replicas whose slices a parameter spans (each holds the same count)
        self.world.all_reduce(steps, "replica", "gathering the optimizer steps")
        out = {}
        for i, (name, p) in enumerate(self.named):
            holders = sum(1 for r in range(self.n) if self._overlaps(name, p, r))
            step = steps[i] / max(1, holders)
            if step == 0:
                continue  # never updated: torch's AdamW holds no state for it either
            o = self.offsets[name]
            out[name] = {"step": step.cpu(), "exp_avg": m[o:o + p.numel()].view_as(p).cpu().clone(),
                         "exp_avg_sq": v[o:o + p.numel()].view_as(p).cpu().clone()}
        return out

    def _overlaps(self, name: str, p: nn.Parameter, replica: int) -> bool:
        a, b = self.offsets[name], self.offsets[name] + p.numel()
        return a < (replica + 1) * self.shard_len and b > replica * self.shard_len

    def load(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            self.exp_avg.zero_()
            self.exp_avg_sq.zero_()
            for x in self.pieces:
                st = state.get(x.name)
                r = slice(x.offset - self.lo, x.offset - self.lo + x.length)
                src = slice(x.offset - self.offsets[x.name], x.offset - self.offsets[x.name] + x.length)
                self.steps[x.name].fill_(float(st["step"]) if st else 0.0)
                if st:
                    self.exp_avg[r].copy_(st["exp_avg"].flatten()[src])
                    self.exp_avg_sq[r].copy_(st["exp_avg_sq"].flatten()[src])
