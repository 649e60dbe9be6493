"""Shared helpers of the offload tests: deep-but-tiny models of all three sources, batches, reference runs."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from stratum.data.tokens import Batch
from stratum.model.blockseq import BlockSeq
from stratum.offload.planner import make_placement
from stratum.offload.tiers import Bandwidths
from stratum.profile.profiler import profile_blockseq
from stratum.runtime.engine import OptimSpec
from stratum.runtime.plain import PlainEngine

V, T, B = 256, 16, 1
# deep enough that 10% of the training state holds a block's chunks (the tied embedding stays on the device)
LAYERS = {"gpt": 12, "sequential": 16, "hf": 12}
# The device the offload tests run on: the CPU by default; `STRATUM_TEST_DEVICE=cuda` runs them on a GPU, where
# the device tier is GPU memory, the host tier pinned RAM, and copies run on side streams.
DEV = torch.device(os.environ.get("STRATUM_TEST_DEVICE", "cpu"))
# On a CPU the offload engine does the plain engine's arithmetic op for op: losses are bitwise equal. On a GPU a
# host- or disk-tier update runs torch's CPU fused AdamW where the plain engine runs the CUDA one: equal within
# float32 rounding, which compounds over 20 steps to about 1e-7 relative in the loss (the bound: 1e-6).
REL = 0.0 if DEV.type == "cpu" else 1e-6


def assert_same(got, want, rel: float = REL) -> None:
    """Sequences of floats (losses, gradient norms) equal: exactly on a CPU, within ``rel`` on a GPU."""
    got, want = list(got), list(want)
    if rel == 0.0:
        assert got == want
    else:
        assert got == pytest.approx(want, rel=rel, abs=0)


def assert_same_tensor(got, want, what: str = "", rel: float = REL) -> None:
    """Tensors equal: exactly on a CPU, within ``rel`` in norm (‖got − want‖ ≤ rel ‖want‖) on a GPU."""
    if rel == 0.0:
        assert torch.equal(got, want), what
    else:
        got, want = got.double().cpu(), want.double().cpu()
        err = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))
        assert err <= rel, (what, err)


def spec(clip: float = 1.0) -> OptimSpec:
    return OptimSpec(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=clip)


def build(source: str, tmp_path, dropout: float | None = None) -> BlockSeq:
    """The same freshly initialised model on every call; ``dropout`` (gpt, hf) replaces the source's own (gpt: 0,
    the transformers GPT-2 config: 0.1)."""
    torch.manual_seed(0)
    if source == "gpt":
        from stratum.model import gpt, presets
        shape = presets.GPTShape(n_layer=LAYERS["gpt"], n_head=2, d_model=64, max_seq_len=64, vocab_size=None)
        gpt.PRESETS.setdefault("offload-test", shape)
        return gpt.build_gpt("offload-test", vocab_size=V, seed=0, dropout=dropout or 0.0)
    if source == "sequential":
        from stratum.model.sequential import example_lm, from_sequential
        return from_sequential(example_lm(vocab_size=V, seq_len=T, d_model=64, n_layer=LAYERS["sequential"]))
    if source == "hf":
        import transformers

        from stratum.model.hf import build_hf
        d = tmp_path / "gpt2-cfg"
        if not d.exists():
            transformers.GPT2Config(n_layer=LAYERS["hf"], n_head=2, n_embd=64, vocab_size=V, n_positions=64,
                                    bos_token_id=1, eos_token_id=2).save_pretrained(d)
        return build_hf(str(d), seed=0, dropout=dropout)
    raise ValueError(source)


def batches(step: int, n: int = 2) -> list[Batch]:
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(n):
        data = torch.randint(0, V, (B, T + 1), generator=g)
        out.append(Batch(x=data[:, :-1].contiguous(), y=data[:, 1:].contiguous()))
    return out


def lr(step: int) -> float:
    return 3e-3 * min(1.0, (step + 1) / 3)


def run(engine, steps, start=0, n=2):
    return [engine.train_step(batches(s, n), lr(s)) for s in range(start, start + steps)]


def plain(model, clip=1.0):
    return PlainEngine(model, optim=spec(clip), device=DEV)


def profile(model, precision: str = "fp32"):
    with torch.random.fork_rng(devices=[]):
        prof = profile_blockseq(copy.deepcopy(model), micro_batch=B, seq_len=T, device=DEV, runs=1,
                                precision=precision)
    return prof


def state_bytes(model) -> int:
    return 16 * sum(p.numel() for p in model.parameters())


def plan(model, prof, *, n_micro=2, clip=1.0, **kw):
    return make_placement(model, profile=prof, n_micro=n_micro, grad_clip=clip,
                     **{"device_budget": None, "host_budget": None, "disk_free": None, "bandwidths": _GPU_LINKS, **kw})


# On a GPU the planner must know that copies run beside compute (its host accounting differs); nominal figures,
# not measured ones, keep the tests' plans the same on every run.
_GPU_LINKS = (Bandwidths(h2d=20e9, d2h=20e9, disk_read=2e9, disk_write=1e9, adam_params_per_s=1e9, async_copies=True)
              if DEV.type == "cuda" else None)


def fixed_times(prof):
    """``prof`` with the measured seconds replaced by a fixed model of them (2 FLOPs per parameter and token
    forward, twice that backward, at 10 GFLOP/s, plus 0.1 ms a block): measured seconds grow with the machine's
    load, and the plans of these tests must not."""
    import dataclasses
    tokens = 16
    blocks = []
    for b in prof.blocks:
        fwd = 1e-4 + 2 * b.n_params * tokens / 1e10
        blocks.append(dataclasses.replace(b, fwd_s=fwd, bwd_s=2 * fwd, bwd_input_s=fwd if b.index else 0.0))
    return dataclasses.replace(prof, blocks=blocks)
