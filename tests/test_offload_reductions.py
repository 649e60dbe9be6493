"""A parent's chunk reductions run beside the offload engine's backward: launched as each chunk completes, waited
for after later blocks' backward, and the result is still the plain engine's (one process, a stand-in reducer)."""

from __future__ import annotations

import pytest
import torch

from stratum.offload.chunks import pack
from stratum.offload.engine import OffloadEngine
from stratum.offload.placement import Placement
from stratum.offload.reductions import MAX_IN_FLIGHT, overlapped
from stratum.offload.tiers import DEVICE, HOST

from offload_helpers import DEV, assert_same, build, plain, run, spec


class _Collective:
    """A stand-in for a collective in flight: it takes a packed copy of the gradients at launch (as the
    replicate reducers do) and writes that copy back when finished — so a slot reused or a gradient moved while
    it is in flight shows as a wrong loss. It never reports itself complete before it is finished."""

    def __init__(self, grads: list[torch.Tensor], log: list):
        self.grads = grads
        self.copy = [g.clone() for g in grads]
        self.log = log

    def ready(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.copy)

    def finish(self) -> None:
        for g, c in zip(self.grads, self.copy):
            g.copy_(c)
        self.log.append(len(self.grads))


CHUNK = 17_408  # fp32 elements: three chunks per block of the test GPT


@pytest.mark.parametrize("clip,param_tier,optimizer_tier", [
    (1.0, HOST, HOST),      # CPU: autograd's gradients held for the host optimizer, updated after the norm
    (0.0, HOST, DEVICE),    # gradients in the slots, updated there; the fewest slots: evictions meet reductions
    (1.0, DEVICE, DEVICE),  # every chunk and its moments on the device, autograd's own gradients
])
def test_chunk_reductions_are_waited_for_after_later_blocks_backward_and_match_plain(clip, param_tier,
                                                                                      optimizer_tier, tmp_path):
    model = build("gpt", tmp_path)
    p = Placement(chunk_elems=CHUNK, resident_chunks=pack(model, CHUNK).max_chunks_per_block() + 1,
                  optimizer_tier=optimizer_tier, param_tier=param_tier, prefetch_depth=2)
    eng = OffloadEngine(model, optim=spec(clip), device=DEV, placement=p)
    finished: list[int] = []
    eng.reducer = lambda names, grads, what: _Collective(grads, finished)
    ref = run(plain(build("gpt", tmp_path), clip=clip), 2)
    try:
        for s in range(2):  # the first step records the access sequence; the second prefetches by it
            got = run(eng, 1, start=s)[0]
            assert_same([got.loss, got.grad_norm], [ref[s].loss, ref[s].grad_norm])
            log = eng.reduce_log
            launched = [i for what, i in log if what == "launch"]
            waited = [i for what, i in log if what == "wait"]
            assert len(launched) >= 2 and sorted(waited) == sorted(launched) == sorted(set(launched))
            assert overlapped(log) >= 1  # some block's backward ran between a launch and its wait
            depth = 0
            for what, _ in log:  # never more than MAX_IN_FLIGHT launched and not waited for
                depth += {"launch": 1, "wait": -1}.get(what, 0)
                assert depth <= MAX_IN_FLIGHT
            assert eng.step_io()["reductions_overlapped"] == overlapped(log)
        assert not eng._in_flight and len(finished) == 2 * len(launched)
    finally:
        eng.close()


class _Doubling(_Collective):
    """A stand-in whose result is twice what it was given (two replicas with the same gradient, summed)."""

    def finish(self) -> None:
        for c in self.copy:
            c.mul_(2)
        super().finish()


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_chunk_reductions_read_the_per_chunk_hand_offs_accumulators(clip, tmp_path):
    """bf16 chunks with the per-chunk gradient hand-off: each chunk's reduction gets its gradient from the fp32
    accumulator once the host's adds are done, and its result is what the norm reads — twice the gradient gives
    the first step's loss and twice its gradient norm."""
    got = {}
    for reduce in (False, True):
        model = build("gpt", tmp_path)
        p = Placement(chunk_elems=CHUNK, resident_chunks=pack(model, CHUNK).max_chunks_per_block() + 1,
                      optimizer_tier=HOST, param_tier=HOST, prefetch_depth=2, half_params=True, chunk_grads=True)
        eng = OffloadEngine(model, optim=spec(clip), device=DEV, placement=p, precision="bf16")
        finished: list[int] = []
        if reduce:
            eng.reducer = lambda names, grads, what, log=finished: _Doubling(grads, log)
        try:
            got[reduce] = run(eng, 1)[0]
        finally:
            eng.close()
        assert bool(finished) == reduce
    assert got[True].loss == got[False].loss and got[True].grad_norm == 2 * got[False].grad_norm
