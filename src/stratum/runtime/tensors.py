"""Tensors that may be DTensors (a split plan's sharded parameters), handled alike by every engine.

A split plan (:mod:`stratum.parallel.split`) turns some parameters into DTensors; the engines, optimizers and
checkpoints stay the same by going through these helpers: the gradient norm as the unsplit model has it, clip
scaling, and whole (placement-independent) copies of parameters and AdamW state. On plain tensors they are the
ordinary operations. Functions marked *collective* must run on every rank of the split group, in the same order.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor


# ---- gradients -----------------------------------------------------------------------------------------------
def local_part(t: Tensor) -> Tensor:
    """This process's part of ``t``: a DTensor's local shard, else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def grad_sq_norm(params: list[Tensor]) -> Tensor:
    """Squared global norm (float64 scalar) of ``params``' gradients as the unsplit model has it (collective):
    a sharded gradient counts its shards summed over the split group, a replicated or plain one once."""
    whole: list[Tensor] = []
    shards: dict[tuple, Tensor] = {}
    for p in params:
        if p.grad is None:
            continue
        sq = p.grad.detach().to(torch.float64).square().sum()
        if isinstance(sq, DTensor) and any(pl.is_partial() for pl in sq.placements):
            key = (sq.device_mesh, sq.placements)
            shards[key] = shards.get(key, 0.0) + sq.to_local()
        else:
            whole.append(sq.to_local() if isinstance(sq, DTensor) else sq)
    total = torch.stack(whole).sum() if whole else torch.zeros((), dtype=torch.float64)
    for (mesh, placements), local in shards.items():
        # one reduction for all sharded gradients of a mesh, not one per tensor: DTensor sums the Partial
        total = total.to(local.device) + DTensor.from_local(local, mesh, placements).full_tensor()
    return total


def grad_norms(params: list[Tensor]) -> Tensor:
    """The gradient norms a global norm is made of, as a float32 vector: one per tensor, computed as
    ``torch.nn.utils.clip_grad_norm_`` computes them (so ``vector_norm`` of the result is its total norm, to the
    bit); where some gradients are split (DTensor), a single entry, the whole norm (collective)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(1)
    if any(isinstance(g, DTensor) for g in grads):
        return grad_sq_norm(params).sqrt().float().reshape(1)
    return torch.stack([n.to(grads[0].device) for n in torch._foreach_norm(grads, 2.0)])


def scale_grads_(grads: list[Tensor], coef: Tensor) -> None:
    """Multiply every gradient by ``coef`` (the clip factor): torch's foreach kernels refuse a list that mixes
    DTensors with plain tensors, so each kind (and device) gets its own call."""
    groups: dict[tuple[bool, torch.device], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((isinstance(g, DTensor), g.device), []).append(g)
    for (_, device), gs in groups.items():
        torch._foreach_mul_(gs, coef.to(device, gs[0].dtype))


# ---- placement-independent state ---------------------------------------------------------------------------
def full_tensor(t: Tensor) -> Tensor:
    """A CPU copy of the whole tensor: a parameter, a gradient or an AdamW state tensor, DTensor or not
    (collective for a DTensor)."""
    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.to("cpu", copy=True)


def shard_like(full: Tensor, like: Tensor) -> Tensor:
    """``full`` laid out as ``like``: this rank's shard as a DTensor with ``like``'s placements when ``like`` is a
    DTensor, else a copy on ``like``'s device. Every rank cuts its piece from its own copy of ``full``, so
    nothing is communicated; the piece is a fresh tensor that does not keep ``full`` alive."""
    if not isinstance(like, DTensor):
        return full.detach().to(like.device, copy=True)
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"a tensor of shape {tuple(full.shape)} cannot take the place of one of "
                         f"{tuple(like.shape)}")
    d = distribute_tensor(full.detach().to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return DTensor.from_local(d.to_local().clone(), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def load_full_(param: Tensor, full: Tensor) -> None:
    """Copy the whole tensor ``full`` into ``param`` (its local shard where ``param`` is a DTensor)."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            shard = shard_like(full, param)
            assert isinstance(shard, DTensor)  # (laid out as param, a DTensor)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)


def shard_state(state: dict[str, Tensor], like: Tensor) -> dict[str, Tensor]:
    """One parameter's AdamW state as saved whole (``exp_avg``, ``exp_avg_sq`` …, CPU) laid out for loading into
    an optimizer over the (possibly DTensor) parameter ``like``: tensors of the parameter's shape become its
    shards; ``step`` stays a plain scalar, as torch's AdamW keeps it for DTensor parameters too."""
    return {k: shard_like(v, like) if k != "step" and tuple(v.shape) == tuple(like.shape)
            else v.to(like.device, copy=True) for k, v in state.items()}


WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool,
               torch.uint8)
"""Dtypes a tensor header describes (what a block hands the next one across processes)."""
HEADER_LEN = 10
"""A tensor header's int64 entries: dtype code, dimensions, up to 8 sizes."""


def tensor_header(t: Tensor) -> Tensor | None:
    """The header a receiver needs to post a receive for ``t`` (its dtype and shape, as int64 on ``t``'s device);
    None for a tensor no header describes (over 8 dimensions, or a dtype not in :data:`WIRE_DTYPES`)."""
    if t.dim() > HEADER_LEN - 2 or t.dtype not in WIRE_DTYPES:
        return None
    h = [WIRE_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(h + [0] * (HEADER_LEN - len(h)), dtype=torch.int64, device=t.device)


def header_shape(header: Tensor) -> tuple[torch.Size, torch.dtype]:
    """The shape and dtype a :func:`tensor_header` describes."""
    code, ndim, *dims = header.tolist()
    return torch.Size(dims[:ndim]), WIRE_DTYPES[code]
