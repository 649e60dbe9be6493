"""AdamW set-up shared by engines: which parameters decay, and the state in canonical-name form."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from stratum.config import Config
from stratum.errors import StratumError
from stratum.runtime.engine import OptimSpec, TrainState
from stratum.runtime.tensors import full_tensor, load_full_, local_part, scale_grads_, shard_state

_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def decays(name: str, p: nn.Parameter) -> bool:
    """Weight decay applies to matrices (linear and embedding weights), not to biases and norm scales."""
    return p.ndim >= 2


def make_adamw(named: list[tuple[str, nn.Parameter]], spec: OptimSpec, device: torch.device) -> torch.optim.AdamW:
    """torch's AdamW over ``named`` in groups by decay (matrices decay) and, under a split plan, by DTensor or
    not — fused and foreach AdamW refuse a group that mixes the two (torch 2.13), each kind alone runs fused."""
    groups = []
    for decay in (True, False):
        for sharded in (False, True):
            ps = [p for n, p in named if decays(n, p) == decay and isinstance(p, DTensor) == sharded]
            if ps:
                groups.append({"params": ps, "weight_decay": spec.weight_decay if decay else 0.0})
    # fused=True: one multi-threaded kernel per group; on CPU it is several times the foreach path.
    fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(groups, lr=0.0, betas=spec.betas, eps=spec.eps, fused=fused)


def export_state(opt: torch.optim.Optimizer,
                 named: list[tuple[str, nn.Parameter]]) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer state keyed by canonical parameter name, as CPU tensors."""
    out = {}
    for name, p in named:
        st = opt.state.get(p)
        if st:
            out[name] = {k: full_tensor(st[k]) for k in _STATE_KEYS if k in st}
    return out


def import_state(opt: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]],
                 state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Load state saved by :func:`export_state` (from any engine) into ``opt``."""
    opt.state.clear()
    for name, p in named:
        if name in state:  # (moments in the parameter's dtype, as torch's AdamW makes them: a bf16 model's are bf16)
            opt.state[p] = shard_state({k: v if k == "step" else v.to(p.dtype)
                                        for k, v in state[name].items() if k in _STATE_KEYS}, p)


class Optimizer(abc.ABC):
    """What an engine's leaf steps its parameters with: the plain AdamW here, or a replicate node's sharded one
    (:mod:`stratum.parallel.shard`). State crosses in canonical-name form, as in :func:`export_state`."""

    @abc.abstractmethod
    def step(self, lr: float, coef: torch.Tensor) -> None:
        """Multiply the gradients by ``coef`` (the clip factor), one AdamW update, drop the gradients."""

    @abc.abstractmethod
    def export(self) -> dict[str, dict[str, torch.Tensor]]:
        """The AdamW state by canonical parameter name, on the CPU (collective for a sharded optimizer)."""

    @abc.abstractmethod
    def load(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Take the state :meth:`export` gave (from any engine); names this optimizer lacks are ignored."""

    @abc.abstractmethod
    def state_bytes(self) -> int:
        """Bytes of AdamW state this process holds."""


class LocalAdamW(Optimizer):
    """torch's AdamW over the parameters an engine holds (:func:`make_adamw`)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], spec: OptimSpec, device: torch.device):
        self.named = named
        self.opt = make_adamw(named, spec, device)

    def step(self, lr: float, coef: torch.Tensor) -> None:
        scale_grads_([p.grad for _, p in self.named if p.grad is not None], coef)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self._apply()
        self.opt.zero_grad(set_to_none=True)

    def _apply(self) -> None:
        """The AdamW step itself, on the (clipped) gradients."""
        self.opt.step()

    def export(self) -> dict[str, dict[str, torch.Tensor]]:
        return export_state(self.opt, self.named)

    def load(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        import_state(self.opt, self.named, state)

    def state_bytes(self) -> int:
        return sum(local_part(t).nbytes for st in self.opt.state.values() for t in st.values() if t.dim() > 0)


MakeOptimizer = Callable[[list[tuple[str, nn.Parameter]]], Optimizer]
"""Builds an engine's optimizer over its named parameters (a plan node chooses which)."""


def leaf_optimizer(make: MakeOptimizer | None, named: list[tuple[str, nn.Parameter]], spec: OptimSpec,
                   device: torch.device) -> Optimizer:
    """The optimizer the plan chose for an engine's parameters, or torch's AdamW where it chose none."""
    return make(named) if make is not None else LocalAdamW(named, spec, device)


def load_params(named: list[tuple[str, nn.Parameter]], state: TrainState) -> None:
    """Copy ``state``'s parameters into ``named`` by canonical name (``state`` may hold more: a pipeline rank
    keeps its own part of a full state)."""
    missing = [n for n, _ in named if n not in state.params]
    if missing:
        raise StratumError(f"the training state lacks parameter(s) {missing[:3]}; it is from another model")
    for n, p in named:
        if tuple(state.params[n].shape) != tuple(p.shape):
            raise StratumError(f"the training state's {n} has shape {tuple(state.params[n].shape)} where the model's "
                               f"has {tuple(p.shape)}; it is from another model")
    for n, p in named:
        load_full_(p, state.params[n])


def optim_spec(cfg: Config) -> OptimSpec:
    """The AdamW settings of ``cfg`` (the learning rate comes per step)."""
    o = cfg.optim
    return OptimSpec(betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, grad_clip=o.grad_clip)
