"""The offload engine reproduces the plain engine's losses exactly under every placement, keeps the device tier
within its budget every step, predicts its peak bytes, and its checkpoints move between placements."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from stratum.offload.engine import OffloadEngine, _alone_on_device
from stratum.offload.placement import Placement
from stratum.offload.tiers import DEVICE, DISK, HOST

from offload_helpers import (
    DEV,
    REL,
    assert_same,
    assert_same_tensor,
    batches,
    fixed_times,
    lr,
    plain,
    plan,
    profile,
    spec,
    state_bytes,
)
from offload_helpers import build as build_source

STEPS = 8  # the first step records the access sequence, the next ones run the steady state: 8 cover both
PLACEMENTS = {
    "all-on-device": lambda S: {},
    "device-50%": lambda S: {"device_budget": S // 2},
    "device-25%": lambda S: {"device_budget": S // 4},
    "device-10%": lambda S: {"device_budget": S // 10},
    "optimizer-on-host": lambda S: {"optimizer_tier": HOST},
    "params-and-optimizer-on-disk": lambda S: {"device_budget": S // 4, "host_budget": S // 10,
                                               "optimizer_tier": DISK},
}
_ref: dict = {}
DROPOUT = 0.1
"""Every model here draws dropout masks (the transformers GPT-2 has its config's 0.1): parity must hold with the
RNG in use, so nothing the engine runs besides the training step may draw from it."""


def build(source: str, tmp_path):
    return build_source(source, tmp_path, dropout=DROPOUT)


def step(engine, s: int, n: int = 2):
    """Step ``s`` of a run, its dropout masks drawn from a seed of its own: engines stepped in turn, or a state
    resumed in another engine, draw the masks an uninterrupted run draws (as the trainer restores the RNG state
    with a checkpoint). Within the step every draw is the engine's own: they must match the plain engine's."""
    torch.manual_seed(10_000 + s)
    return engine.train_step(batches(s, n), lr(s))


def run(engine, steps: int, start: int = 0, n: int = 2):
    return [step(engine, s, n) for s in range(start, start + steps)]


def _reference(source, tmp_path):
    if source not in _ref:
        model = build(source, tmp_path)
        prof = profile(model)
        res = run(plain(build(source, tmp_path)), STEPS)
        _ref[source] = (prof, res)
    return _ref[source]


def _sources():
    out = ["gpt", "sequential"]
    try:
        import transformers  # noqa: F401
        out.append("hf")
    except ImportError:
        pass
    return out


@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("offload-models")


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("source", _sources())
def test_parity_with_plain_and_budgets(source, placement, shared_tmp):
    prof, ref = _reference(source, shared_tmp)
    model = build(source, shared_tmp)
    S = state_bytes(model)
    p = plan(model, prof, **PLACEMENTS[placement](S))
    if placement == "params-and-optimizer-on-disk":
        assert (p.param_tier, p.optimizer_tier) == (DISK, DISK)
    if placement == "optimizer-on-host":
        assert (p.param_tier, p.optimizer_tier) == (DEVICE, HOST)
    if placement.startswith("device-") and placement != "device-50%":
        assert p.param_tier != DEVICE  # really streaming
    eng = OffloadEngine(model, optim=spec(), device=DEV, placement=p)  # asserts the budgets every block
    try:
        got = _run_checking_traffic(eng, STEPS)
        for s, (a, b) in enumerate(zip(ref, got)):
            assert b.loss == pytest.approx(a.loss, rel=1e-6, abs=0), (s, a.loss, b.loss)
            assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5), s
        if eng.disk is not None and eng.disk.direct:
            assert eng.disk.bounce_bytes == 0  # every chunk moved by direct I/O from aligned memory
        measured = eng.measured_peaks()
        if p.device_budget is not None:
            assert measured[DEVICE] <= p.device_budget
        for tier in (DEVICE, HOST, DISK):
            pred = p.predicted_peak[tier]
            assert abs(measured[tier] - pred) <= 0.10 * max(pred, 1), (tier, pred, measured[tier])
    finally:
        eng.close()


def _run_checking_traffic(eng, steps, **kw):
    """``run(eng, steps)``, and check that after the first two steps (the first records the access sequence) every
    link moves per step the bytes the plan predicts (within 1 %): the planner's time model rests on them."""
    got = run(eng, 2, **kw)
    eng.drain()
    moved0 = eng.traffic()
    got += run(eng, steps - 2, start=2, **kw)
    eng.drain()
    moved = {k: (v - moved0[k]) / (steps - 2) for k, v in eng.traffic().items()}
    for link, pred in eng.placement.predicted_traffic.items():
        assert abs(moved[link] - pred) <= 0.01 * max(pred, 1), (link, pred, moved[link])
    return got


def _engine(model, p, clip=1.0, **kw):
    return OffloadEngine(model, optim=spec(clip), device=DEV, placement=p, **kw)


@pytest.mark.slow
def test_checkpoint_moves_between_placements_and_plain(shared_tmp):
    """Save under one placement after 4 steps; resume under another placement and under plain: the next
    steps are those of the uninterrupted run."""
    prof, _ = _reference("gpt", shared_tmp)
    m = build("gpt", shared_tmp)
    S = state_bytes(m)
    a = _engine(m, plan(m, prof, device_budget=S // 4))
    run(a, 4)
    st = a.state()
    cont = run(a, 4, start=4)
    m2 = build("gpt", shared_tmp)
    b = _engine(m2, plan(m2, prof, device_budget=S // 4, host_budget=S // 10, optimizer_tier=DISK))
    b.load_state(st)
    c = plain(build("gpt", shared_tmp))
    c.load_state(st)
    rb, rc = run(b, 4, start=4), run(c, 4, start=4)
    assert_same([r.loss for r in rb], [r.loss for r in cont])
    assert_same([r.loss for r in rc], [r.loss for r in cont])
    # and back: a plain engine's state into an offload engine
    d_model = build("gpt", shared_tmp)
    d = _engine(d_model, plan(d_model, prof, device_budget=S // 10))
    d.load_state(c.state())
    e = plain(build("gpt", shared_tmp))
    e.load_state(c.state())
    assert_same([r.loss for r in run(d, 2, start=8)], [r.loss for r in run(e, 2, start=8)])
    for x in (a, b, d):
        x.close()


@pytest.mark.parametrize("fewest_slots", [False, True])
@pytest.mark.parametrize("optimizer_tier", [DEVICE, HOST, DISK])
def test_without_clipping_updates_run_during_backward_and_match(optimizer_tier, fewest_slots, shared_tmp):
    """Updates run as each chunk's gradient completes; on a CPU a host/disk update runs in place on the chunk's
    slot, so with the fewest slots the next fetch into that slot must wait for it (else: wrong losses)."""
    prof, _ = _reference("gpt", shared_tmp)
    m = build("gpt", shared_tmp)
    S = state_bytes(m)
    budget = S * 7 // 10 if optimizer_tier == DEVICE else S // 4  # moments on the device are half the state
    kw = {}
    if fewest_slots:
        from stratum.offload.chunks import pack
        C = plan(m, prof, clip=0.0, device_budget=budget).chunk_elems
        kw = dict(chunk_elems=C, resident_chunks=pack(m, C).max_chunks_per_block())
    p = plan(m, prof, clip=0.0, device_budget=budget, optimizer_tier=optimizer_tier, **kw)
    assert p.param_tier != DEVICE
    eng = _engine(m, p, clip=0.0)
    ref = run(plain(build("gpt", shared_tmp), clip=0.0), 6)
    got = _run_checking_traffic(eng, 6)
    assert_same([r.loss for r in got], [r.loss for r in ref])
    eng.close()


@pytest.mark.parametrize("mode", ["recompute", "offload"])
@pytest.mark.parametrize("source", _sources())
def test_thin_activations_match_and_hold_fewer_activations(mode, source, shared_tmp):
    """Recompute and host-spilled activations give the kept-activations losses bit for bit, hold less on the
    device, stay within the budget every block, and the spill's host bytes come back after every step."""
    prof, ref = _reference(source, shared_tmp)
    m = build(source, shared_tmp)
    S = state_bytes(m)
    p_keep = plan(m, prof, device_budget=S // 4, activations="keep")
    p = plan(m, prof, device_budget=S // 4, activations=mode)
    assert p.activations == mode and p.act_bytes < p_keep.act_bytes
    eng = _engine(m, p)
    try:
        got = _run_checking_traffic(eng, 5)
        assert_same([r.loss for r in got], [r.loss for r in ref[:5]])
        assert_same([r.grad_norm for r in got], [r.grad_norm for r in ref[:5]])
        assert eng.peak_act < p_keep.act_bytes
        measured = eng.measured_peaks()
        assert measured[DEVICE] <= p.device_budget
        for tier in (DEVICE, HOST):
            assert abs(measured[tier] - p.predicted_peak[tier]) <= 0.10 * p.predicted_peak[tier], tier
        if mode == "offload":
            assert eng.spill.bytes_d2h > 0 and eng.spill.bytes_h2d == eng.spill.bytes_d2h
            assert not eng.spill.blocks and eng.spill.device_bytes == 0  # all released after the step
    finally:
        eng.close()


@pytest.mark.parametrize("source", _sources())
def test_the_last_blocks_keep_their_activations_on_the_device(source, shared_tmp):
    """Placement.kept_blocks: the last two blocks' activations are neither spilled nor recomputed — the losses and
    gradient norms stay exact, no kept block reaches the spill, and the device tier, which now holds them from
    their forward to their backward, stays within its budget and its prediction."""
    prof, ref = _reference(source, shared_tmp)
    m = build(source, shared_tmp)
    S, L = state_bytes(m), len(m)
    p = plan(m, prof, device_budget=S // 4, activations="offload", kept_blocks=2)
    assert p.kept_blocks == (L - 2, L - 1) and p.param_tier != DEVICE
    eng = _engine(m, p)
    spilled = []
    begin = eng.spill.begin_block

    def note(i):
        spilled.append(i)
        begin(i)
    eng.spill.begin_block = note
    try:
        got = _run_checking_traffic(eng, 5)
        assert_same([r.loss for r in got], [r.loss for r in ref[:5]])
        assert_same([r.grad_norm for r in got], [r.grad_norm for r in ref[:5]])
        assert set(spilled) == set(range(L - 2))
        kept = sum(prof.blocks[i].act_saved_bytes for i in p.kept_blocks)
        assert eng.peak_act >= kept  # counted on the device while held
        measured = eng.measured_peaks()
        assert measured[DEVICE] <= p.device_budget
        assert abs(measured[DEVICE] - p.predicted_peak[DEVICE]) <= 0.10 * p.predicted_peak[DEVICE]
        assert not eng.spill.blocks and eng.spill.device_bytes == 0
    finally:
        eng.close()


def _with_idle_params(m, use: list[bool]):
    """Give block 3 a parameter its forward never uses and block 5 one it uses only while ``use[0]``."""
    from torch import nn
    torch.manual_seed(7)
    m.blocks[3].idle = nn.Parameter(torch.randn(64))
    blk = m.blocks[5]
    blk.sometimes = nn.Parameter(0.1 * torch.randn(64))
    fwd = blk.forward
    blk.forward = lambda x, *a, **k: fwd(x, *a, **k) + blk.sometimes if use[0] else fwd(x, *a, **k)
    return m


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["all-on-device", "device-25%", "optimizer-on-device-75%",
                                       "params-and-optimizer-on-disk"])
def test_parameters_without_gradients_are_skipped_as_plain_skips_them(placement, shared_tmp):
    """AdamW, like torch.optim.AdamW, leaves a parameter without a gradient alone (no weight decay, no moment
    decay) and counts steps per parameter: a never-used parameter keeps its value and has no optimizer state, one
    used every other step ends with its own step count; the losses and every tensor match the plain engine's."""
    prof, _ = _reference("gpt", shared_tmp)
    use_p, use_o = [True], [True]
    ref_m = _with_idle_params(build("gpt", shared_tmp), use_p)
    m = _with_idle_params(build("gpt", shared_tmp), use_o)
    S = state_bytes(m)
    kw = {"all-on-device": {}, "device-25%": {"device_budget": S // 4},
          "optimizer-on-device-75%": {"device_budget": 3 * S // 4, "optimizer_tier": DEVICE},
          "params-and-optimizer-on-disk": PLACEMENTS["params-and-optimizer-on-disk"](S)}[placement]
    p = plan(m, prof, **kw)
    assert (p.param_tier == DEVICE) == (placement == "all-on-device")  # the others stream: gradients in slots too
    eng, ref = _engine(m, p), plain(ref_m)
    try:
        got, want = [], []
        for s in range(6):
            use_p[0] = use_o[0] = s % 2 == 0
            want.append(step(ref, s).loss)
            got.append(step(eng, s).loss)
        assert_same(got, want)
        a, b = eng.state(), ref.state()
        idle, some = "blocks.3.idle", "blocks.5.sometimes"
        assert idle not in a.optim and idle not in b.optim
        assert float(a.optim[some]["step"]) == float(b.optim[some]["step"]) == 3.0
        assert float(a.optim["blocks.1.ln1.weight"]["step"]) == 6.0
        for name in b.params:
            assert_same_tensor(a.params[name], b.params[name], name)
        for name, st in b.optim.items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert_same_tensor(a.optim[name][key], st[key], f"{name}.{key}")
    finally:
        eng.close()


@pytest.mark.slow
def test_checkpoints_keep_per_parameter_step_counts(shared_tmp):
    """A checkpoint taken while parameters have different step counts (one never used, one used every other step)
    resumes under another placement and under the plain engine as the uninterrupted plain run goes on."""
    prof, _ = _reference("gpt", shared_tmp)
    use = [True]

    def model():
        return _with_idle_params(build("gpt", shared_tmp), use)

    def steps(eng, lo, hi):
        out = []
        for s in range(lo, hi):
            use[0] = s % 2 == 0
            out.append(step(eng, s).loss)
        return out
    m = model()
    S = state_bytes(m)
    a = _engine(m, plan(m, prof, device_budget=S // 4))
    ref = plain(model())
    steps(a, 0, 3)
    steps(ref, 0, 3)
    st = a.state()
    assert "blocks.3.idle" not in st.optim and float(st.optim["blocks.5.sometimes"]["step"]) == 2.0
    want = steps(ref, 3, 6)
    m2 = model()
    b = _engine(m2, plan(m2, prof, **PLACEMENTS["params-and-optimizer-on-disk"](S)))
    c = plain(model())
    try:
        b.load_state(st)
        c.load_state(st)
        assert_same(steps(b, 3, 6), want)
        assert_same(steps(c, 3, 6), want)
        assert float(b.state().optim["blocks.5.sometimes"]["step"]) == 3.0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("placement", ["device-25%", "params-and-optimizer-on-disk"])
def test_a_block_whose_parameters_all_go_unused_matches_plain(placement, shared_tmp):
    """Block 4 passes its input through on odd steps: then none of its chunks' parameters gets a gradient (no
    norms, no updates for whole chunks), and the run still equals the plain engine's."""
    prof, _ = _reference("gpt", shared_tmp)
    models, skip = [], [False]
    for _ in range(2):
        m = build("gpt", shared_tmp)
        blk = m.blocks[4]
        blk.forward = (lambda f: lambda x, *a, **k: x if skip[0] else f(x, *a, **k))(blk.forward)
        models.append(m)
    ref_m, m = models
    S = state_bytes(m)
    p = plan(m, prof, **PLACEMENTS[placement](S))
    eng, ref = _engine(m, p), plain(ref_m)
    try:
        block4 = {e.name for c in eng.chunks for e in c.spec.entries if e.name.startswith("blocks.4.")}
        assert any({e.name for e in c.spec.entries} <= block4 for c in eng.chunks)  # a chunk of block 4 alone
        got, want = [], []
        for s in range(5):
            skip[0] = s % 2 == 1
            want.append(step(ref, s))
            got.append(step(eng, s))
        assert_same([r.loss for r in got], [r.loss for r in want])
        assert_same([r.grad_norm for r in got], [r.grad_norm for r in want])
        a, b = eng.state(), ref.state()
        for name in b.params:
            assert_same_tensor(a.params[name], b.params[name], name)
        for name in sorted(n for n in b.optim if n.startswith("blocks.4.")):  # updated at steps 0, 2 and 4 only
            assert float(a.optim[name]["step"]) == float(b.optim[name]["step"]) == 3.0, name
    finally:
        eng.close()


def test_divergent_access_sequence_warns_once_and_stays_exact(shared_tmp):
    prof, _ = _reference("gpt", shared_tmp)
    m = build("gpt", shared_tmp)
    p = plan(m, prof, n_micro=2, device_budget=state_bytes(m) // 4)  # budgeted for the larger step
    eng = _engine(m, p)
    ref_eng = plain(build("gpt", shared_tmp))
    ref = run(ref_eng, 2, n=1) + run(ref_eng, 2, start=2, n=2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = run(eng, 2, n=1) + run(eng, 2, start=2, n=2)
    msgs = [x for x in w if "diverged" in str(x.message)]
    assert len(msgs) == 1
    assert eng.trace.diverged
    assert_same([r.loss for r in got], [r.loss for r in ref])
    eng.close()


def test_eval_loss_matches_plain(shared_tmp):
    prof, _ = _reference("sequential", shared_tmp)
    m = build("sequential", shared_tmp)
    eng = _engine(m, plan(m, prof, device_budget=state_bytes(m) // 4))
    ref = plain(build("sequential", shared_tmp))
    run(eng, 2), run(ref, 2)
    assert eng.eval_loss(batches(99, 2)) == ref.eval_loss(batches(99, 2))
    eng.close()


def test_updates_left_to_the_next_fetch_reach_eval_checkpoints_and_loads(shared_tmp):
    """Parameters on disk, clipping: a chunk's update after the backward runs in the fetch that next brings it
    back (ChunkState.pending). An evaluation in between fetches, so it updates them; a checkpoint runs the ones
    still waiting first; a load replaces them. Each matches the plain engine."""
    prof, _ = _reference("gpt", shared_tmp)
    m = build("gpt", shared_tmp)
    S = state_bytes(m)
    p = plan(m, prof, device_budget=S // 4, host_budget=S // 10, optimizer_tier=DISK)
    assert p.param_tier == DISK
    eng, ref = _engine(m, p), plain(build("gpt", shared_tmp))
    try:
        assert_same([r.loss for r in run(eng, 3)], [r.loss for r in run(ref, 3)])
        assert any(c.pending is not None for c in eng.chunks)
        assert eng.eval_loss(batches(99, 2)) == ref.eval_loss(batches(99, 2))
        assert_same([r.loss for r in run(eng, 1, start=3)], [r.loss for r in run(ref, 1, start=3)])
        saved, want = eng.state(), ref.state()
        assert all(c.pending is None for c in eng.chunks)
        names = list(want.params)
        assert_same_tensor(torch.cat([saved.params[n].reshape(-1) for n in names]),
                           torch.cat([want.params[n].reshape(-1) for n in names]), "parameters", rel=10 * REL)
        cont = [r.loss for r in run(ref, 2, start=4)]
        assert_same([r.loss for r in run(eng, 2, start=4)], cont)
        assert any(c.pending is not None for c in eng.chunks)
        eng.load_state(saved)
        assert_same([r.loss for r in run(eng, 2, start=4)], cont)
    finally:
        eng.close()


def test_disk_files_live_under_disk_dir_and_are_removed(shared_tmp, tmp_path):
    prof, _ = _reference("gpt", shared_tmp)
    m = build("gpt", shared_tmp)
    S = state_bytes(m)
    eng = _engine(m, plan(m, prof, device_budget=S // 4, host_budget=S // 10, optimizer_tier=DISK),
                  disk_dir=str(tmp_path / "spill"))
    run(eng, 1)
    assert eng.disk.dir == tmp_path / "spill" and eng.tiers[DISK].used == eng.disk.file_bytes() > 0
    assert not list((tmp_path / "spill").iterdir())  # nameless files: nothing a kill could leave behind
    eng.close()
    assert eng.disk.file_bytes() == 0


def test_a_plan_that_overfills_the_device_is_caught(shared_tmp):
    """The per-step accounting check is real: a hand-made plan whose slots exceed the budget is refused."""
    m = build("gpt", shared_tmp)
    bad = Placement(chunk_elems=50_000, resident_chunks=4, optimizer_tier=HOST, param_tier=HOST, prefetch_depth=1,
               device_budget=100_000)
    with pytest.raises(Exception, match="device tier"):
        _engine(m, bad)


def test_the_allocator_check_counts_one_engine_only_where_it_is_alone_on_its_device(shared_tmp):
    """The CUDA allocator's total is the process's: it stands for one engine's bytes only while no other engine
    of the process shares the device (a sharded-lrtf worker's jobs do), and a closed engine no longer counts."""
    m = build("gpt", shared_tmp)
    p = plan(m, profile(m), device_budget=None)
    a = _engine(m, p)
    assert _alone_on_device(a)
    b = _engine(build("gpt", shared_tmp), p)
    assert not _alone_on_device(a) and not _alone_on_device(b)
    b.close()
    assert _alone_on_device(a)
    a.close()


@pytest.mark.parametrize("optimizer_tier", [DEVICE, HOST, DISK])
@pytest.mark.parametrize("depth", [0, 2])
def test_prefetch_depths_and_optimizer_tiers_stay_exact(optimizer_tier, depth):
    """Prefetching across the step boundary must wait for the host/disk update of a chunk (regression)."""
    from stratum.model.gpt import build_gpt

    def mk():
        return build_gpt("tiny", vocab_size=256, seed=0)
    m = mk()
    S = state_bytes(m)
    budget = S * 3 // 2 if optimizer_tier == DEVICE else S // 2
    host_share = 3 if DEV.type == "cpu" else 2  # a GPU's host tier also holds the tied chunk's master copy
    p = plan(m, profile(m), device_budget=budget, chunk_elems=29_120, resident_chunks=3, optimizer_tier=optimizer_tier,
             prefetch_depth=depth, host_budget=None if optimizer_tier != DISK else S // host_share)
    assert p.param_tier != DEVICE
    ref = run(plain(mk()), 6)
    eng = _engine(m, p)
    got = run(eng, 6)
    assert_same([r.loss for r in got], [r.loss for r in ref])
    assert m.num_params() == sum(x.numel() for x in mk().parameters())
    eng.close()


def test_a_meta_gpt_is_built_block_by_block_with_the_same_values():
    """Models larger than RAM: the engine materialises a meta GPT one block at a time (init_gpt_block)."""
    from stratum.model.gpt import build_gpt, init_gpt_block
    meta = build_gpt("tiny", vocab_size=256, seed=5, device="meta")
    prof = profile(build_gpt("tiny", vocab_size=256, seed=5))
    p = plan(meta, prof, device_budget=state_bytes(meta) // 2, chunk_elems=29_120)
    eng = _engine(meta, p, materialize=lambda i: init_gpt_block(meta, i, 5))
    ref = plain(build_gpt("tiny", vocab_size=256, seed=5))
    assert_same([r.loss for r in run(eng, 3)], [r.loss for r in run(ref, 3)])
    eng.close()


def test_transformers_weights_are_loaded_block_by_block_and_match_plain(tmp_path):
    """A transformers model directory with safetensors weights, built lazily (parameters on meta), is
    materialised by the engine one block at a time and trains exactly like the eager build under plain."""
    transformers = pytest.importorskip("transformers")
    from stratum.model.hf import build_hf
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    lazy = build_hf(str(tmp_path / "llama"), seed=0, lazy=True)
    assert lazy.block_init is not None and all(p.is_meta for p in lazy.parameters())
    eager = build_hf(str(tmp_path / "llama"), seed=0)
    p = plan(lazy, profile(eager), device_budget=state_bytes(eager) // 4)
    assert p.param_tier != DEVICE
    eng = _engine(lazy, p)
    try:
        assert_same([r.loss for r in run(eng, 3)], [r.loss for r in run(plain(eager), 3)])
    finally:
        eng.close()


def test_spilled_activations_keep_dtypes_under_bf16_autocast(shared_tmp):
    """Under bf16 autocast the saved tensors mix bf16, fp32, int64 and bool: the spill arenas hand each back
    with its dtype and values, so the losses equal those of kept activations bit for bit."""
    prof, _ = _reference("gpt", shared_tmp)
    losses = {}
    for mode in ("keep", "offload"):
        m = build("gpt", shared_tmp)
        p = plan(m, prof, activations=mode)  # no budget: the profile is fp32, bf16 saves more (cast weights)
        eng = OffloadEngine(m, optim=spec(), device=DEV, placement=p, precision="bf16")
        try:
            losses[mode] = [r.loss for r in run(eng, 3)]
        finally:
            eng.close()
    assert losses["offload"] == losses["keep"]


def _least_host_budget(m, prof, device_budget: int) -> int:
    """The least host memory any placement needs (nothing spilled), read from the planner's refusal."""
    import re

    from stratum.errors import StratumError
    with pytest.raises(StratumError) as e:
        plan(m, prof, device_budget=device_budget, host_budget=1, activations="recompute")
    return int(re.search(r"host_budget that works .*? \(([\d,]+) bytes\)", str(e.value)).group(1).replace(",", ""))


@pytest.mark.parametrize("source", _sources())
def test_partial_spill_recomputes_what_the_host_budget_cannot_hold(source, shared_tmp):
    """A host budget with room for half the activations: those blocks are spilled, the rest recomputed; the
    losses stay exact and the host tier stays within its budget and its prediction."""
    prof, ref = _reference(source, shared_tmp)
    m = build(source, shared_tmp)
    S = state_bytes(m)
    least = _least_host_budget(m, prof, S // 4)
    host = least + sum(b.act_saved_bytes for b in prof.blocks) // 2  # room for about half the activations
    # a disk with no room for activation files (else the rest would go there: test_activations_spill_to_disk...)
    # (same chunk size: smaller chunks would free disk room for activation files)
    # (and no activations kept on the device: they would leave the host room for the rest)
    rec = plan(m, prof, device_budget=S // 4, host_budget=host, activations="recompute")
    p = plan(m, prof, device_budget=S // 4, host_budget=host, activations="offload",
             disk_free=rec.predicted_peak[DISK], chunk_elems=rec.chunk_elems, kept_blocks=0)
    assert p.spill_blocks is not None and 0 < len(p.spill_blocks) < len(m) and not p.disk_spill_blocks
    assert "recompute for the rest" in p.describe()
    eng = _engine(m, p)
    try:
        got = _run_checking_traffic(eng, 4)
        assert_same([r.loss for r in got], [r.loss for r in ref[:4]])
        measured = eng.measured_peaks()
        assert measured[HOST] <= host
        assert abs(measured[HOST] - p.predicted_peak[HOST]) <= 0.10 * p.predicted_peak[HOST]
        assert eng.phase_s["recompute"] > 0 and eng.spill.bytes_d2h > 0
    finally:
        eng.close()


@pytest.mark.parametrize("source", _sources())
def test_activations_spill_to_disk_what_the_host_budget_cannot_hold(source, shared_tmp):
    """A host budget with room for half the activations and a disk: the rest go to disk through the ring, none
    is recomputed; losses exact, host and disk within their predictions, the ring really read back."""
    prof, ref = _reference(source, shared_tmp)
    prof = fixed_times(prof)  # which blocks go to disk must not depend on the machine's load
    m = build(source, shared_tmp)
    S = state_bytes(m)
    least = _least_host_budget(m, prof, S // 4)
    host = least + sum(b.spill_bytes for b in prof.blocks) // 2
    p = plan(m, prof, device_budget=S // 4, host_budget=host, activations="offload", kept_blocks=0)
    assert p.disk_spill_blocks and len(p.spill_blocks) == len(m) and not p.recomputes_some
    assert set(p.disk_spill_blocks) < set(p.spill_blocks)  # some stay on the host
    assert f"to disk for {len(p.disk_spill_blocks)}" in p.describe()
    eng = _engine(m, p)
    try:
        got = _run_checking_traffic(eng, 4)
        assert_same([r.loss for r in got], [r.loss for r in ref[:4]])
        assert_same([r.grad_norm for r in got], [r.grad_norm for r in ref[:4]], rel=1e-6)
        measured = eng.measured_peaks()
        assert measured[HOST] <= host
        for tier in (HOST, DISK):
            assert abs(measured[tier] - p.predicted_peak[tier]) <= 0.10 * p.predicted_peak[tier], tier
        ring = eng.spill.ring
        assert eng.phase_s["recompute"] == 0 and ring.bytes_written > 0 and ring.bytes_read > 0
        assert ring.bytes_read < ring.bytes_written  # the last blocks written are still in the ring
        if eng.disk.direct:
            assert eng.disk.bounce_bytes == 0
    finally:
        eng.close()


def test_a_lazily_built_random_init_transformers_model_trains_like_the_eager_one(shared_tmp):
    """A transformers model from a bare config, built lazily (parameters on meta, each block drawn when the
    engine packs its chunks): the offload engine's losses equal plain's on the eager build, on disk too."""
    pytest.importorskip("transformers")
    from stratum.model.hf import build_hf
    prof, ref = _reference("hf", shared_tmp)
    torch.manual_seed(0)  # the dropout masks' RNG starts where build() leaves it
    lazy = build_hf(str(shared_tmp / "gpt2-cfg"), seed=0, lazy=True)
    assert lazy.block_init is not None and all(p.is_meta for p in lazy.parameters())
    S = state_bytes(lazy)
    eng = _engine(lazy, plan(lazy, prof, device_budget=S // 4, host_budget=S // 10, optimizer_tier=DISK))
    try:
        got = run(eng, 4)
        assert_same([r.loss for r in got], [r.loss for r in ref[:4]])
    finally:
        eng.close()


@pytest.mark.parametrize("head_first", [False, True])
def test_a_lazily_built_tied_llama_gets_its_embedding_initialised(tmp_path, head_first):
    """A Llama-layout model from a bare config with tied embeddings: block 0 holds only the tied embedding, which
    the head block also uses. Whichever block's chunk is packed first gives it storage, the embedding's own block
    draws its values: the lazy build equals the eager one, and the offload engine's losses equal plain's."""
    transformers = pytest.importorskip("transformers")
    from stratum.model.hf import build_hf

    from offload_helpers import V
    d = tmp_path / "llama-tied"
    transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=True).save_pretrained(d)
    torch.manual_seed(0)
    eager = build_hf(str(d), seed=0)
    lazy = build_hf(str(d), seed=0, lazy=True)
    if head_first:  # the head's block materialised first, as the engine does when it packs that chunk first
        lazy.allocate(len(lazy) - 1)
        lazy.materialize(len(lazy) - 1)
    S = state_bytes(lazy)
    eng = _engine(lazy, plan(lazy, profile(eager), device_budget=S * 6 // 10))
    try:
        got, ref = run(eng, 3), run(plain(eager), 3)
        assert_same([r.loss for r in got], [r.loss for r in ref])
    finally:
        eng.close()


def test_a_lazily_built_sequential_model_trains_like_the_eager_one():
    """An nn.Sequential factory that returns one constructor per block is built lazily (parameters on meta, each
    block built when the engine packs its chunks): parameters and moments on disk, the offload engine's losses
    and gradient norms equal plain's on the eager build."""
    from stratum.model.sequential import example_lm_blocks, from_block_builders

    from offload_helpers import LAYERS, T, V
    blocks = example_lm_blocks(vocab_size=V, seq_len=T, d_model=64, n_layer=LAYERS["sequential"])
    eager = from_block_builders(blocks, seed=0)
    lazy = from_block_builders(blocks, seed=0, lazy=True)
    assert all(p.is_meta for p in lazy.parameters())
    S = state_bytes(lazy)
    p = plan(lazy, profile(eager), device_budget=S // 4, host_budget=S // 10, optimizer_tier=DISK)
    assert p.param_tier == DISK
    eng = _engine(lazy, p)
    try:
        got, ref = run(eng, 3), run(plain(eager), 3)
        assert_same([r.loss for r in got], [r.loss for r in ref])
        assert_same([r.grad_norm for r in got], [r.grad_norm for r in ref], rel=1e-6)
    finally:
        eng.close()


def test_an_untied_embedding_and_head_larger_than_the_chunks_are_pinned_and_train_as_plain():
    """The sequential example with a vocabulary of 1024 (its embedding and head four times any other matrix), in
    chunks smaller than them: both go to one pinned chunk — not a tied one: each has its own gradient —, the rest
    streams, and the losses and gradient norms (2 micro-batches a step, clipped) are plain's."""
    from stratum.model.sequential import example_lm, from_sequential

    from offload_helpers import LAYERS, T

    def model():
        torch.manual_seed(0)
        return from_sequential(example_lm(vocab_size=1024, seq_len=T, d_model=64, n_layer=LAYERS["sequential"]))
    m = model()
    p = plan(m, profile(m), chunk_elems=2 * 64 * 256, device_budget=state_bytes(m) // 3, optimizer_tier=HOST)
    eng = _engine(m, p)
    try:
        pinned = [c.spec for c in eng.chunks if c.pinned]
        assert len(pinned) == 1 and not pinned[0].tied and p.param_tier == HOST
        assert [e.name for e in pinned[0].entries] == ["blocks.0.weight", f"blocks.{len(m) - 1}.weight"]
        got, ref = run(eng, 3), run(plain(model()), 3)
        assert_same([r.loss for r in got], [r.loss for r in ref])
        assert_same([r.grad_norm for r in got], [r.grad_norm for r in ref], rel=1e-6)
    finally:
        eng.close()


@pytest.mark.parametrize("optimizer_tier,param_tier", [(HOST, HOST), (DISK, HOST), (DISK, DISK)])
def test_deferred_updates_run_beside_the_next_forward_and_match(optimizer_tier, param_tier, shared_tmp):
    """Without clipping, the plan's deferred chunks send their gradients home and update beside the next
    forward (Placement.deferred_chunks); losses and the checkpoint equal the plain engine's, and a chunk fetched for
    the forward waits for its update (else: the losses would differ); the traffic is the plan's."""
    import dataclasses

    from stratum.ir.costs import Costs
    from stratum.offload.chunks import pack
    from stratum.offload.planner import _deferral_options
    from stratum.offload.step_model import predict_placement
    if DEV.type != "cpu":
        pytest.skip("deferred chunks are a CPU plan's (updates otherwise in the slot during the backward)")
    prof, _ = _reference("gpt", shared_tmp)
    prof = fixed_times(prof)  # the plan (which activations spill) must not depend on the machine's load
    m = build("gpt", shared_tmp)
    S = state_bytes(m)
    kw = {"host_budget": S // 10} if param_tier == DISK else {}
    p = plan(m, prof, clip=0.0, device_budget=S // 4, optimizer_tier=optimizer_tier, **kw)
    assert p.param_tier == param_tier
    layout = pack(m, p.chunk_elems)
    late = _deferral_options(layout, p.optimizer_tier, p.param_tier, False, None)[-1]
    assert late
    p = dataclasses.replace(p, deferred_chunks=tuple(sorted(late)))
    # the plan's own model of the traffic with these chunks deferred
    _, traffic, *_ = predict_placement(layout, p, costs=Costs.blocks(prof), bw=None, n_micro=2,
                                  deferred=False, n_params=m.num_params())
    p = dataclasses.replace(p, predicted_traffic=traffic)
    eng = _engine(m, p, clip=0.0)
    ref_engine = plain(build("gpt", shared_tmp), clip=0.0)
    try:
        assert_same([r.loss for r in _run_checking_traffic(eng, 6)], [r.loss for r in run(ref_engine, 6)])
        assert eng.phase_s["update_pass"] > 0  # the deferred updates ran after the backward
        got, want = eng.state(), ref_engine.state()
        names = list(want.params)
        # on a GPU (CPU vs CUDA AdamW) Adam's normalised step turns rounding in near-zero gradients into whole
        # steps of lr: parameters agree to about 1e-6 relative, not 1e-7 as the losses do
        assert_same_tensor(torch.cat([got.params[n].reshape(-1) for n in names]),
                           torch.cat([want.params[n].reshape(-1) for n in names]), "parameters", rel=10 * REL)
        names = list(want.optim)
        assert_same_tensor(torch.cat([got.optim[n]["exp_avg_sq"].reshape(-1) for n in names]),
                           torch.cat([want.optim[n]["exp_avg_sq"].reshape(-1) for n in names]), "exp_avg_sq")
    finally:
        eng.close()


@pytest.mark.skipif(DEV.type != "cpu", reason="the one-thread rule is for a CPU, where training uses every core")
def test_cpu_work_runs_in_place_and_disk_work_beside_on_one_core(shared_tmp):
    """On a CPU the memcpys between RAM tiers and a RAM-only AdamW run on the training thread with all of its
    threads (a thread beside compute only contends for the cores); work that waits on the disk runs on a thread
    of its own, its torch ops on one core (a second two-thread OpenMP team beside training's made both wait)."""
    prof, _ = _reference("gpt", shared_tmp)
    before = torch.get_num_threads()
    if before < 2:
        pytest.skip("torch runs one thread here: nothing to tell apart")
    S = state_bytes(build("gpt", shared_tmp))
    beside_seen = 0
    for kw in ({}, {"host_budget": S // 10, "optimizer_tier": DISK}):
        m = build("gpt", shared_tmp)
        p = plan(m, prof, device_budget=S // 4, **kw)
        eng = _engine(m, p)
        try:
            for pool, tiers in ((eng.xfer.pool, {p.param_tier}), (eng.opt_pool, {p.param_tier, p.optimizer_tier})):
                tid, n = pool.submit(lambda: (threading.get_ident(), torch.get_num_threads())).result()
                if DISK in tiers:
                    assert (tid != threading.get_ident(), n) == (True, 1)
                    beside_seen += 1
                else:
                    assert (tid, n) == (threading.get_ident(), before)
            assert torch.get_num_threads() == before  # the workers' setting is their own
        finally:
            eng.close()
    assert beside_seen >= 1
