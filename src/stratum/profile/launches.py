"""Counting the ATen operators a piece of work dispatches that launch a kernel: one each, as eager PyTorch launches
them on a GPU.

:class:`KernelCounter` is a ``TorchDispatchMode``: every operator that reaches a device's kernels while it is active
passes through it, by name, with views and other metadata-only operators (a detach, an allocation) left out (and the
profiler's range markers). It sees the operators of the thread it is entered on and of autograd's backward of that
thread, not those of an engine's background threads (a GPU's side-stream copies, disk I/O): on a CPU with every tier in
RAM the offload engine runs all its work on the training thread (``step_model.runs_inline``), so there the count is the
whole step's. A ``_foreach_*`` or fused operator counts once, as a GPU runs it in one launch (per ~100 tensors); a CPU
runs it as a loop inside one dispatch.

:func:`ops_per_step` is "ops per step of engine X on its micro-batches": the test-facing and benchmark-facing
count of a training step's launches.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stratum.data.tokens import Batch
from stratum.runtime.engine import Engine

_NO_KERNEL = {torch.ops.aten.detach.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.lift_fresh.default,
              torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format}
"""Operators that only relabel or allocate a tensor (views are told by ``is_view``)."""
_NO_KERNEL_NAMESPACES = {"profiler"}
"""Operator namespaces that launch nothing (``torch.optim``'s step marks its profiler range with operators)."""

COPIES = ("aten.copy_", "aten._to_copy")
"""Operator name prefixes of the data movement a copy engine (or a memcpy) does: :func:`copy_ops`."""


class KernelCounter(TorchDispatchMode):
    """Counts the operators that launch a kernel, by operator name (``aten.add_.Tensor``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    @property
    def kernels(self) -> int:
        """All operators counted so far."""
        return sum(self.ops.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view and func not in _NO_KERNEL and func.namespace not in _NO_KERNEL_NAMESPACES:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(engine: Engine, micro_batches: list[Batch], lr: float, *, warmup: int = 1) -> Counter[str]:
    """The operators (by name) that ``engine`` dispatches in one training step on ``micro_batches`` after
    ``warmup`` steps on them (an offload engine records its access sequence in its first step, and the first
    step builds the optimizer's state: neither is the steady state). The engine takes ``warmup + 1`` steps."""
    for _ in range(warmup):
        engine.train_step(micro_batches, lr)
    with KernelCounter() as counter:
        engine.train_step(micro_batches, lr)
    return counter.ops


def copy_ops(ops: Counter[str]) -> int:
    """How many of ``ops`` move data (:data:`COPIES`)."""
    return sum(n for name, n in ops.items() if name.startswith(COPIES))


class CopiesInto(KernelCounter):
    """A :class:`KernelCounter` that also counts the ``copy_`` operators writing into given buffers — the storages
    of ``targets`` — e.g. an engine's host staging: on a CPU every copy is a memcpy, told apart only by where it
    writes."""

    def __init__(self, targets: list[torch.Tensor]) -> None:
        super().__init__()
        self.targets = {t.untyped_storage().data_ptr() for t in targets}
        self.into = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if str(func).startswith("aten.copy_") and args and isinstance(args[0], torch.Tensor) and (
                args[0].untyped_storage().data_ptr() in self.targets):
            self.into += 1
        return super().__torch_dispatch__(func, types, args, kwargs)
