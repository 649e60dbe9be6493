"""The model a caller gave :func:`stratum.parallelize`, given back trained when the engine closes.

An engine need not train the caller's tensors in place: the memory engine streams them through chunks (the module's
own tensors end as stale views), a pipeline keeps only its stages (the others become new ``meta`` parameters). So
that the caller's ``model`` is the trained model after ``close()`` — what a training loop of their own would leave —
rank 0's gathered state is written into every process's copy of the model, into the very tensor objects it was
given (what the caller holds of them — an optimizer, an EMA, a hook — stays the model's), on the device each was on.
While the engine runs, a given tensor an engine replaced holds no memory (a pipeline rank keeps only its stages').
A split plan's layers are the engine's own (DTensor parameters, redistribution hooks): such a model is left as it
is, and its state is ``state_dict()``'s.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from stratum.dist.world import World
from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq
from stratum.model.neutral import all_persistent_buffers
from stratum.runtime.engine import TrainState


@dataclass(frozen=True)
class Given:
    """The tensors a model was given with, by canonical name, and where each was."""

    tensors: dict[str, torch.Tensor]
    places: dict[str, tuple[torch.device, torch.dtype]]


def _tensors(model: BlockSeq) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by canonical name (each shared tensor once), those on ``meta`` included:
    the same names on every process, whatever part of the model it holds."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    seen = {id(t) for t in out.values()}
    out.update({name: t for name, t in all_persistent_buffers(model).items() if id(t) not in seen})
    return out


_HELD: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
"""The given tensors of this process's open engines, by id: one engine at a time trains a tensor (two would each
step on values the other replaces, and both write back at close)."""


def check_free(model: BlockSeq) -> None:
    """Refuse a model an open engine of this process was given (until that engine's ``close()``)."""
    for name, t in _tensors(model).items():
        if _HELD.get(id(t)) is t:
            raise StratumError(f"the model's {name} is being trained by an engine that is still open: call that "
                               "engine's close() first (it gives the trained model back), then parallelize again")


def hold(what: Given) -> None:
    """Mark ``what``'s tensors as an open engine's."""
    for t in what.tensors.values():
        _HELD[id(t)] = t


def let_go(what: Given) -> None:
    """``what``'s tensors are no open engine's any more."""
    for t in what.tensors.values():
        if _HELD.get(id(t)) is t:
            del _HELD[id(t)]


def given(model: BlockSeq) -> Given:
    """``model``'s tensors as given, before an engine moves or replaces any."""
    tensors = _tensors(model)
    return Given(tensors=tensors, places={name: (t.device, t.dtype) for name, t in tensors.items()})


def release_replaced(model: BlockSeq, what: Given) -> None:
    """Let the given tensors an engine replaced (another stage's, now on ``meta``) hold no memory until
    :func:`give_back` refills them."""
    now = _tensors(model)
    with torch.no_grad():
        for name, t in what.tensors.items():
            if now.get(name) is not t and t.device.type != "meta":
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)


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


def give_back(model: BlockSeq, state: TrainState, what: Given, world: World) -> None:
    """Write rank 0's ``state`` (every other process's may be empty) into ``model`` on every process — into the
    tensors it was given, back in its modules, each on the device it was given on, in its dtype; a model a split
    plan made its own is left as it is (on every process alike)."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return
    values = {**state.params, **state.buffers}
    wire = world.device if world.backend == "nccl" else torch.device("cpu")
    back: dict[int, torch.Tensor] = {}
    for name, t in _tensors(model).items():
        target = what.tensors.get(name, t)  # (one an engine added since: filled where it is)
        device, dtype = what.places.get(name, (t.device, t.dtype))
        if world.rank == 0:  # (a buffer the state lacks keeps the model's own value)
            value = values[name].to(wire, dtype) if name in values else t.detach().to(wire, dtype)
        else:
            value = torch.empty(t.shape, dtype=dtype, device=wire)
        if world.backend != "none":
            world.wait(dist.broadcast(value, src=0, async_op=True), f"handing back the trained {name}")
        if target.device.type == "meta":  # (nothing in place can take values: a new tensor)
            target = nn.Parameter(value.to(device), requires_grad=t.requires_grad) \
                if isinstance(t, nn.Parameter) else value.to(device)
        else:
            with torch.no_grad():
                target.data = value.to(device)
        if target is not t:
            back[id(t)] = target
    _put_back(model, back)


def _put_back(model: BlockSeq, back: dict[int, torch.Tensor]) -> None:
    """Every module's parameter or buffer whose id is a key of ``back`` replaced by its value (a tensor several
    modules share is one, so a tie stays a tie)."""
    for mod in model.modules():
        for k, p in mod._parameters.items():
            if p is not None and id(p) in back:
                mod._parameters[k] = back[id(p)]  # type: ignore[assignment]
        for k, b in mod._buffers.items():
            if b is not None and id(b) in back:
                mod._buffers[k] = back[id(b)]
