"""Profiles for planning, fast: bytes from shapes alone, or times measured on a small batch, scaled and cached.

``stratum profile`` measures every block at the training micro-batch, which for a 6.7B-parameter model on a busy
2-core machine takes a quarter of an hour. The planner needs less:

- :func:`shape_profile` — no compute at all. Each distinct block runs forward on fake tensors (``FakeTensorMode``
  on the training device: shapes, devices and aliasing, no values, no memory, no kernels) under
  ``saved_tensors_hooks``, which gives the bytes it saves for backward and its output bytes at the training
  batch; parameter, gradient and AdamW bytes follow from the parameters' shapes. Times are zero. The bytes equal
  a real CPU run's for the own GPT and transformers' GPT-2; a Llama layer counts about 12 % more than it saves
  when run (both tested: there an upper bound, not an exact count).
- :func:`scaled_profile` — each distinct block (same class, parameter shapes and input shape: one GPT layer
  stands for all of them) measured on a probe micro-batch sized to the model (PROBE_FLOPS: a small model at its
  training batch, a 6.7B one on a single sequence), its times and activation bytes scaled to the training
  micro-batch (both grow with the batch; a few bytes that do not, such as position ids, scale into a slight
  overestimate, and a device runs a small batch less efficiently, so scaled times err long). A line per measured
  block says where it is.
- :func:`cached_profile` — :func:`scaled_profile` kept per (model architecture, device, threads, precision,
  batch shape, torch version) under the cache directory: asking again is instant.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq
from stratum.model.neutral import neutral
from stratum.model.placement import param_like, replace_tensors
from stratum.profile.profile import FORMAT_VERSION, BlockProfile, Profile
from stratum.profile.profiler import _measure_block, block_static_bytes
from stratum.runtime.device import autocast, describe

logger = logging.getLogger(__name__)

PROBE_FLOPS = 5e10
"""Training FLOPs (6 per parameter per token) one pass of the largest block may cost on the probe micro-batch:
the probe holds as many whole sequences as fit in it, at least one and at most the training micro-batch. A small
model is measured at its training batch (exact, and its kernels' per-call overhead would make a scaled small
batch err long); a 6.7B model's layer on one sequence of 128 tokens."""
PROBE_RUNS = 2
"""Timed runs per distinct block; the median is kept (warm-up runs come on top)."""
CACHE_SUBDIR = "profiles"

Measure = Callable[[int, Tensor], tuple[BlockProfile, Tensor]]
"""Profile block ``i`` on input ``x``: its profile and its output (the next block's input)."""


