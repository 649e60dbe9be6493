"""The model a caller gave :func:`stratum.parallelize`, given back trained when the engine closes.

An engine need not train the caller's tensors in place: the memory engine streams them through chunks (the module's
own tensors end as stale views), a pipeline keeps only its stages (the others become ``meta``). So that the
caller's ``model`` is the trained model after ``close()`` — what a training loop of their own would leave —
rank 0's gathered state is written into every process's copy of the model, on the device each tensor was on when
it was given. A split plan's layers are the engine's own (DTensor parameters, redistribution hooks): such a model
is left as it is, and its state is ``state_dict()``'s.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from stratum.dist.world import World
from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq
from stratum.runtime.engine import TrainState

Places = dict[str, tuple[torch.device, torch.dtype]]
"""Canonical tensor name → where it was given and its dtype."""


def _tensors(model: BlockSeq) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by canonical name (each shared tensor once), those on ``meta`` included:
    the same names on every process, whatever part of the model it holds."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    seen = {id(t) for t in out.values()}
    for prefix, mod in model.named_modules():
        for name, t in mod._buffers.items():
            if t is not None and name not in mod._non_persistent_buffers_set and id(t) not in seen:
                seen.add(id(t))
                out[f"{prefix}.{name}" if prefix else name] = t
    return out


def places(model: BlockSeq) -> Places:
    """Where each parameter and persistent buffer of ``model`` is now, by canonical name (before an engine moves
    them)."""
    return {name: (t.device, t.dtype) for name, t in _tensors(model).items()}


def check_given(model: BlockSeq) -> None:
    """Refuse, by name, a model whose tensors are not all here: one a pipeline kept only part of, or one a split
    plan made its own (they came back from neither)."""
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise StratumError(f"the model's {name} is a DTensor: a split plan made this model's layers its own; "
                               "build the model again (or load a state_dict() into a new one) for another plan")
        if p.device.type == "meta":
            raise StratumError(f"the model's {name} is on the meta device (no values): build it again, or load "
                               "values into it, before parallelize")


def give_back(model: BlockSeq, state: TrainState, where: Places, world: World) -> None:
    """Write rank 0's ``state`` (every other process's may be empty) into ``model`` on every process, each tensor
    on the device it was given on, in its dtype; a model a split plan made its own is left as it is (on every
    process alike)."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return
    given = {**state.params, **state.buffers}
    wire = world.device if world.backend == "nccl" else torch.device("cpu")
    fresh: dict[int, torch.Tensor] = {}
    for name, t in _tensors(model).items():
        # (a tensor an engine added since is put back where it is, a meta one on the CPU)
        device, dtype = where.get(name, (t.device if t.device.type != "meta" else torch.device("cpu"), t.dtype))
        if world.rank == 0:  # (a buffer the state lacks keeps the model's own value)
            value = given[name].to(wire, dtype) if name in given else t.detach().to(wire, dtype)
        else:
            value = torch.empty(t.shape, dtype=dtype, device=wire)
        if world.backend != "none":
            world.wait(dist.broadcast(value, src=0, async_op=True), f"handing back the trained {name}")
        if t.device.type == "meta":  # (a meta tensor cannot take values in place: the modules get new ones)
            fresh[id(t)] = value.to(device)
        else:
            t.data = value.to(device)
    _replace(model, fresh)


def _replace(model: BlockSeq, fresh: dict[int, torch.Tensor]) -> None:
    """Every module's parameter or buffer that is a key of ``fresh`` (by id) replaced by its value — one new
    parameter for a tensor several modules share, so a tie stays a tie."""
    made: dict[int, torch.nn.Parameter] = {}
    for mod in model.modules():
        for k, p in mod._parameters.items():
            if p is not None and id(p) in fresh:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(fresh[id(p)], requires_grad=p.requires_grad)
                mod._parameters[k] = made[id(p)]
        for k, b in mod._buffers.items():
            if b is not None and id(b) in fresh:
                mod._buffers[k] = fresh[id(b)]
