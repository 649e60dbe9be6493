"""Gradients packed for a sum over ranks, with a flag per parameter saying whether the rank had a gradient.

Under the plain engine a parameter the step's micro-batches never reach (a branch not taken, a head not used)
ends the step without a gradient, and AdamW skips it: no moment update, no weight decay. A rank of a data-parallel
group whose share of the step missed such a parameter still has to send something, or the ranks' packed buffers
would not line up — so it sends zeros, and a flag of 0 beside them. After the sum a parameter whose flags sum to 0
was reached by no rank, and loses the zeros again: the step leaves it as the plain engine does.
"""

from __future__ import annotations

import torch
from torch import nn

from stratum.runtime.tensors import local_part


def fill_missing(params: list[nn.Parameter]) -> list[int]:
    """Give every parameter of ``params`` without a gradient zeros for one; their indices."""
    missing = []
    for j, p in enumerate(params):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
            missing.append(j)
    return missing


def grads_of(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """This rank's parts of ``params``' gradients (every one has a gradient: :func:`fill_missing`)."""
    return [local_part(p.grad) for p in params if p.grad is not None]


def pack(params: list[nn.Parameter]) -> tuple[torch.Tensor, list[int]]:
    """``params``' gradients (this rank's parts) in one buffer followed by one presence flag each, and the
    indices of the parameters that had no gradient here (given zeros, in the parameter itself too)."""
    missing = fill_missing(params)
    grads = grads_of(params)
    flags = torch.ones(len(grads), dtype=grads[0].dtype, device=grads[0].device)
    flags[missing] = 0
    return torch.cat([g.reshape(-1) for g in grads] + [flags]), missing


def unpack(params: list[nn.Parameter], flat: torch.Tensor, missing: list[int]) -> None:
    """Write the summed buffer back into ``params``' gradients; a parameter no rank had a gradient for ends
    without one. The flags are read only where this rank lacked one (reading them waits for the device)."""
    off = 0
    for p in params:
        assert p.grad is not None  # (pack gave every parameter one)
        g = local_part(p.grad)
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()
    if missing:
        present = flat[off:].tolist()
        for j in missing:
            if present[j] == 0:
                params[j].grad = None
