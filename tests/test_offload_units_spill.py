"""Unit tests of the activation spill (stratum.offload.activations) on its own, without an engine."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stratum.offload.activations import ActivationSpill
from stratum.offload.tiers import Tier


class _CountCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_a_spilled_block_comes_back_in_one_copy_once_the_arena_holds_it():
    """Once the host arena is sized (after the first micro-batch), a block's spilled tensors lie back to back in
    it as they will on the device, and the restore is one copy of the whole range (one launch on a GPU), not one
    per tensor; before that each is its own allocation and comes back alone. Either way every tensor returns with
    its values, dtype and shape, and the same view saved twice is copied once."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 5, generator=g), torch.randn(4, 7, generator=g).t(),
          torch.randint(0, 9, (6,), generator=g), torch.rand(5, generator=g) > 0.5, torch.randn(2, generator=g)]
    host = Tier("host", None)
    spill = ActivationSpill(torch.device("cpu"), host)
    for expected_copies in (len(xs), 1):
        spill.begin_microbatch()
        spill.begin_block(0)
        packed = [spill.pack(x) for x in xs] + [spill.pack(xs[0])]
        spill.end_block()
        assert packed[-1] is packed[0]
        with _CountCopies() as copies:
            spill.restore(0)
        assert copies.n == expected_copies
        for x, s in zip(xs + [xs[0]], packed):
            y = spill.unpack(s)
            assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(y, x)
        spill.release(0)
    spill.close()
    assert host.used == 0
