"""Mixed-precision placement (Placement.half_params): under train.precision = bf16 with the optimizer state off
the device, the offload engine's device chunks are bf16 working copies of fp32 masters kept on the host or the disk
beside the AdamW moments; gradients go to the host in 16 bits and are accumulated there in fp32 (docs/offload.md).

Tolerances, from runs of these tests' models on this machine's CPU (10 steps of 2 micro-batches, dropout 0.1,
clipping at 1.0; losses: the largest relative difference of a step's loss; weights: relative L2 distance of all
parameters after the 10 steps, which moved them 0.19 from their initial values):

=====================================================  ===============  ===============
run against plain bf16 (autocast, fp32 weights)         gpt loss/weight  sequential
=====================================================  ===============  ===============
plain fp32                                              1.2e-4 / 4.9e-3  (not measured)
plain bf16 from bf16-rounded initial weights            1.1e-4 / 5.4e-3  (not measured)
the recipe written out by hand (``HalfReference``)      4.9e-4 / 8.7e-3  4.2e-4 / 1.2e-3
offload engine, bf16 chunks                             3.8e-4 / 8.7e-3  4.2e-4 / 1.2e-3
the same, gradients handed over per chunk               4.9e-4 / 8.7e-3  4.2e-4 / 1.2e-3
=====================================================  ===============  ===============

The offload engine's gap to plain bf16 is the recipe's own (the hand-written recipe is as far): every op that
reads a parameter reads its bf16 copy — an embedding, a layer norm, a bias outside a matmul — where plain bf16
reads those in fp32, and GPT's residual stream starts from a bf16 embedding. LOSS_REL and WEIGHT_REL allow about
twice the largest gap measured. Against the hand-written recipe the engine is exact where no tensor is tied; GPT's
tied embedding gets two gradient contributions per micro-batch (its two blocks run their backward apart), summed in
fp32 on the host where autograd sums them in bf16 first: 1.5e-4 / 3.0e-3 measured, TIED_* allow about three times
that. Handed over per chunk (offload.grad_handoff = chunk) they are summed in bf16 on the device, as autograd sums
them, and GPT too is the hand-written recipe bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from stratum.errors import StratumError
from stratum.offload.chunks import pack
from stratum.offload.engine import OffloadEngine
from stratum.offload.grad_handoff import handoff_bytes, open_chunks
from stratum.offload.placement import Placement
from stratum.offload.step_model import half_chunks
from stratum.offload.tiers import DEVICE, DISK, HALF, HOST, Bandwidths
from stratum.runtime.loss_scale import LossScaleSpec
from stratum.runtime.plain import PlainEngine

from offload_helpers import DEV, plan, profile, spec, state_bytes
from test_offload_engine import _run_checking_traffic, build, run

STEPS = 10
LOSS_REL, WEIGHT_REL = 1e-3, 2e-2
"""Offload engine with bf16 chunks against plain bf16 (module docstring)."""
TIED_LOSS_REL, TIED_WEIGHT_REL = 5e-4, 1e-2
"""Offload engine with bf16 chunks against ``HalfReference`` where a tensor is tied (module docstring)."""


class HalfReference(PlainEngine):
    """The mixed-precision recipe written out over the plain engine: each step's forward and backward run on bf16
    copies of the fp32 weights, each gradient contribution is added into an fp32 accumulator, and the plain
    engine's clipping and fused AdamW update the fp32 weights."""

    def forward_backward(self, micro_batches, divisor):
        masters = [p.data for p in self.params]
        acc: dict[int, torch.Tensor] = {}

        def take(p):
            acc[id(p)] = p.grad.float() if id(p) not in acc else acc[id(p)].add_(p.grad)
            p.grad = None
        hooks = [p.register_post_accumulate_grad_hook(take) for p in self.params]
        for p, m in zip(self.params, masters):
            p.data = m.bfloat16()
        try:
            return super().forward_backward(micro_batches, divisor)
        finally:
            for h in hooks:
                h.remove()
            for p, m in zip(self.params, masters):
                p.data, p.grad = m, acc.get(id(p))


class DelayedHalfReference(HalfReference):
    """``HalfReference`` with the one-step-delayed update: each step's gradients (with their clip coefficient and
    learning rate) update the weights after the next step's forward and backward; ``flush`` applies the pending
    one now (as the engine's checkpoint does)."""

    pending: tuple | None = None

    def update(self, lr, coef):
        ready, self.pending = self.pending, ([p.grad for p in self.params], lr, coef)
        for p in self.params:
            p.grad = None
        if ready is not None:
            self._apply(ready)

    def _apply(self, ready):
        grads, lr, coef = ready
        for p, g in zip(self.params, grads):
            p.grad = g
        super().update(lr, coef)

    def flush(self):
        ready, self.pending = self.pending, None
        if ready is not None:
            self._apply(ready)


