"""Split backward of the pipeline runtime (``I`` then ``W``), in one process, no messages.

``I`` must give the stage-input gradient, ``W`` the weight gradients, together exactly what a full backward
(``B``) gives, and ``W`` must not redo the input-gradient work: it starts from the gradients ``I`` recorded at
the nodes where the weight-gradient branches leave the input path. Checked on Stratum's GPT (a middle stage and
the last stage with the loss), on a transformers GPT-2 stage, and on a toy stage with a parameter used at two
depths, a tied parameter, a parameter without gradient, an input-independent branch and a view as output.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from stratum.data.tokens import Batch
from stratum.model.gpt import build_gpt
from stratum.runtime.stage import StageRuntime
from stratum.schedule.ir import Action, Schedule

V, B_, T = 256, 2, 16
SCALE = 0.25


def make_runtime(blocks: list[nn.Module], stages: list[range], loss_fn) -> StageRuntime:
    """Every stage on rank 0: ``_execute`` needs no process group."""
    return StageRuntime(blocks=blocks, stages=stages, stage_to_rank=(0,) * len(stages), loss_fn=loss_fn, rank=0,
                        device=torch.device("cpu"), precision="fp32", timeout_s=5.0, backend="gloo")


def gpt_case():
    seq = build_gpt("tiny", vocab_size=V, seed=0)  # embed, layer.0, layer.1, head (tied to the embedding)
    return list(seq.blocks), seq.loss_fn


def hf_case(tmp_path):
    transformers = pytest.importorskip("transformers")
    from stratum.model.hf import build_hf
    transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=V, n_positions=64, pad_token_id=0,
                            bos_token_id=1, eos_token_id=2).save_pretrained(tmp_path)
    seq = build_hf(str(tmp_path / "config.json"), seed=0, dropout=0.0)  # embed, layer.0, layer.1, head (tied)
    return list(seq.blocks), seq.loss_fn


def data(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(x=torch.randint(0, V, (B_, T), generator=g), y=torch.randint(0, V, (B_, T), generator=g))


class Stage:
    """One stage ``s`` of a runtime, driven action by action; inputs are fixed tensors."""

    def __init__(self, rt: StageRuntime, s: int, x: torch.Tensor, grad_out: torch.Tensor | None,
                 batch: Batch):
        self.rt, self.s, self.x, self.grad_out, self.batches = rt, s, x, grad_out, [batch]
        self.saved: dict = {}
        self.params = rt.stage_params[s]
        self.last = s == rt.S - 1

    def act(self, kind: str) -> list[torch.Tensor]:
        inputs = {"F": [self.x] if self.s > 0 else [], "B": [] if self.last else [self.grad_out],
                  "I": [] if self.last else [self.grad_out], "W": []}[kind]
        return self.rt._execute(Action(kind, self.s, 0), inputs, self.batches, self.saved, training=True,
                                scale=SCALE, loss_sum=torch.zeros((), dtype=torch.float64))

    def zero(self) -> None:
        for p in self.params:
            p.grad = None

    def grads(self) -> list[torch.Tensor | None]:
        return [None if p.grad is None else p.grad.clone() for p in self.params]

    def full(self) -> tuple[torch.Tensor | None, list]:
        """F then B: the reference."""
        self.zero()
        self.act("F")
        got = self.act("B")
        return (got[0] if got else None), self.grads()

    def split(self) -> tuple[torch.Tensor | None, list]:
        """F, I, W: I must leave the weight gradients alone, W the input gradient."""
        self.zero()
        self.act("F")
        got = self.act("I")
        assert all(p.grad is None for p in self.params), "I touched a weight gradient"
        assert (self.s, 0) in self.saved
        self.act("W")
        assert not self.saved, "W must release the micro-batch's state"
        return (got[0] if got else None), self.grads()


def stage_inputs(blocks, stages, s, batch):
    """The activation entering stage ``s`` and a fixed gradient for its output (None on the last stage)."""
    with torch.no_grad():
        h = batch.x
        for i in range(stages[s].start):
            h = blocks[i](h)
        out = h
        for i in stages[s]:
            out = blocks[i](out)
    g = None if s == len(stages) - 1 else torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    return (h if s > 0 else None), g


def check_equal(stage: Stage, *, exact: bool = True) -> None:
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    ref_in, ref = stage.full()
    got_in, got = stage.split()
    if stage.s > 0:
        torch.testing.assert_close(got_in, ref_in, **tol)
    assert [g is None for g in got] == [g is None for g in ref]
    for g, r in zip(got, ref):
        if r is not None:
            torch.testing.assert_close(g, r, **tol)


STAGES = [range(0, 1), range(1, 3), range(3, 4)]  # embed | layer.0 layer.1 | head + loss


@pytest.mark.parametrize("model", ["gpt", "hf"])
@pytest.mark.parametrize("stages,s", [(STAGES, 1), (STAGES, 2), ([range(0, 2), range(2, 4)], 1),
                                      (STAGES, 0)], ids=["middle", "last", "layer+last", "first"])
def test_i_then_w_equals_full_backward(model, stages, s, tmp_path):
    blocks, loss_fn = gpt_case() if model == "gpt" else hf_case(tmp_path)
    rt = make_runtime(blocks, stages, loss_fn)
    batch = data()
    x, g = stage_inputs(blocks, stages, s, batch)
    st = Stage(rt, s, x, g, batch)
    check_equal(st)
    assert any(p.grad is not None for p in st.params)


class _Probe(torch.autograd.Function):
    """Identity whose backward counts its calls: placed on the input path between two parametrised blocks."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _Probe.calls += 1
        return g


