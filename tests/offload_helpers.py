"""Shared helpers of the offload tests: deep-but-tiny models of all three sources, batches, reference runs."""

from __future__ import annotations

import copy

import torch

from stratum.data.tokens import Batch
from stratum.model.blockseq import BlockSeq
from stratum.offload.planner import make_plan
from stratum.profile.profiler import profile_blockseq
from stratum.runtime.engine import OptimSpec
from stratum.runtime.plain import PlainEngine

V, T, B = 256, 16, 1
# deep enough that 10% of the training state holds a block's chunks (the tied embedding stays on the device)
LAYERS = {"gpt": 12, "sequential": 16, "hf": 12}
CPU = torch.device("cpu")


def spec(clip: float = 1.0) -> OptimSpec:
    return OptimSpec(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=clip)


def build(source: str, tmp_path) -> BlockSeq:
    """The same freshly initialised model on every call."""
    torch.manual_seed(0)
    if source == "gpt":
        from stratum.model import gpt
        shape = gpt.GPTShape(n_layer=LAYERS["gpt"], n_head=2, d_model=64, max_seq_len=64, vocab_size=None)
        gpt.PRESETS.setdefault("offload-test", shape)
        return gpt.build_gpt("offload-test", vocab_size=V, seed=0)
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
        return build_hf(str(d), seed=0)
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
    return PlainEngine(model, optim=spec(clip), device=CPU)


def profile(model):
    with torch.random.fork_rng(devices=[]):
        prof = profile_blockseq(copy.deepcopy(model), micro_batch=B, seq_len=T, device=CPU, runs=1)
    return prof


def state_bytes(model) -> int:
    return 16 * sum(p.numel() for p in model.parameters())


def plan(model, prof, *, n_micro=2, clip=1.0, **kw):
    return make_plan(model, profile=prof, n_micro=n_micro, grad_clip=clip,
                     **{"device_budget": None, "host_budget": None, "disk_free": None, "bandwidths": None, **kw})
