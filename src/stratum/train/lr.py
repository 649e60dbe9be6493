"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr`` at the last step.

A pure function of the step, so resuming needs nothing but the step number.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate for (0-based) optimizer step ``step``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = total_steps - 1 - warmup_steps
    if span <= 0:  # warm-up leaves one step: it is the last, at min_lr (a one-step run's only step keeps lr)
        return min_lr if step > 0 else lr
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
