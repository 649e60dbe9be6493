"""AdamW set-up shared by engines: which parameters decay, and the state in canonical-name form."""

from __future__ import annotations

import torch
from torch import nn

from stratum.errors import StratumError
from stratum.runtime.engine import OptimSpec, TrainState

_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def decays(name: str, p: nn.Parameter) -> bool:
    """Weight decay applies to matrices (linear and embedding weights), not to biases and norm scales."""
    return p.ndim >= 2


def make_adamw(named: list[tuple[str, nn.Parameter]], spec: OptimSpec, device: torch.device) -> torch.optim.AdamW:
    """torch's AdamW over ``named`` with two groups (decay / no decay); fused kernels where the device has them."""
    groups = [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": spec.weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    # fused=True: one multi-threaded kernel per group; on CPU it is several times the foreach path.
    fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(groups, lr=0.0, betas=spec.betas, eps=spec.eps, fused=fused)


def export_state(opt: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]]) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer state keyed by canonical parameter name, as CPU tensors."""
    out = {}
    for name, p in named:
        st = opt.state.get(p)
        if st:
            out[name] = {k: st[k].detach().to("cpu", copy=True) for k in _STATE_KEYS if k in st}
    return out


def import_state(opt: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]],
                 state: dict[str, dict[str, torch.Tensor]]) -> None:
    """Load state saved by :func:`export_state` (from any engine) into ``opt``."""
    opt.state.clear()
    for name, p in named:
        if name in state:
            st = state[name]
            opt.state[p] = {k: st[k].to(p.device, copy=True) for k in _STATE_KEYS if k in st}


def load_train_state(opt: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]], state: TrainState) -> None:
    """Copy ``state``'s parameters into ``named`` (by canonical name) and its AdamW state into ``opt``.

    ``state`` may hold more parameters than ``named`` (a pipeline rank keeps its own part of a full state)."""
    missing = [n for n, _ in named if n not in state.params]
    if missing:
        raise StratumError(f"the training state lacks parameter(s) {missing[:3]}; it is from another model")
    with torch.no_grad():
        for n, p in named:
            p.copy_(state.params[n])
    import_state(opt, named, state.optim)
