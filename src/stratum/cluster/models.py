"""Block costs of the models a job trace names, per sequence, on the one cost model (:class:`Costs`).

A trace names GPT presets (``gpt2-124m`` … ``gpt2-1.5b``, ``gpt-2.7b`` …). Each preset's blocks are measured
once on one thread of this machine's CPU (the reference device; one thread so the figure does not depend on
the machine's load or core count) at one sequence per micro-batch by the profiler's fast path
(:func:`stratum.profile.fast.cached_profile`: each distinct block measured once, cached per architecture under
the cache directory), so asking again is instant. A hardware spec's device ``speed`` is relative to that device
(:mod:`stratum.ir.hardware`). Times and activation bytes grow linearly with the sequences per device (the fast
profiler's own scaling rule); parameter bytes do not. Each block's kernel count and FLOPs per sequence are
counted on the meta device (:func:`stratum.profile.work.count_work`), for devices that give a ``peak_flops``
(:mod:`stratum.ir.work`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch

from stratum.errors import StratumError
from stratum.ir.costs import Costs
from stratum.ir.work import Work
from stratum.model.blockseq import BlockSeq
from stratum.model.gpt import build_gpt
from stratum.model.presets import PRESETS
from stratum.profile.fast import cache_key, cache_path, cached_profile
from stratum.profile.profile import Profile
from stratum.profile.profiler import block_static_bytes
from stratum.profile.work import count_work, count_work_on

REFERENCE_THREADS = 1
"""CPU threads of the reference device the presets are measured on."""
FALLBACK_VOCAB = 50257
"""Vocabulary of a preset that takes its own from the tokenizer (``tiny`` … ``small``): GPT-2's."""


@dataclass(frozen=True, kw_only=True)
class ModelCosts:
    """What the simulator knows of a model: its blocks' costs for one sequence, and its training state."""

    costs: Costs
    """Per-block costs of one sequence (seconds on the profiled device, bytes)."""
    state_bytes: int
    """Bytes of parameters, gradients and AdamW moments a data-parallel replica holds."""
    work: Work | None = None
    """Per-block kernel counts and FLOPs of one sequence; None: not counted (devices need no ``peak_flops``)."""

    @property
    def seq_s(self) -> float:
        """Forward + backward seconds of one sequence on the profiled device."""
        return sum(self.costs.f) + sum(self.costs.b)

    @property
    def grad_bytes(self) -> float:
        """Bytes a data-parallel all-reduce moves (every block's gradient)."""
        return sum(self.costs.param_bytes)

    @property
    def act_bytes(self) -> float:
        """Bytes one sequence keeps for its backward pass."""
        return sum(self.costs.act_bytes)


def tied_to_last_user(costs: Costs, model: BlockSeq) -> Costs:
    """``costs`` with each tied parameter's bytes moved from its owner's block to the last block using it. The
    burst executor all-reduces a tied gradient at the widest of its blocks' widths, and in a GPT the last user
    (the head) is the wide one, so a burst plan is charged that all-reduce where it runs — exactly when the last
    user is at least as wide as the owner; data parallelism (every block alike) is priced the same either way."""
    param_bytes = list(costs.param_bytes)
    params = dict(model.named_parameters(remove_duplicate=False))
    for group in model.tied:
        nbytes = params[group.owner].numel() * params[group.owner].element_size()
        users = [int(name.split(".")[1]) for name in group.names]  # "blocks.<i>.<name in block>"
        param_bytes[users[0]] -= nbytes
        param_bytes[max(users)] += nbytes
    return replace(costs, param_bytes=param_bytes)


def known_models() -> list[str]:
    return list(PRESETS)


@lru_cache(maxsize=64)
def preset_costs(preset: str, *, seq_len: int, cache_dir: Path) -> ModelCosts:
    """``preset``'s block costs for one sequence of ``seq_len`` tokens, measured here once and cached."""
    if preset not in PRESETS:
        raise StratumError(f"unknown model {preset!r}; choose one of: {', '.join(PRESETS)}")
    shape = PRESETS[preset]
    if not 1 <= seq_len <= shape.max_seq_len:
        raise StratumError(f"seq_len {seq_len} is outside 1..{shape.max_seq_len}, {preset}'s context")
    vocab = shape.vocab_size or FALLBACK_VOCAB
    threads = torch.get_num_threads()
    torch.set_num_threads(REFERENCE_THREADS)
    try:  # the cache key is the architecture's: a model on meta names it without allocating a weight
        meta = build_gpt(preset, vocab_size=vocab, seed=0, device="meta")
        path = cache_path(cache_dir, meta, cache_key(meta, micro_batch=1, seq_len=seq_len, device=torch.device("cpu"),
                                                     precision="fp32"))
    finally:
        torch.set_num_threads(threads)
    work = count_work(meta, seq_len=seq_len)
    if path.is_file():
        try:
            prof = Profile.load(path)
        except StratumError:
            prof = None  # unreadable: measured again below
        if prof is not None:
            return ModelCosts(costs=tied_to_last_user(Costs.blocks(prof), meta), state_bytes=prof.train_state_bytes,
                              work=work)
    threads = torch.get_num_threads()
    torch.set_num_threads(REFERENCE_THREADS)
    try:  # the model on meta: each distinct block is built and measured alone (a 6.7B model whole is 27 GB)
        prof = cached_profile(meta, micro_batch=1, seq_len=seq_len, device=torch.device("cpu"),
                              cache_dir=cache_dir)
    finally:
        torch.set_num_threads(threads)
    return ModelCosts(costs=tied_to_last_user(Costs.blocks(prof), meta), state_bytes=prof.train_state_bytes,
                      work=work)


def counted_costs(model: BlockSeq, x: torch.Tensor, y: torch.Tensor, *, reference_flops: float) -> ModelCosts:
    """Costs of a model no profile measured (built on meta; ``x``, ``y`` one sample on meta): kernels and FLOPs
    counted, parameter and output bytes from shapes, and as its profiled times its FLOPs over
    ``reference_flops`` (a third forward, two thirds backward) — the unit its work is reported in. Saved
    activations are taken as the blocks' outputs (an underestimate; they only decide whether a job fits)."""
    work = count_work_on(model, x, y)
    outs, h = [], x
    with torch.no_grad():
        for block in model.blocks[:-1]:
            h = block(h)
            outs.append(h.numel() * h.element_size())
    outs.append(0)
    fwd = [f / 3 / reference_flops for f in work.flops]
    bwd = [2 * f for f in fwd]
    static = [block_static_bytes(model, i) for i in range(len(model))]
    costs = Costs(f=fwd, b=bwd, i=fwd, w=fwd, act_bytes=outs, out_bytes=outs,
                  param_bytes=[st["param_bytes"] for st in static])
    state = sum(st["param_bytes"] + st["grad_bytes"] + st["optim_bytes"] for st in static)
    return ModelCosts(costs=costs, state_bytes=state, work=work)
