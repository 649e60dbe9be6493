"""AdamW on a chunk's flat tensors with torch's own fused kernel (``torch._fused_adamw_``).

This is exactly what ``torch.optim.AdamW(fused=True)`` runs per parameter group; the kernel is elementwise, so
running it over a chunk's contiguous flat range gives the same numbers as running it over the parameters one by
one (the parity tests check this against the plain engine). On this machine's CPU it is multi-threaded and
vectorised (about 1.4 G parameters/s on 2 cores), which no hand-written loop here beats, so it is used as is.
"""

from __future__ import annotations

import torch
from torch import Tensor


def adamw_flat(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: Tensor, *, lr: float, betas: tuple[float, float],
               eps: float, weight_decay: float) -> None:
    """One fused AdamW update of one contiguous range; ``step`` must already be incremented."""
    torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=lr, beta1=betas[0], beta2=betas[1],
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


def adamw_chunks(items: list[tuple], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float) -> None:
    """Update several chunks (or parameters), each ``(p, g, m, v, step, n_decay, used)``: elements
    ``[0, n_decay)`` with weight decay, ``[n_decay, used)`` without (either may be empty), with two fused calls in
    all (decayed ranges, the rest): a GPU pays a kernel launch per call, where a model of a hundred chunks would
    launch more per-chunk updates than it runs. Each chunk's step must already be advanced
    (``chunk_state.count_steps``), once however many of its ranges are listed."""
    for decay in (True, False):
        p, g, m, v, steps = [], [], [], [], []
        for it in items:
            lo, hi = (0, it[5]) if decay else (it[5], it[6])
            if hi <= lo:
                continue
            if lo == 0 and hi == it[0].numel():  # a whole parameter: as it is (four fresh views per parameter
                p.append(it[0])                   # and class are per-step Python work for nothing)
                g.append(it[1])
                m.append(it[2])
                v.append(it[3])
            else:
                p.append(it[0][lo:hi])
                g.append(it[1][lo:hi])
                m.append(it[2][lo:hi])
                v.append(it[3][lo:hi])
            steps.append(it[4])
        if p:
            torch._fused_adamw_(p, g, m, v, [], steps, lr=lr, beta1=betas[0], beta2=betas[1],
                                weight_decay=weight_decay if decay else 0.0, eps=eps, amsgrad=False, maximize=False)