def _weight_dist(got, want) -> float:
    """Relative L2 distance of all parameters of two TrainStates."""
    num = sum(float((got.params[n].double() - w.double()).norm() ** 2) for n, w in want.params.items())
    return (num / sum(float(w.double().norm() ** 2) for w in want.params.values())) ** 0.5


def _rel(got, want) -> float:
    return max(abs(a.loss - b.loss) / abs(b.loss) for a, b in zip(got, want))


@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("offload-mixed")


_profiles: dict = {}


def _profile(source: str, tmp, precision: str = "fp32"):
    if (source, precision) not in _profiles:
        _profiles[source, precision] = profile(build(source, tmp), precision=precision)
    return _profiles[source, precision]


def _bf16_plan(model, prof, **kw) -> Placement:
    return plan(model, prof, precision="bf16", optimizer_tier=HOST, activations="recompute", **kw)


def _device_bytes(eng: OffloadEngine) -> int:
    """What the device tier holds besides activations: each slot's and pinned chunk's 16-bit parameters, and the
    per-chunk hand-off's 16-bit buffers."""
    p = eng.placement
    params = p.resident_chunks * p.chunk_elems + sum(c.cap for c in eng.chunks if c.pinned)
    return HALF * params + (handoff_bytes(eng.layout)[DEVICE] if p.chunk_grads else 0)


