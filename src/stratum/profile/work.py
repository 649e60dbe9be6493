"""Each block's kernel count and FLOPs (:class:`stratum.ir.work.Work`), counted on the meta device: no compute.

Every block runs one forward and backward on one sample of meta tensors (shapes only) under two dispatch modes:
``torch.utils.flop_counter.FlopCounterMode`` (PyTorch's FLOP counts of the matrix products, convolutions and
attention; element-wise work counts no FLOPs) and a counter of the ATen operators that reach the device, views
and other metadata-only operators excluded — one kernel each, as eager PyTorch launches them. The operators are
those of the meta device's kernels: scaled-dot-product attention there runs its math form (about ten operators
where CUDA's fused attention launches one or two), so an attention block's count errs high.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from stratum.ir.work import Work
from stratum.model.blockseq import BlockSeq
from stratum.profile.launches import KernelCounter


def _inputs(model: BlockSeq, seq_len: int) -> tuple[Tensor, Tensor]:
    vocab = max(model.info.vocab_size, 1)
    x = torch.randint(0, vocab, (1, seq_len), device="meta")
    return x, torch.randint(0, vocab, (1, seq_len), device="meta")


def _count_block(model: BlockSeq, i: int, x: Tensor, y: Tensor) -> tuple[int, float, Tensor]:
    """Block ``i``'s (kernels, FLOPs) of a forward + backward on ``x``, and its output (the next input)."""
    block = model.blocks[i]
    for p in block.parameters():
        p.grad = None
    inp = x.detach().requires_grad_(i > 0 and x.is_floating_point())  # the data itself needs no gradient
    last = i == len(model) - 1
    flops, counter = FlopCounterMode(display=False), KernelCounter()
    with flops, counter:  # one context: FlopCounterMode starts again from zero on entry
        out = block(inp)
        if last:
            model.loss_fn(out, y).backward()
        else:
            torch.autograd.backward(out, torch.empty_like(out))  # the next block's gradient: an allocation
    for p in block.parameters():
        p.grad = None
    return counter.kernels, float(flops.get_total_flops()), out.detach()


def count_work(model: BlockSeq, *, seq_len: int) -> Work:
    """Kernels and FLOPs per sample (one sequence of ``seq_len`` tokens) of every block of a language model
    built on the meta device."""
    return count_work_on(model, *_inputs(model, seq_len))


def count_work_on(model: BlockSeq, x: Tensor, y: Tensor) -> Work:
    """Kernels and FLOPs of every block of ``model`` (built on the meta device) on one sample: input ``x`` and
    target ``y``, meta tensors with a batch of one; identical blocks are counted once."""
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError("count_work needs the model built on the meta device")
    seen: dict[tuple, tuple[int, float, Tensor]] = {}
    kernels, flops = [], []
    for i, block in enumerate(model.blocks):
        sig = (type(block).__name__, i == len(model) - 1, tuple(x.shape), x.dtype,
               tuple((n, tuple(p.shape)) for n, p in block.named_parameters()))
        if sig not in seen:
            seen[sig] = _count_block(model, i, x, y)
        k, f, x = seen[sig]
        kernels.append(k)
        flops.append(f)
    return Work(kernels=kernels, flops=flops)