@pytest.mark.parametrize("model", ["gpt", "hf"])
def test_w_does_not_walk_the_input_path(model, tmp_path):
    """A probe between layer.0 and layer.1 of the stage: I passes it once, W never (layer.0's weight gradients
    start from what I recorded). A W that walks from the stage output would pass it again (checked too, so
    this test can fail)."""
    blocks, loss_fn = gpt_case() if model == "gpt" else hf_case(tmp_path)
    h = blocks[1].register_forward_hook(lambda m, i, o: _Probe.apply(o))
    try:
        rt = make_runtime(blocks, STAGES, loss_fn)
        batch = data()
        x, g = stage_inputs(blocks, STAGES, 1, batch)
        st = Stage(rt, 1, x, g, batch)
        _Probe.calls = 0
        st.act("F")
        st.act("I")
        assert _Probe.calls == 1
        st.act("W")
        assert _Probe.calls == 1, "W went back through the input path"
        # the check is not vacuous: the former W (autograd.grad from the output to the parameters) passes it
        _Probe.calls = 0
        inp = x.clone().requires_grad_(True)
        out = blocks[2](blocks[1](inp))
        torch.autograd.grad(out, [inp], g, retain_graph=True)
        torch.autograd.grad(out, st.params, g, allow_unused=True)
        assert _Probe.calls == 2
    finally:
        h.remove()


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as m:
        fn()
    return m.get_total_flops()


@pytest.mark.parametrize("s", [1, 2], ids=["middle", "last"])
def test_i_plus_w_costs_one_backward(s):
    """FLOPs (matmuls, attention): I + W == B, and W is only the weight part."""
    blocks, loss_fn = gpt_case()
    rt = make_runtime(blocks, STAGES, loss_fn)
    batch = data()
    x, g = stage_inputs(blocks, STAGES, s, batch)
    st = Stage(rt, s, x, g, batch)
    st.act("F")
    b = _flops(lambda: st.act("B"))
    st.zero()
    st.act("F")
    i = _flops(lambda: st.act("I"))
    w = _flops(lambda: st.act("W"))
    assert b > 0 and i > 0 and w > 0
    assert i + w == b, (i, w, b)


class _Holder:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


@pytest.mark.parametrize("s", [1, 2], ids=["middle", "last"])
def test_graph_is_released(s):
    """Every saved activation is kept through I and freed by W without the garbage collector (no reference
    cycle through hooks); the last stage frees the loss part of its graph (logits' softmax) already at I."""
    blocks, loss_fn = gpt_case()
    rt = make_runtime(blocks, STAGES, loss_fn)
    batch = data()
    x, g = stage_inputs(blocks, STAGES, s, batch)
    st = Stage(rt, s, x, g, batch)
    refs: list[weakref.ref] = []

    def pack(t):
        h = _Holder(t.detach())  # not ``t``: an output saved with its grad_fn would be a cycle through C++
        refs.append(weakref.ref(h))
        return h

    def alive() -> int:
        return sum(r() is not None for r in refs)

    gc.collect()
    gc.disable()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
            st.act("F")
        after_f = alive()
        assert after_f > 0
        st.act("I")
        after_i = alive()
        assert after_i > 0
        if s == 2:
            assert after_i < after_f
        st.act("W")
        assert alive() == 0, f"{alive()} of {len(refs)} saved tensors still alive after W"
    finally:
        gc.enable()


