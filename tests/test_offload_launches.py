"""Kernel launches per step of the offload engine against the plain engine, counted as CPU dispatches of ATen
operators (stratum.profile.launches): a GPU launches one kernel per dispatch, and a step that launches more than
plain's is bound by the host's launch rate (BENCHMARKS.md, the GPU rows). What the engine adds to a step must be
per chunk, never per parameter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stratum.data.tokens import Batch
from stratum.model.sequential import from_sequential
from stratum.offload.engine import OffloadEngine
from stratum.offload.planner import make_placement
from stratum.offload.tiers import DEVICE, HOST
from stratum.profile.launches import CopiesInto, ops_per_step
from stratum.runtime.plain import PlainEngine

from offload_helpers import DEV, batches, build, spec

pytestmark = pytest.mark.skipif(DEV.type != "cpu", reason="counts the training thread's dispatches: a CPU's step")

NO_BUDGET_BOUND = 1.02
"""Offload with no budget against plain, ops per step. Both run the same autograd graph and one fused AdamW call
per weight-decay class, so the engine's own ops are a few per step (the tied embedding's per-micro-batch sum).
One op per chunk would add 38 (4 % of the tiny GPT's ~900 ops) and one per parameter 150 (16 %): the bound
catches either."""


def _no_budget(model, precision: str) -> OffloadEngine:
    p = make_placement(model, device_budget=None, host_budget=None, disk_free=None, bandwidths=None, n_micro=2,
                       grad_clip=1.0, precision=precision)
    assert p.param_tier == DEVICE and p.optimizer_tier == DEVICE
    return OffloadEngine(model, optim=spec(), device=DEV, placement=p, precision=precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_no_budget_dispatches_what_plain_does(precision, tmp_path):
    plain = ops_per_step(PlainEngine(build("gpt", tmp_path), optim=spec(), device=DEV, precision=precision),
                         batches(0), 1e-3)
    eng = _no_budget(build("gpt", tmp_path), precision)
    try:
        off = ops_per_step(eng, batches(0), 1e-3)
    finally:
        eng.close()
    assert sum(off.values()) <= NO_BUDGET_BOUND * sum(plain.values()), (off - plain, plain - off)
    assert off["aten.copy_.default"] == 0  # nothing moves


V, D = 128, 64


class _Res(nn.Module):
    def __init__(self, *layers: nn.Module):
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(D), *layers)

    def forward(self, x):
        return x + self.f(x)


def _lm(split: bool, blocks: int = 6):
    """Six residual blocks of 2·D² weights each: two D×D matrices, or (``split``) four D×D/2 ones — the same
    elements, so the same chunks, in twice the parameter tensors."""
    torch.manual_seed(0)

    def body() -> nn.Module:
        if split:
            return _Res(*[nn.Linear(a, b, bias=False) for a, b in [(D, D // 2), (D // 2, D)] * 2])
        return _Res(nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False))
    return from_sequential(nn.Sequential(nn.Embedding(V, D), *[body() for _ in range(blocks)], nn.LayerNorm(D),
                                         nn.Linear(D, V)))


def _batches() -> list[Batch]:
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, V, (2, 17), generator=g) for _ in range(2)]
    return [Batch(x=d[:, :-1].contiguous(), y=d[:, 1:].contiguous()) for d in data]


def _streamed_engine(split: bool, precision: str, handoff: str = "auto") -> OffloadEngine:
    """3 of the 8 chunks of ``_lm(split)`` on the device, parameters and moments on the host (bf16: 16-bit chunks,
    fp32 masters; ``handoff``: offload.grad_handoff), its first step (which records the access sequence) taken."""
    m = _lm(split)
    p = make_placement(m, device_budget=None, host_budget=None, disk_free=None, bandwidths=None, n_micro=2,
                       grad_clip=1.0, chunk_elems=2 * D * D + 2 * D, resident_chunks=3, optimizer_tier=HOST,
                       activations="keep", prefetch_depth=1, precision=precision, grad_handoff=handoff)
    assert p.n_chunks == 8 and p.param_tier == HOST and p.half_params == (precision == "bf16")
    eng = OffloadEngine(m, optim=spec(), device=DEV, placement=p, precision=precision)
    eng.train_step(_batches(), 1e-3)
    return eng


def _streamed(split: bool, precision: str):
    """(plain's ops, the offload engine's ops, its chunk fetches) of one step of ``_streamed_engine``."""
    plain = ops_per_step(PlainEngine(_lm(split), optim=spec(), device=DEV, precision=precision), _batches(), 1e-3)
    eng = _streamed_engine(split, precision)
    try:
        before = eng.n_fetches
        off = ops_per_step(eng, _batches(), 1e-3, warmup=0)
        return plain, off, eng.n_fetches - before
    finally:
        eng.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_streamed_chunks_cost_ops_per_chunk_not_per_parameter(precision):
    """Twice the parameter tensors in the same chunks: the same chunk copies (one per fetch), and no more ops
    added per parameter than the plain engine's own step adds (its autograd accumulates and, in bf16, casts each
    gradient; the engine's hand-off of a gradient to the host optimizer replaces that accumulation)."""
    plain_a, off_a, fetched_a = _streamed(False, precision)
    plain_b, off_b, fetched_b = _streamed(True, precision)
    assert fetched_a == fetched_b > 8  # streaming: more fetches than chunks
    for off, fetched in [(off_a, fetched_a), (off_b, fetched_b)]:
        assert off["aten.copy_.default"] == fetched  # one copy per chunk fetch, nothing per parameter
    grown_off = sum(off_b.values()) - sum(off_a.values())
    grown_plain = sum(plain_b.values()) - sum(plain_a.values())
    assert 0 < grown_off <= grown_plain
    if precision == "fp32":  # the engine's ops beyond plain's are the same: all per chunk
        assert sum(off_b.values()) - sum(plain_b.values()) == sum(off_a.values()) - sum(plain_a.values())


@pytest.mark.parametrize("split", [False, True])
def test_chunk_handoff_copies_each_chunk_down_once_per_micro_batch(split):
    """offload.grad_handoff = chunk on bf16 chunks: the copies into the host staging are one per chunk and
    micro-batch (8 chunks × 2) with twice the parameter tensors as with one set, and the step dispatches exactly
    two operators per chunk and micro-batch more than the per-tensor hand-off's (that copy and the host's add:
    per parameter both paths copy or add each gradient once)."""
    n_micro, n_chunks = 2, 8
    tensor = _streamed_engine(split, "bf16", "tensor")
    chunk = _streamed_engine(split, "bf16", "chunk")
    try:
        assert chunk.handoff is not None and tensor.handoff is None
        per_tensor = ops_per_step(tensor, _batches(), 1e-3, warmup=0)
        staging = [s for ring in chunk.handoff.ring.values() for s, _ in ring]
        data = _batches()
        with CopiesInto(staging) as counter:
            chunk.train_step(data, 1e-3)
    finally:
        tensor.close()
        chunk.close()
    assert counter.into == n_chunks * n_micro
    assert counter.kernels - sum(per_tensor.values()) == 2 * n_chunks * n_micro, counter.ops - per_tensor
