"""Measure each block of a BlockSeq on the current device, one block at a time.

Only the block being measured needs storage: a block built on the ``meta`` device is measured as a temporary
copy with real (random) storage, so a model far larger than memory can be profiled on a small machine. The
input of block ``i`` is the real output of block ``i-1``.

Activation bytes are counted with ``torch.autograd.graph.saved_tensors_hooks``: every tensor the block's
forward saves for backward, parameters excluded, each underlying storage once (views such as q/k/v splits of
one projection share a storage). The block's input counts in the block when the block saves it.
"""

from __future__ import annotations

import copy
import statistics
import time
from datetime import UTC, datetime

import torch
from torch import Tensor, nn

from stratum.config import Config
from stratum.data.prepare import make_tokenizer
from stratum.model.blockseq import ADAMW_STATE_BYTES_PER_PARAM, BlockSeq
from stratum.model.build import build_model
from stratum.model.neutral import neutral
from stratum.profile.profile import BlockProfile, Profile, spill_key
from stratum.runtime.device import HALF_DTYPES, autocast, describe, resolve_device, synchronize


def block_static_bytes(seq: BlockSeq, i: int) -> dict[str, int]:
    """Parameter, gradient and AdamW-state bytes of the parameters block ``i`` owns (works on ``meta``)."""
    owned = [p for _, p in seq.owned_parameters(i)]
    n = sum(p.numel() for p in owned)
    return {
        "n_params": n,
        "param_bytes": sum(p.numel() * p.element_size() for p in owned),
        "grad_bytes": sum(p.numel() * p.element_size() for p in owned if p.requires_grad),
        "optim_bytes": sum(p.numel() for p in owned if p.requires_grad) * ADAMW_STATE_BYTES_PER_PARAM,
    }


class _SavedBytes:
    """Counts bytes saved for backward, each storage once, parameters excluded."""

    def __init__(self, exclude: set[int], input_ptr: int = -1):
        self.exclude = exclude
        self.input_ptr = input_ptr
        self.seen: set[int] = set()
        self.bytes = 0
        self.views: set[tuple] = set()
        self.spill_bytes = 0
        """What the offload engine's spill copies (profile.spill_key), input excluded (activations.py)."""

    def pack(self, t: Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.exclude and ptr not in self.seen and st.nbytes() > 0:
            self.seen.add(ptr)
            self.bytes += st.nbytes()
        if ptr not in self.exclude and ptr != self.input_ptr and ptr != 0:
            key, nbytes = spill_key(t)
            if key not in self.views:
                self.views.add(key)
                self.spill_bytes += nbytes
        # not ``t`` itself: a tensor saved by its own grad_fn (an op's output) would then hold that node, which
        # holds it — a cycle through C++ that Python's gc cannot see, so the counted forward's whole graph
        # leaked (0.33 GiB of GPT-2 774M's LM head stayed resident through training)
        return t.detach()

    @staticmethod
    def unpack(t: Tensor) -> Tensor:
        return t


def _median_time(fn, device: torch.device, runs: int, warmup: int = 1) -> float:
    times = []
    for k in range(warmup + runs):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _working_copy(block: nn.Module, device: torch.device) -> nn.Module:
    """The block itself if it already lives on ``device``; otherwise a copy there (a meta block's copy gets
    random values: only costs are measured). The model itself is never moved, so ties and placement stay."""
    params = list(block.parameters()) + list(block.buffers())
    if params and all(t.device == device for t in params):
        return block
    work = copy.deepcopy(block)
    if any(t.is_meta for t in params):
        work.to_empty(device=device)
        with torch.no_grad():
            for p in work.parameters():
                p.normal_(0.0, 0.02)
    else:
        work.to(device)
    return work


def _time_backward(forward, inp: Tensor, params: list[nn.Parameter], device: torch.device, runs: int,
                   input_only: bool) -> float:
    """Median seconds of the backward alone (a fresh forward before each run is not timed)."""
    times = []
    for _ in range(runs + 1):
        out = forward()
        grad = None if out.ndim == 0 else torch.randn_like(out)
        synchronize(device)
        t0 = time.perf_counter()
        if input_only:
            torch.autograd.grad(out, [inp], grad)
        else:
            out.backward(grad)
        synchronize(device)
        times.append(time.perf_counter() - t0)
        for p in params:
            p.grad = None
    return statistics.median(times[1:])


def _half_saved(block: nn.Module, inp: Tensor, finish, device: torch.device, precision: str) -> dict[str, int]:
    """BlockProfile's ``half_*`` bytes of ``block`` (``finish``: its output → what the step differentiates, the
    loss for the last block): a forward counted as the offload engine runs it on 16-bit chunks — a copy with its
    parameters (not its buffers, which stay as they are) in ``precision``'s 16-bit dtype, on its input in that
    dtype. Empty for fp32."""
    if precision not in HALF_DTYPES:
        return {}
    dtype = HALF_DTYPES[precision]
    half = copy.deepcopy(block)
    for p in half.parameters():
        p.data = p.data.to(dtype)
    x = inp.detach().to(dtype) if inp.is_floating_point() else inp.detach()
    x.requires_grad_(x.is_floating_point())
    counter = _SavedBytes({p.untyped_storage().data_ptr() for p in half.parameters()}, x.untyped_storage().data_ptr())
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack), autocast(device, precision):
        raw = half(x)
        out = finish(raw)
    return {"half_act_saved_bytes": counter.bytes, "half_spill_bytes": counter.spill_bytes,
            "half_out_bytes": 0 if out is not raw else raw.numel() * raw.element_size()}


