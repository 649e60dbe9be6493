"""Adasum: combining replicas' gradients by their geometry instead of averaging them (Maleki et al., 2020).

For two gradients of one layer, ``adasum(a, b) = (1 − a·b / 2‖a‖²)·a + (1 − a·b / 2‖b‖²)·b``: parallel
gradients are averaged, orthogonal ones added. Over n replicas the pairs form a binary tree; with n not a power
of two the tree splits at the largest power of two below n (so for 2^k replicas it is Horovod's tree, and any n
works, where Horovod's allows only powers of two). Every layer (parameter tensor) is combined on its own.
"""

from __future__ import annotations

import torch


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two gradients of one layer, computed in float64 for the dot products."""
    dot = torch.dot(a.flatten().double(), b.flatten().double())
    na, nb = a.double().pow(2).sum(), b.double().pow(2).sum()
    # a zero gradient has no direction: it contributes nothing and leaves the other as it is
    ca = 1 - dot / (2 * na) if na > 0 else torch.ones((), dtype=torch.float64)
    cb = 1 - dot / (2 * nb) if nb > 0 else torch.ones((), dtype=torch.float64)
    return (ca * a.double() + cb * b.double()).to(a.dtype)


def split_point(n: int) -> int:
    """Where the tree over ``n`` replicas splits: the largest power of two below ``n``."""
    return 1 << ((n - 1).bit_length() - 1)


def tree(grads: list[torch.Tensor]) -> torch.Tensor:
    """Adasum of one layer's gradients from every replica, in replica order (the reference the engine matches)."""
    if len(grads) == 1:
        return grads[0]
    h = split_point(len(grads))
    return combine(tree(grads[:h]), tree(grads[h:]))