@pytest.mark.skipif(DEV.type != "cpu", reason="the tolerances were measured on a CPU")
@pytest.mark.parametrize("handoff", ["tensor", "chunk"])
@pytest.mark.parametrize("source", ["gpt", "sequential"])
def test_bf16_chunks_follow_the_recipe_and_plain_bf16(source, handoff, shared_tmp):
    """Chunks streamed through a budget of 10 % of the training state: the device tier holds each slot's and
    pinned chunk's parameters in 16 bits (and the per-chunk hand-off's buffers: the plan's device bytes, within
    the budget), every link moves what the step model predicts, and the losses and fp32 masters follow the
    hand-written recipe (exactly where nothing is tied, and with the per-chunk hand-off, which sums a tied
    tensor's contributions in bf16 as autograd does) and plain bf16 within the measured tolerances."""
    m, prof = build(source, shared_tmp), _profile(source, shared_tmp)
    p = _bf16_plan(m, prof, device_budget=state_bytes(m) // 10, grad_handoff=handoff)
    assert p.half_params and p.param_tier == HOST and p.resident_chunks < p.n_chunks  # really streaming
    assert p.chunk_grads == (handoff == "chunk") and p.predicted_peak[DEVICE] <= state_bytes(m) // 10
    eng = OffloadEngine(m, optim=spec(), device=DEV, placement=p, precision="bf16")
    try:
        params = len(eng.slots) * p.chunk_elems + sum(c.cap for c in eng.chunks if c.pinned)
        buffers = handoff_bytes(eng.layout)[DEVICE] if p.chunk_grads else 0
        assert eng.tiers[DEVICE].used == HALF * params + buffers == p.predicted_peak[DEVICE] - p.act_bytes
        assert all(s.dtype == torch.bfloat16 for s in eng.slots)
        assert sum(c.hp.numel() for c in eng.chunks) * 4 <= eng.tiers[HOST].used  # the fp32 masters, on the host
        got = _run_checking_traffic(eng, STEPS)
        assert eng.tiers[DEVICE].used == _device_bytes(eng)
        if p.chunk_grads:  # every host buffer is allocated up front: the accumulators, staging, masters, moments
            assert eng.tiers[HOST].peak == p.predicted_peak[HOST]
        st = eng.state()
    finally:
        eng.close()
    hand = HalfReference(build(source, shared_tmp), optim=spec(), device=DEV, precision="bf16")
    by_hand = run(hand, STEPS)
    if source == "sequential" or p.chunk_grads:  # the engine is the recipe, bit for bit (its gap to plain: below)
        assert [r.loss for r in got] == [r.loss for r in by_hand]
        assert all(torch.equal(st.params[n], w) for n, w in hand.state().params.items())
    if source == "sequential":
        return
    assert _rel(got, by_hand) <= TIED_LOSS_REL and _weight_dist(st, hand.state()) <= TIED_WEIGHT_REL
    ref = PlainEngine(build(source, shared_tmp), optim=spec(), device=DEV, precision="bf16")
    want = run(ref, STEPS)
    assert _rel(got, want) <= LOSS_REL and _weight_dist(st, ref.state()) <= WEIGHT_REL


def test_bf16_checkpoint_is_the_fp32_masters_and_resumes_under_another_placement(shared_tmp):
    """A checkpoint of bf16 chunks holds the fp32 masters and moments: resumed with every chunk pinned on the
    device (a 16-bit copy each, the masters on the host), the next steps are the uninterrupted streamed run's."""
    m, prof = build("gpt", shared_tmp), _profile("gpt", shared_tmp)
    a = OffloadEngine(m, optim=spec(), device=DEV, placement=_bf16_plan(m, prof, device_budget=state_bytes(m) // 10),
                      precision="bf16")
    run(a, 2)
    st = a.state()
    assert all(t.dtype == torch.float32 for t in st.params.values())
    cont = run(a, 2, start=2)
    a.close()
    m2 = build("gpt", shared_tmp)
    p2 = _bf16_plan(m2, prof)
    assert p2.half_params and p2.param_tier == DEVICE
    b = OffloadEngine(m2, optim=spec(), device=DEV, placement=p2, precision="bf16")
    b.load_state(st)
    assert [r.loss for r in run(b, 2, start=2)] == [r.loss for r in cont]
    b.close()


def test_planner_counts_16_bit_chunks_only_where_the_masters_are_off_the_device(shared_tmp):
    """Same chunks and slots planned for bf16 and fp32: the device holds half the parameter bytes and fetches move
    half; fp32 or a device optimizer keep fp32 chunks; an engine refuses a bf16 placement under fp32 precision."""
    m, prof = build("gpt", shared_tmp), _profile("gpt", shared_tmp)
    fixed = dict(optimizer_tier=HOST, activations="recompute")
    half = plan(m, prof, precision="bf16", device_budget=state_bytes(m) // 10, grad_handoff="tensor", **fixed)
    full = plan(m, prof, chunk_elems=half.chunk_elems, resident_chunks=half.resident_chunks, **fixed)
    assert half.half_params and not full.half_params and full.param_tier == HOST
    assert "16-bit working copies on the device" in half.describe()
    C, R = half.chunk_elems, half.resident_chunks
    pinned = sum(c.capacity for c in pack(m, C).chunks if c.pinned)
    assert pinned > 0  # (the tied embedding)
    # fp32: a slot's parameters (its gradients go to the host), a pinned chunk's parameters and gradients, and
    # the tied chunk's per-micro-batch gradient; bf16: the parameters in 16 bits, nothing else
    assert full.predicted_peak[DEVICE] - full.act_bytes == 4 * R * C + 8 * pinned + 4 * pinned
    assert half.predicted_peak[DEVICE] - half.act_bytes == HALF * (R * C + pinned)
    # offload.grad_handoff: auto hands over per tensor where copies are not asynchronous (a CPU), per chunk where
    # they are; per chunk, the device also holds the tied chunk's buffer and a pool of five chunk-sized ones (a
    # block spans four chunks here, the first shared with the block before, plus the spare), the host a staging
    # buffer for the tied chunk and two for the others; each micro-batch sends each chunk's used elements once
    assert not half.chunk_grads and not plan(m, prof, precision="bf16", bandwidths=None, **fixed).chunk_grads
    gpu = Bandwidths(h2d=20e9, d2h=20e9, disk_read=2e9, disk_write=1e9, adam_params_per_s=1e9, async_copies=True)
    assert plan(m, prof, precision="bf16", bandwidths=gpu, **fixed).chunk_grads
    by_chunk = plan(m, prof, precision="bf16", chunk_elems=C, resident_chunks=R, grad_handoff="chunk", **fixed)
    layout = pack(m, C)
    assert open_chunks(layout) == 4 and by_chunk.chunk_grads
    assert by_chunk.predicted_peak[DEVICE] - by_chunk.act_bytes == HALF * (R * C + pinned) + HALF * (pinned + 5 * C)
    assert by_chunk.predicted_peak[HOST] - half.predicted_peak[HOST] == HALF * (pinned + 2 * C)
    assert by_chunk.predicted_traffic["d2h"] == 2 * HALF * sum(c.used for c in layout.chunks)
    assert half.predicted_traffic["d2h"] == 2 * HALF * layout.grad_elems  # (the tied tensor twice)
    assert not plan(m, prof, grad_handoff="chunk", **fixed).chunk_grads  # fp32: no 16-bit gradients
    # a device budget the chunks' buffers do not fit: auto hands over per tensor there, chunk is refused
    tight = dict(precision="bf16", chunk_elems=C, resident_chunks=R, device_budget=half.predicted_peak[DEVICE])
    assert not plan(m, prof, bandwidths=gpu, **tight, **fixed).chunk_grads
    with pytest.raises(StratumError):
        plan(m, prof, bandwidths=gpu, grad_handoff="chunk", **tight, **fixed)
    with pytest.raises(StratumError, match="offload.grad_handoff = 'bucket' is not one of: auto, chunk, tensor"):
        plan(m, prof, precision="bf16", grad_handoff="bucket", **fixed)
    assert not plan(m, prof, precision="bf16", optimizer_tier=DEVICE).half_params
    # a host too small for the 16-bit copies of disk masters and the fp32 gradient accumulators: fp32 chunks on disk
    S = state_bytes(m)
    tight = plan(m, prof, precision="bf16", device_budget=S // 10, host_budget=S // 8, optimizer_tier=DISK,
                 activations="recompute")
    assert not tight.half_params and tight.param_tier == DISK
    assert not half_chunks("fp32", DISK, DISK) and not half_chunks("bf16", DEVICE, DISK)
    assert half_chunks("bf16", HOST, HOST) and half_chunks("bf16", HOST, DEVICE)
    with pytest.raises(StratumError, match="plan it with the run's precision"):
        OffloadEngine(build("gpt", shared_tmp), optim=spec(), device=DEV, placement=half, precision="fp32")


DELAYED_REL = 3e-2
"""The delayed update against plain bf16 (largest relative loss difference over 10 steps at the tests' learning
rate): 1.0e-2 measured for the ``nn.Sequential`` model, 1.7e-2 for GPT (it trains one update behind)."""


@pytest.mark.skipif(DEV.type != "cpu", reason="bit-exact against the hand-written reference on a CPU")
def test_delayed_update_is_the_one_step_stale_recipe(shared_tmp):
    """offload.delayed_update: step t + 1 runs on weights with every gradient up to step t - 1's — the hand-written
    delayed recipe's losses bit for bit, streamed at 10 % with the plan's traffic; a checkpoint applies the pending
    update and resumes exactly; the losses stay within DELAYED_REL of plain bf16 (stated, not exact)."""
    src = "sequential"
    m, prof = build(src, shared_tmp), _profile(src, shared_tmp)
    p = _bf16_plan(m, prof, device_budget=state_bytes(m) // 10)
    a = OffloadEngine(m, optim=spec(), device=DEV, placement=p, precision="bf16", delayed_update=True)
    got = _run_checking_traffic(a, 3)  # the same bytes as without the delay
    st = a.state()
    got += run(a, 3, start=3)
    a.close()
    hand = DelayedHalfReference(build(src, shared_tmp), optim=spec(), device=DEV, precision="bf16")
    by_hand = run(hand, 3)
    hand.flush()
    assert all(torch.equal(st.params[n], w) for n, w in hand.state().params.items())
    by_hand += run(hand, 3, start=3)
    assert [r.loss for r in got] == [r.loss for r in by_hand]
    b = OffloadEngine(build(src, shared_tmp), optim=spec(), device=DEV, placement=p, precision="bf16",
                      delayed_update=True)
    b.load_state(st)
    assert [r.loss for r in run(b, 3, start=3)] == [r.loss for r in got[3:]]
    b.close()
    # the per-chunk hand-off: step t + 1's adds reuse the accumulators step t's delayed update reads (after it)
    by_chunk = _bf16_plan(m, prof, device_budget=state_bytes(m) // 10, grad_handoff="chunk")
    c = OffloadEngine(build(src, shared_tmp), optim=spec(), device=DEV, placement=by_chunk, precision="bf16",
                      delayed_update=True)
    by_c = run(c, 3)
    assert all(torch.equal(c.state().params[n], w) for n, w in st.params.items())  # (applies the pending update)
    assert [r.loss for r in by_c + run(c, 3, start=3)] == [r.loss for r in got]
    c.close()
    plain = PlainEngine(build(src, shared_tmp), optim=spec(), device=DEV, precision="bf16")
    assert _rel(got, run(plain, 6)) <= DELAYED_REL
    with pytest.raises(StratumError, match="delayed_update needs bf16 chunks"):
        OffloadEngine(build(src, shared_tmp), optim=spec(), device=DEV, placement=plan(m, prof), delayed_update=True)


FP16_LOSS_REL, FP16_WEIGHT_REL = 2e-4, 4e-3
"""Offload engine with fp16 chunks against plain fp16 (both with dynamic loss scaling; 10 steps as above, no
overflow at the default scale 2**16): 9.1e-5 / 2.0e-3 measured for GPT, 5.5e-5 / 3.7e-4 for the ``nn.Sequential``
model — the size of plain fp16's own gap to plain fp32 (6.4e-5 / 1.2e-3 and 1.9e-5 / 2.2e-4) and below plain
bf16's to plain fp16 (1.2e-4 / 5.0e-3). About twice the largest gap."""
PEAK_MARGIN = 0.01
"""The planner's device peak over the measured one on 16-bit chunks: 0.15-0.3 % measured (GPT and
``nn.Sequential``, bf16 and fp16, activations kept, recomputed or spilled, budget a third of the state); planned from
an fp32 profile's activation bytes it was 5-20 % over."""
FORCED = LossScaleSpec(init_scale=2.0**19, growth_interval=2)
"""A first scale so large that GPT's gradients overflow fp16 in two steps (each skipped, the scale halved), then
two steps without one double it, and two more again: every branch of the scaler in seven steps."""


@pytest.mark.skipif(DEV.type != "cpu", reason="the tolerances were measured on a CPU")
@pytest.mark.parametrize("handoff", ["tensor", "chunk"])
def test_fp16_chunks_skip_the_plain_engines_overflows_and_resume_exactly(handoff, shared_tmp):
    """train.precision = fp16, streamed through 10 % of the training state: the device holds fp16 chunks (the
    bf16 bytes), the links move what the step model predicts; the steps whose gradients overflow are skipped in
    the offload and the plain engine alike (same scales, same skips, parameters untouched), the others follow
    plain fp16 within FP16_*; a checkpoint holds the scaler and resumes both engines exactly (and the plain engine
    from the offload engine's, with its scale, within FP16_*). Planned from an
    fp16 profile, whose activation bytes are measured on 16-bit parameters, the predicted device peak is within
    PEAK_MARGIN above the measured one. The same with the per-chunk gradient hand-off (``handoff``)."""
    m, prof = build("gpt", shared_tmp), _profile("gpt", shared_tmp, "fp16")
    init = {n: p.detach().clone() for n, p in m.named_parameters()}
    p = plan(m, prof, precision="fp16", optimizer_tier=HOST, activations="recompute",
             device_budget=state_bytes(m) // 10, grad_handoff=handoff)
    assert p.half_params and p.resident_chunks < p.n_chunks and p.chunk_grads == (handoff == "chunk")
    a = OffloadEngine(m, optim=spec(), device=DEV, placement=p, precision="fp16", loss_scale=FORCED)
    assert a.tiers[DEVICE].used == _device_bytes(a) == p.predicted_peak[DEVICE] - p.act_bytes
    assert all(s.dtype == torch.float16 for s in a.slots)
    got = run(a, 1)
    after = a.state().params
    assert all(torch.equal(after[n], w) for n, w in init.items())  # skipped: nothing moved
    got += run(a, 3, start=1)
    a.drain()
    moved0 = a.traffic()
    got += run(a, 1, start=4)  # (not skipped: a step's predicted traffic includes its update)
    a.drain()
    assert {k: v - moved0[k] for k, v in a.traffic().items()} == pytest.approx(p.predicted_traffic, rel=0.01)
    st = a.state()
    got += run(a, 2, start=5)
    assert 1 - PEAK_MARGIN <= a.tiers[DEVICE].peak / p.predicted_peak[DEVICE] <= 1
    a.close()
    ref = PlainEngine(build("gpt", shared_tmp), optim=spec(), device=DEV, precision="fp16", loss_scale=FORCED)
    want = run(ref, 5)
    ref_st = ref.state()
    want += run(ref, 2, start=5)
    assert [r.skipped for r in want] == [r.skipped for r in got] == [True] * 2 + [False] * 5
    assert all(r.grad_norm < 10 for r in got[2:] + want[2:])  # unscaled before the norm (scaled: ~1e5)
    scales = [r.loss_scale for r in want]
    assert scales == [r.loss_scale for r in got] == [2.0**k for k in (19, 18, 17, 17, 18, 18, 19)]
    assert _rel(got[2:], want[2:]) <= FP16_LOSS_REL and _weight_dist(st, ref_st) <= FP16_WEIGHT_REL
    b = OffloadEngine(build("gpt", shared_tmp), optim=spec(), device=DEV, placement=p, precision="fp16",
                      loss_scale=FORCED)
    b.load_state(st)  # the scale and growth tracker: the growth interval is the run's setting
    assert [(r.loss, r.loss_scale) for r in run(b, 2, start=5)] == [(r.loss, r.loss_scale) for r in got[5:]]
    b.close()
    again = PlainEngine(build("gpt", shared_tmp), optim=spec(), device=DEV, precision="fp16", loss_scale=FORCED)
    again.load_state(ref_st)
    assert [(r.loss, r.loss_scale) for r in run(again, 2, start=5)] == [(r.loss, r.loss_scale) for r in want[5:]]
    cross = PlainEngine(build("gpt", shared_tmp), optim=spec(), device=DEV, precision="fp16", loss_scale=FORCED)
    cross.load_state(st)  # the offload engine's checkpoint, scaler included, under the plain engine
    res = run(cross, 2, start=5)
    assert [r.loss_scale for r in res] == scales[5:] and _rel(res, got[5:]) <= FP16_LOSS_REL


DISK_CASES = [  # (source, precision, host budget as a share of the training state (None: no budgets), clip, acts,
    #              offload.grad_handoff)
    ("sequential", "bf16", 0.45, 1.0, "recompute", "tensor"),  # masters and moments on disk (host < 8 B/param)
    ("sequential", "bf16", 0.45, 0.0, "recompute", "tensor"),  # each chunk updated as its gradient completes
    ("sequential", "bf16", 0.6, 1.0, "recompute", "tensor"),  # moments on disk, masters in host RAM
    ("sequential", "bf16", None, 1.0, "recompute", "tensor"),  # every chunk pinned on the device, moments on disk
    ("gpt", "bf16", 0.45, 1.0, "offload", "tensor"),  # a tied (pinned) chunk; activations spilled to host and disk
    ("gpt", "fp16", 0.45, 1.0, "recompute", "tensor"),  # loss scaling: overflowing steps skipped on disk as in RAM
    ("sequential", "bf16", 0.45, 0.0, "recompute", "chunk"),  # a GPU's hand-off (auto there) into disk masters
    ("gpt", "bf16", 0.45, 1.0, "recompute", "chunk"),  # ... with the tied chunk and clipping
]
_refs: dict = {}


def test_an_fp16_refusal_names_the_smallest_budget_and_that_budget_trains(shared_tmp):
    """fp16's no-fit error is a NoFit carrying the smallest device budget (a pipeline's ranks compare theirs by
    it; fp16 and the delayed update wrapped it in a plain error, which lost it), and that budget trains."""
    from stratum.offload.planner import NoFit
    m, prof = build("gpt", shared_tmp), _profile("gpt", shared_tmp, "fp16")
    with pytest.raises(NoFit, match="fp16 keeps the fp32 masters") as refused:
        plan(m, prof, precision="fp16", device_budget=1)
    smallest = refused.value.smallest_device
    assert smallest is not None
    eng = OffloadEngine(m, optim=spec(), device=DEV, placement=plan(m, prof, precision="fp16", device_budget=smallest),
                        precision="fp16")
    try:
        run(eng, 2)  # (the engine checks the device tier against its budget at every block)
    finally:
        eng.close()


def test_fp16_counts_the_activations_bf16_counts(shared_tmp):
    """fp16 and bf16 save tensors of the same shapes and sizes; the scaled loss also saves the loss scale for its
    backward, which is the scaler's state, not an activation: counted as one, 4 bytes took a Llama planned at the
    smallest budget over it, mid-step."""
    peaks = {}
    for precision in ("bf16", "fp16"):
        m, prof = build("gpt", shared_tmp), _profile("gpt", shared_tmp, precision)
        p = plan(m, prof, precision=precision, optimizer_tier=HOST, activations="keep", device_budget=state_bytes(m))
        eng = OffloadEngine(m, optim=spec(), device=DEV, placement=p, precision=precision)
        try:
            run(eng, 1)
            peaks[precision] = eng.peak_act
        finally:
            eng.close()
    assert peaks["fp16"] == peaks["bf16"] > 0


def _disk_reference(source, precision, clip, shared_tmp, steps):
    """What a disk placement's run must equal: bit for bit, the hand-written recipe (nothing tied) or the same
    engine with the state in host RAM (fp16, its skips and scales included); and plain bf16 within LOSS_REL /
    WEIGHT_REL (GPT)."""
    key = (source, precision, clip)
    if key not in _refs:
        m = build(source, shared_tmp)
        if precision == "fp16":
            ram = plan(m, _profile(source, shared_tmp, precision), precision=precision, optimizer_tier=HOST,
                       activations="recompute", device_budget=state_bytes(m) // 10)
            ref = OffloadEngine(m, optim=spec(clip), device=DEV, placement=ram, precision=precision,
                                loss_scale=FORCED)
        elif source == "sequential":
            ref = HalfReference(m, optim=spec(clip), device=DEV, precision=precision)
        else:
            ref = PlainEngine(m, optim=spec(clip), device=DEV, precision=precision)
        got = run(ref, steps)
        _refs[key] = (got, ref.state())
        if isinstance(ref, OffloadEngine):
            ref.close()
    return _refs[key]


@pytest.mark.skipif(DEV.type != "cpu", reason="bit-exact against references run on a CPU")
@pytest.mark.parametrize("source,precision,host_share,clip,acts,handoff", DISK_CASES)
def test_16_bit_chunks_with_masters_and_moments_on_disk(source, precision, host_share, clip, acts, handoff,
                                                        shared_tmp):
    """A host budget below the fp32 masters + moments puts them on disk while the device streams 16-bit chunks (a
    disk master's 16-bit copy in host RAM): the device holds 2 bytes per parameter of its slots and pinned chunks,
    under its budget; every link (disk included) moves per step what the step model predicts and each tier peaks
    within 10 % of its prediction; the run is its reference's (``_disk_reference``), and a checkpoint resumes it
    exactly."""
    m, prof = build(source, shared_tmp), _profile(source, shared_tmp, precision)
    S = state_bytes(m)
    budgets = (dict(optimizer_tier=DISK) if host_share is None
               else dict(device_budget=S // 10, host_budget=int(S * host_share)))
    p = plan(m, prof, precision=precision, clip=clip, activations=acts, grad_handoff=handoff, **budgets)
    assert p.half_params and p.optimizer_tier == DISK and p.chunk_grads == (handoff == "chunk")
    assert acts == "recompute" or (p.disk_spill_blocks and len(p.spill_blocks or ()) > len(p.disk_spill_blocks))
    assert p.param_tier == (DEVICE if host_share is None else DISK if host_share < 0.5 else HOST)
    assert p.param_tier == DEVICE or p.resident_chunks < p.n_chunks  # (streaming)
    assert f"fp32 masters on the {DISK if p.param_tier == DISK else HOST}" in p.describe()
    scale = FORCED if precision == "fp16" else None
    eng = OffloadEngine(m, optim=spec(clip), device=DEV, placement=p, precision=precision, loss_scale=scale)
    try:
        params = len(eng.slots) * p.chunk_elems + sum(c.cap for c in eng.chunks if c.pinned)
        buffers = handoff_bytes(eng.layout)[DEVICE] if p.chunk_grads else 0
        assert eng.tiers[DEVICE].used == HALF * params + buffers == p.predicted_peak[DEVICE] - p.act_bytes
        assert all(s.dtype == eng._half_dtype for s in eng.slots)
        got = _run_checking_traffic(eng, 4)
        assert p.device_budget is None or eng.tiers[DEVICE].peak <= p.device_budget
        for tier, peak in eng.measured_peaks().items():
            assert abs(peak - p.predicted_peak[tier]) <= 0.1 * p.predicted_peak[tier], (tier, peak)
        st = eng.state()
        got += run(eng, 2, start=4)
    finally:
        eng.close()
    want, want_st = _disk_reference(source, precision, clip, shared_tmp, 6)
    if source == "sequential" or precision == "fp16":
        assert [(r.loss, r.loss_scale) for r in got] == [(r.loss, r.loss_scale) for r in want]
    else:
        assert _rel(got, want) <= LOSS_REL
    b = OffloadEngine(build(source, shared_tmp), optim=spec(clip), device=DEV, placement=p, precision=precision,
                      loss_scale=scale)
    try:
        b.load_state(st)
        assert [r.loss for r in run(b, 2, start=4)] == [r.loss for r in got[4:]]
        end = b.state()
    finally:
        b.close()
    if source == "sequential" or precision == "fp16":
        assert all(torch.equal(end.params[n], w) for n, w in want_st.params.items())
    else:
        assert _weight_dist(end, want_st) <= WEIGHT_REL


@pytest.mark.skipif(DEV.type != "cpu", reason="bit-exact against the hand-written reference on a CPU")
def test_chunk_handoff_without_clipping_updates_each_chunk_in_the_backward(shared_tmp):
    """grad_clip = 0, 3 micro-batches: each chunk's update is queued as its gradient completes, its norms taken
    after the host's add — the hand-written recipe's losses, gradient norms and weights bit for bit (GPT's tied
    embedding included), with the plan's link bytes."""
    m, prof = build("gpt", shared_tmp), _profile("gpt", shared_tmp)
    p = _bf16_plan(m, prof, device_budget=state_bytes(m) // 10, grad_handoff="chunk", clip=0.0, n_micro=3)
    assert p.chunk_grads and p.resident_chunks < p.n_chunks
    eng = OffloadEngine(m, optim=spec(0.0), device=DEV, placement=p, precision="bf16")
    try:
        got = _run_checking_traffic(eng, 4, n=3)
        st = eng.state()
    finally:
        eng.close()
    hand = HalfReference(build("gpt", shared_tmp), optim=spec(0.0), device=DEV, precision="bf16")
    want = run(hand, 4, n=3)
    assert [(r.loss, r.grad_norm) for r in got] == [(r.loss, r.grad_norm) for r in want]
    assert all(torch.equal(st.params[n], w) for n, w in hand.state().params.items())


GPU_REL = 1e-3
"""The per-chunk against the per-tensor hand-off on a GPU (losses and gradient norms, relative): both move the same
bf16 gradients, but a GPU's backward kernels may accumulate in another order run to run (atomics); an ordering
fault — a copy reading a buffer before the backward wrote it, a staging overwritten before the host's add read it
— changes a whole chunk's gradient, far beyond it. On a CPU the two are equal."""


def _sync_warnings(eng: OffloadEngine, s: int) -> int:
    """Synchronising CUDA calls (torch.cuda.set_sync_debug_mode) made while ``eng`` runs step ``s``."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run(eng, 1, start=s)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.skipif(DEV.type != "cuda", reason="on a CPU the tests above hold both paths to the recipe, bit for bit")
def test_chunk_handoff_against_the_per_tensor_path_on_the_device(shared_tmp):
    """What a GPU session checks (STRATUM_TEST_DEVICE=cuda; docs/offload.md, "Kernel launches per step"): streamed
    at 10 % of the training state, 2 micro-batches, clipping, nothing tied — the per-chunk hand-off gives the
    per-tensor path's losses and gradient norms (exactly on a CPU, within GPU_REL on a GPU), moves the plan's
    link bytes, keeps the device tier under the budget (and on a GPU the CUDA allocator's peak within the engine's
    own slack over it); on a GPU its
    staging is pinned and its backward makes at least one synchronising call fewer per gradient tensor and
    micro-batch than the per-tensor path's ``grad.to("cpu")``."""
    m, prof = build("sequential", shared_tmp), _profile("sequential", shared_tmp)
    budget = state_bytes(m) // 10
    runs, syncs = {}, {}
    for handoff in ("tensor", "chunk"):
        p = _bf16_plan(build("sequential", shared_tmp), prof, device_budget=budget, grad_handoff=handoff)
        if DEV.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(DEV)
            base = torch.cuda.memory_allocated(DEV)
        eng = OffloadEngine(build("sequential", shared_tmp), optim=spec(), device=DEV, placement=p, precision="bf16")
        try:
            runs[handoff] = _run_checking_traffic(eng, 4)
            assert eng.tiers[DEVICE].peak <= budget
            if DEV.type == "cuda":
                # (the engine's own check allows the allocator 5 % and 64 MiB over the plan: kernels' workspaces)
                assert torch.cuda.max_memory_allocated(DEV) - base <= budget * 1.05 + (64 << 20)
                syncs[handoff] = _sync_warnings(eng, 4)
            if eng.handoff is not None:
                assert all(s.is_pinned() == (DEV.type == "cuda") for r in eng.handoff.ring.values() for s, _ in r)
                assert all(b.device == DEV for pool in eng.handoff.pool.values() for b, _ in pool)
        finally:
            eng.close()
    got, want = runs["chunk"], runs["tensor"]
    rel = 0.0 if DEV.type == "cpu" else GPU_REL
    assert [r.loss for r in got] == pytest.approx([r.loss for r in want], rel=rel, abs=0)
    assert [r.grad_norm for r in got] == pytest.approx([r.grad_norm for r in want], rel=rel, abs=0)
    if DEV.type == "cuda":
        tensors = sum(1 for _ in m.parameters())
        assert syncs["tensor"] - syncs["chunk"] >= 2 * tensors, syncs
