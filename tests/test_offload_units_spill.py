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
    its values, dtype and shape."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 5, generator=g), torch.randn(4, 7, generator=g).t(),
          torch.randint(0, 9, (6,), generator=g), torch.rand(5, generator=g) > 0.5, torch.randn(2, generator=g)]
    host = Tier("host", None)
    spill = ActivationSpill(torch.device("cpu"), host)
    for expected_copies in (len(xs), 1):
        spill.begin_microbatch()
        spill.begin_block(0)
        packed = [spill.pack(x) for x in xs]
        spill.end_block()
        with _CountCopies() as copies:
            spill.restore(0)
        assert copies.n == expected_copies
        for x, s in zip(xs, packed):
            y = spill.unpack(s)
            assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(y, x)
        spill.release(0)
    spill.close()
    assert host.used == 0


def test_views_that_cover_one_storage_are_spilled_once_and_come_back_as_themselves():
    """An attention output saved as (b, h, t, d) with permuted strides and again as its (b·t, h·d) reshape: one
    storage, spilled once as its bytes (a memcpy), and each saved tensor comes back as its own view with its
    strides; a slice of a storage (here q of a packed qkv) is spilled as that view; the same view saved twice is
    copied once. The profiler's spill bytes (same rule) equal what the spill copies."""
    from stratum.profile.profile import spill_key
    b, h, t, d = 2, 3, 4, 5
    g = torch.Generator().manual_seed(1)
    att = torch.randn(b, t, h, d, generator=g).transpose(1, 2)  # (b, h, t, d) over a (b, t, h, d) storage
    flat = att.transpose(1, 2).reshape(b * t, h * d)  # a view: same storage
    qkv = torch.randn(b, t, 3 * h * d, generator=g)
    q = qkv[..., :h * d]
    saved = [att, flat, q, q, att]
    spill = ActivationSpill(torch.device("cpu"), Tier("host", None))
    spill.begin_microbatch()
    spill.begin_block(0)
    packed = [spill.pack(x) for x in saved]
    spill.end_block()
    assert flat.untyped_storage().data_ptr() == att.untyped_storage().data_ptr()
    assert spill.bytes_d2h == att.numel() * 4 + q.numel() * 4
    assert sum(dict(spill_key(x) for x in saved).values()) == spill._block_bytes[0]
    spill.restore(0)
    for x, s in zip(saved, packed):
        y = spill.unpack(s)
        assert y.shape == x.shape and torch.equal(y, x)
        if x is not q:  # (a view spilled as a view comes back contiguous)
            assert y.stride() == x.stride()
    assert (spill.unpack(packed[0]).untyped_storage().data_ptr()
            == spill.unpack(packed[1]).untyped_storage().data_ptr())
    spill.close()