def _measure_block(seq: BlockSeq, i: int, x: Tensor, y: Tensor, device: torch.device, precision: str,
                   runs: int) -> tuple[BlockProfile, Tensor]:
    """Profile block ``i`` on input ``x``; returns its profile and its (detached) output. The measuring forwards
    and backwards run under ``neutral``: the model's RNG streams and buffers are left as they were; and in the
    modes its modules have, as training runs them (a caller's frozen BatchNorm stays in eval mode)."""
    with neutral(seq.blocks[i], devices=[device]):
        block = _working_copy(seq.blocks[i], device)
        last = i == len(seq) - 1
        params = list(block.parameters())
        inp = x.detach().requires_grad_(x.is_floating_point())

        def forward():
            with autocast(device, precision):
                out = block(inp)
                return seq.loss_fn(out, y) if last else out

        fwd_s = _median_time(forward, device, runs)
        counter = _SavedBytes({p.untyped_storage().data_ptr() for p in params}, inp.untyped_storage().data_ptr())
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            out = forward()
        out_bytes = 0 if last else out.numel() * out.element_size()
        del out
        logits_bytes = None
        if last:
            with torch.no_grad(), autocast(device, precision):
                logits = block(inp)
            logits_bytes = logits.numel() * logits.element_size()
            del logits
        bwd_s = _time_backward(forward, inp, params, device, runs, input_only=False)
        bwd_input_s = (_time_backward(forward, inp, params, device, runs, input_only=True)
                       if inp.requires_grad else 0.0)
        with torch.no_grad():
            nxt = x if last else block(x)
        half = _half_saved(block, inp, lambda out: seq.loss_fn(out, y) if last else out, device, precision)
        prof = BlockProfile(index=i, name=seq.block_names[i], kind=type(block).__name__,
                            act_saved_bytes=counter.bytes, spill_bytes=counter.spill_bytes,
                            out_bytes=out_bytes, logits_bytes=logits_bytes, fwd_s=fwd_s, bwd_s=bwd_s,
                            bwd_input_s=bwd_input_s, **half, **block_static_bytes(seq, i))
        return prof, nxt.detach()


def profile_blockseq(seq: BlockSeq, *, micro_batch: int, seq_len: int, device: torch.device,
                     precision: str = "fp32", runs: int = 5, seed: int = 0) -> Profile:
    """Measure every block: fwd/bwd seconds (median of ``runs``), bytes of params/grads/optimizer/activations.

    A block not on ``device`` (or on ``meta``) is measured as a temporary copy on ``device``, one block at a
    time, so only one block's storage exists at once.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = max(seq.info.vocab_size, 1)
    x: Tensor = torch.randint(0, vocab, (micro_batch, seq_len), generator=gen).to(device)
    y = torch.randint(0, vocab, (micro_batch, seq_len), generator=gen).to(device)
    blocks = []
    for i in range(len(seq)):
        prof, x = _measure_block(seq, i, x, y, device, precision, runs)
        blocks.append(prof)
    dtype = next(iter(seq.parameters())).dtype
    return Profile(model=seq.info.name, device=describe(device), dtype=str(dtype).removeprefix("torch."),
                   precision=precision, micro_batch=micro_batch, seq_len=seq_len, runs=runs, blocks=blocks,
                   tied=[list(g.names) for g in seq.tied], torch_version=torch.__version__,
                   created=datetime.now(UTC).isoformat(timespec="seconds"))


def profile_from_config(cfg: Config, *, runs: int = 5) -> Profile:
    """Profile the configured model with the configured micro-batch, sequence length, device and precision.

    The model is built on ``meta`` and materialised one block at a time, so presets larger than memory work.
    """

    device = resolve_device(cfg.train.device)
    tok = make_tokenizer(cfg)
    seq = build_model(cfg.model, tokenizer_vocab=tok.vocab_size, seq_len=cfg.data.seq_len, seed=cfg.train.seed,
                      device="meta")
    return profile_blockseq(seq, micro_batch=cfg.train.micro_batch_size, seq_len=cfg.data.seq_len,
                            device=device, precision=cfg.train.precision, runs=runs, seed=cfg.train.seed)