class ToyA(nn.Module):
    """A parameter used at two depths, a parameter without gradient, an input-independent branch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.unused = nn.Parameter(torch.ones(3))
        self.s = nn.Parameter(torch.tensor(0.5))
        self.c = nn.Parameter(torch.randn(8))

    def forward(self, x):
        x = self.lin(x)
        x = self.lin(F.gelu(x))  # the same weight again, deeper on the input path
        return x + self.s * self.c


class ToyB(nn.Module):
    """Uses ToyA's linear weight (a parameter tied inside one stage); returns a view."""

    def __init__(self, tied: nn.Parameter):
        super().__init__()
        self.w = tied
        self.ln = nn.LayerNorm(8)

    def forward(self, x):
        return F.linear(torch.tanh(self.ln(x)), self.w).transpose(0, 1)


class ToyConst(nn.Module):
    """Output independent of the input: W must fall back to walking from the output."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return (self.p * 2).expand(x.shape[0], x.shape[1], 8).contiguous()


def toy_blocks():
    torch.manual_seed(3)
    a = ToyA()
    return [nn.Identity(), a, ToyB(a.lin.weight)]


def test_reused_tied_unused_and_view():
    blocks = toy_blocks()
    x = torch.randn(4, 5, 8)
    batch = Batch(x=x, y=x)
    # stage 1 in the middle (an empty stage 2 follows): its output, a view, gets a received gradient
    rt = make_runtime(blocks, [range(0, 1), range(1, 3), range(3, 3)], None)
    st = Stage(rt, 1, x, torch.randn(5, 4, 8), batch)
    check_equal(st, exact=False)
    names = {id(p): n for n, p in nn.ModuleList(blocks).named_parameters()}
    got = {names[id(p)]: p.grad for p in st.params}
    assert got["1.unused"] is None and got["1.s"] is not None and got["1.lin.weight"] is not None
    # and as the last stage, with a loss
    rt = make_runtime(blocks, [range(0, 1), range(1, 3)], lambda out, y: out.square().mean())
    check_equal(Stage(rt, 1, x, None, batch), exact=False)


def test_output_independent_of_input_falls_back():
    blocks = [nn.Identity(), ToyConst()]
    rt = make_runtime(blocks, [range(0, 1), range(1, 2)], lambda out, y: out.square().mean())
    x = torch.randn(2, 3, 8)
    st = Stage(rt, 1, x, None, Batch(x=x, y=x))
    ref_in, ref = st.full()
    got_in, got = st.split()
    assert torch.equal(got_in, torch.zeros_like(x)) and torch.equal(ref_in, got_in)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)


def test_a_whole_split_schedule_on_one_rank():
    """``StageRuntime.run`` over a zero-bubble schedule with three stages on one rank (local hand-offs): the
    accumulated gradients of 4 micro-batches equal plain full backwards."""
    from stratum.dist.launch import destroy_process_group, init_process_group
    blocks, loss_fn = gpt_case()
    stages = STAGES
    batches = [data(i) for i in range(4)]
    params = list({id(p): p for b in blocks for p in b.parameters()}.values())
    for p in params:
        p.grad = None
    for bt in batches:
        h = bt.x
        for b in blocks:
            h = b(h)
        (loss_fn(h, bt.y) * SCALE).backward()
    ref = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    acts = []
    for mb in range(4):  # every stage split (I/W) except stage 0's last micro-batch, which takes a B
        acts += [f"F0.{mb}", f"F1.{mb}", f"F2.{mb}", f"I2.{mb}", f"I1.{mb}"]
        acts += [f"B0.{mb}"] if mb == 3 else [f"I0.{mb}"]
        acts += [f"W2.{mb}", f"W1.{mb}"] + ([] if mb == 3 else [f"W0.{mb}"])
    sched = Schedule(name="split-one-rank", stage_to_rank=(0, 0, 0), num_microbatches=4,
                     actions=(tuple(Action.parse(a) for a in acts),))
    init_process_group(world=1, plan="test", backend="gloo", device=torch.device("cpu"), timeout_s=30)
    try:
        rt = make_runtime(blocks, stages, loss_fn)
        loss = rt.run(sched, batches, training=True, scale=SCALE)
    finally:
        destroy_process_group()
    assert loss.item() > 0
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r, rtol=1e-5, atol=1e-7)