def probe_batch(model: BlockSeq, micro_batch: int, seq_len: int) -> int:
    """Sequences of the probe micro-batch: as many as PROBE_FLOPS allows the largest block, at least one, at most
    ``micro_batch``."""
    largest = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    return min(micro_batch, max(1, int(PROBE_FLOPS // (6 * max(largest, 1) * seq_len))))


def _structure(model: BlockSeq, i: int) -> tuple:
    """Block ``i`` as its cost sees it: its place (the last computes the loss), its modules as printed (their
    classes and settings: a sliding-window layer prints so, beside a full-attention one of the same shapes) and
    its parameters' shapes."""
    blk = model.blocks[i]
    return (i == len(model) - 1, repr(blk), tuple((n, tuple(p.shape)) for n, p in blk.named_parameters()))


def _signature(model: BlockSeq, i: int, x: Tensor) -> tuple:
    """What makes two blocks cost the same: their structure and their input."""
    return (_structure(model, i), x.dtype, tuple(x.shape))


def _distinct_count(model: BlockSeq) -> int:
    """How many blocks will be measured (input shapes aside, which a GPT's layers share)."""
    return len({_structure(model, i) for i in range(len(model))})


def per_block(model: BlockSeq, x: Tensor, measure: Measure, what: str | None) -> list[BlockProfile]:
    """Every block's profile, measuring each distinct block once (``measure``) and copying it to its twins; a
    progress line per measured block says ``what`` is done to it (none where ``what`` is None: it is quick)."""
    cache: dict[tuple, tuple[BlockProfile, Tensor]] = {}
    total = _distinct_count(model)
    blocks = []
    for i in range(len(model)):
        sig = _signature(model, i, x)
        if sig not in cache:
            if what:
                logger.info(f"{what} block {model.block_names[i]} ({len(cache) + 1} of ~{total} distinct) …")
            cache[sig] = measure(i, x)
        prof, out = cache[sig]
        static: dict[str, Any] = block_static_bytes(model, i)
        blocks.append(dataclasses.replace(prof, index=i, name=model.block_names[i], **static))
        x = out
    return blocks


def _inputs(model: BlockSeq, micro_batch: int, seq_len: int, seed: int, device) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    vocab = max(model.info.vocab_size, 1)
    x = torch.randint(0, vocab, (micro_batch, seq_len), generator=gen)
    y = torch.randint(0, vocab, (micro_batch, seq_len), generator=gen)
    return x.to(device), y.to(device)


def _profile(model: BlockSeq, blocks: list[BlockProfile], *, device: str, precision: str, micro_batch: int,
             seq_len: int, runs: int) -> Profile:
    dtype = next(iter(model.parameters())).dtype
    return Profile(model=model.info.name, device=device, dtype=str(dtype).removeprefix("torch."),
                   precision=precision, micro_batch=micro_batch, seq_len=seq_len, runs=runs, blocks=blocks,
                   tied=[list(g.names) for g in model.tied], torch_version=torch.__version__)


# ---- bytes from shapes ------------------------------------------------------------------------------------------
class _StorageBytes:
    """Bytes saved for backward, each storage once, parameters excluded — among fake tensors, which have no data
    pointers, storages are told apart by their C++ object."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: Tensor) -> Tensor:
        st = t.untyped_storage()
        key = st._cdata
        if key not in self.exclude and key not in self.seen and st.nbytes() > 0:
            self.seen.add(key)
            self.bytes += st.nbytes()
        return t.detach()

    @staticmethod
    def unpack(t: Tensor) -> Tensor:
        return t


def _fake_state(block: nn.Module, device: torch.device) -> None:
    """Give ``block``'s parameters and buffers fake storage on ``device`` (inside a FakeTensorMode: shapes and
    devices, no memory); a tensor the block holds twice stays one tensor."""
    replace_tensors(block, lambda t, is_param: param_like(t, torch.empty(t.shape, dtype=t.dtype, device=device),
                                                          is_param))


def _shape_measure(model: BlockSeq, y: Tensor, mode: FakeTensorMode, device: torch.device,
                   precision: str) -> Measure:
    def measure(i: int, x: Tensor) -> tuple[BlockProfile, Tensor]:
        last = i == len(model) - 1
        work = copy.deepcopy(model.blocks[i])  # parameters on meta: a copy costs nothing
        with neutral(), mode:  # the RNG forked outside the fake mode: its state is a real tensor
            _fake_state(work, device)  # (in the modes the model's modules have, as training runs them)
            inp = x.detach().requires_grad_(x.is_floating_point())
            counter = _StorageBytes({p.untyped_storage()._cdata for p in work.parameters()})
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack), autocast(device, precision):
                out = work(inp)
                logits_bytes = out.numel() * out.element_size() if last else None
                if last:
                    out = model.loss_fn(out, y)
            nxt = x if last else out.detach()
        prof = BlockProfile(index=i, name=model.block_names[i], kind=type(work).__name__,
                            act_saved_bytes=counter.bytes, out_bytes=0 if last else out.numel() * out.element_size(),
                            logits_bytes=logits_bytes,
                            fwd_s=0.0, bwd_s=0.0, bwd_input_s=0.0, **block_static_bytes(model, i))
        return prof, nxt
    return measure


def shape_profile(model: BlockSeq, *, micro_batch: int, seq_len: int, device: torch.device,
                  precision: str = "fp32") -> Profile:
    """Bytes of every block at the training batch from a forward on fake tensors (``model`` built on meta);
    times 0. Nothing is computed or allocated."""
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError("shape_profile needs the model built on the meta device")
    mode = FakeTensorMode()
    with mode:
        x, y = _inputs(model, micro_batch, seq_len, 0, device)
    try:
        blocks = per_block(model, x, _shape_measure(model, y, mode, device, precision), None)
    except (NotImplementedError, RuntimeError) as e:  # an operator fake tensors cannot run, or data-dependent
        raise StratumError(f"the model's shapes cannot be traced without running it ({str(e).splitlines()[0]}); "
                           "leave out --estimate to measure the blocks instead") from None
    return _profile(model, blocks, device=f"{describe(device)} (shapes only)", precision=precision,
                    micro_batch=micro_batch, seq_len=seq_len, runs=0)


# ---- times on a small batch, scaled -------------------------------------------------------------------------------
def scale(block: BlockProfile, factor: float) -> BlockProfile:
    """A block's per-micro-batch costs at ``factor`` times the batch (static bytes unchanged)."""
    return dataclasses.replace(
        block, act_saved_bytes=round(block.act_saved_bytes * factor), out_bytes=round(block.out_bytes * factor),
        spill_bytes=round(block.spill_bytes * factor), fwd_s=block.fwd_s * factor, bwd_s=block.bwd_s * factor,
        bwd_input_s=block.bwd_input_s * factor,
        **{k: round(v * factor) for k in ("half_act_saved_bytes", "half_spill_bytes", "half_out_bytes", "logits_bytes")
           if (v := getattr(block, k)) is not None})


def scaled_profile(model: BlockSeq, *, micro_batch: int, seq_len: int, device: torch.device,
                   precision: str = "fp32", seed: int = 0) -> Profile:
    """Each distinct block measured on the probe micro-batch (:func:`probe_batch`), scaled to ``micro_batch``.
    The model's RNG streams and buffers are left as they were."""
    probe = probe_batch(model, micro_batch, seq_len)
    logger.info(f"measuring {model.info.name}'s blocks on {probe} × {seq_len} tokens (scaled to a micro-batch of "
                f"{micro_batch}) on {describe(device)}")
    t0 = time.perf_counter()
    with neutral(devices=[device]):
        x, y = _inputs(model, probe, seq_len, seed, device)

        def measure(i: int, inp: Tensor) -> tuple[BlockProfile, Tensor]:
            return _measure_block(model, i, inp, y, device, precision, PROBE_RUNS)
        blocks = per_block(model, x, measure, "measuring")
        for p in model.parameters():
            p.grad = None
    logger.info(f"measured in {time.perf_counter() - t0:.1f} s")
    factor = micro_batch / probe
    return _profile(model, [scale(b, factor) for b in blocks], device=describe(device), precision=precision,
                    micro_batch=micro_batch, seq_len=seq_len, runs=PROBE_RUNS)


def cache_key(model: BlockSeq, *, micro_batch: int, seq_len: int, device: torch.device, precision: str) -> str:
    """What a scaled profile depends on, hashed: the architecture, not the weights' values."""
    facts = {"model": model.fingerprint(), "device": describe(device), "threads": torch.get_num_threads(),
             "precision": precision, "micro_batch": micro_batch, "seq_len": seq_len,
             "probe": probe_batch(model, micro_batch, seq_len), "runs": PROBE_RUNS, "torch": torch.__version__,
             "format": FORMAT_VERSION, "measures": "half_bytes,logits_bytes",  # (the optional fields it holds)
             "twins": "by structure"}  # (blocks measured once for all their twins: _structure)
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_path(cache_dir: Path, model: BlockSeq, key: str) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", model.info.name)[:60]
    return Path(cache_dir) / CACHE_SUBDIR / f"{name}-{key}.json"


def cached_profile(model: BlockSeq, *, micro_batch: int, seq_len: int, device: torch.device, cache_dir: Path,
                   precision: str = "fp32", seed: int = 0) -> Profile:
    """:func:`scaled_profile`, from the cache when this architecture was measured here before; a cache that
    cannot be read is measured again, one that cannot be written is a warning."""
    path = cache_path(cache_dir, model, cache_key(model, micro_batch=micro_batch, seq_len=seq_len, device=device,
                                                  precision=precision))
    if path.is_file():
        try:
            prof = Profile.load(path)
        except StratumError as e:
            logger.warning(f"ignoring the unreadable cached profile {path} ({e})")
        else:
            logger.info(f"block costs from the cached profile {path} (delete it to measure them again)")
            return prof
    prof = scaled_profile(model, micro_batch=micro_batch, seq_len=seq_len, device=device, precision=precision,
                          seed=seed)
    try:
        prof.save(path)
    except (OSError, StratumError) as e:  # the atomic writer reports a failed write as a StratumError
        logger.warning(f"cannot cache the profile in {path.parent} ({e}); the next plan measures again")
    return prof
