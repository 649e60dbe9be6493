"""The batch of issue 20's benchmarks ("the seeds' settings"): the largest micro-batch the plain engine trains on the
device, found by doubling until an allocation fails, and the gradient accumulation that brings an optimizer step to
a target number of tokens — the same for every engine compared, so only the engine differs.

Powers of two only, and on a GPU a peak within HEADROOM of its memory: the largest size that passes leaves the
allocator room for what one probing step does not show.
"""

from __future__ import annotations

import copy
import gc

import torch

from stratum.config import Config
from stratum.data.tokens import Batch
from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq
from stratum.parallel.compose import make_engine
from stratum.runtime.device import synchronize


def out_of_memory(err: BaseException) -> bool:
    """An allocation failure: the CUDA allocator's, or the CPU allocator's (a process under an address-space limit)."""
    return isinstance(err, torch.cuda.OutOfMemoryError) or "can't allocate memory" in str(err)


def release(device: torch.device) -> None:
    """Return freed blocks to the device, so the next allocation (and the next peak reading) starts clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


HEADROOM = 0.9
"""A micro-batch fits where its step's CUDA peak stays within this share of the GPU's memory: the engines compared
at it hold buffers of their own beside the model (the offload engine's chunks and staging), and a longer run
fragments the allocator more than one probing step does."""


def _trains(engine, vocab: int, micro: int, seq_len: int, device: torch.device) -> int | None:
    """One optimizer step of one ``micro`` × ``seq_len`` micro-batch (AdamW's state allocated by the first): the
    CUDA allocator's peak bytes during it (0 on a CPU), or None where an allocation failed."""
    x = torch.randint(0, vocab, (micro, seq_len), generator=torch.Generator().manual_seed(micro))
    try:
        engine.train_step([Batch(x=x, y=x.roll(-1, dims=1), stream=0)], 0.0)
        synchronize(device)
    except RuntimeError as err:  # torch.cuda.OutOfMemoryError is one
        if not out_of_memory(err):
            raise
        return None
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def largest_micro_batch(engine, vocab: int, seq_len: int, device: torch.device, cap: int,
                        limit_bytes: int | None = None) -> tuple[int, list[dict]]:
    """The largest power-of-two micro-batch (at most ``cap``) ``engine`` trains at ``seq_len`` on ``device`` with
    its peak within ``limit_bytes`` (None: any that allocates), and every size tried (``{"micro_batch", "fits",
    "peak_bytes"}``); a StratumError where not even one sequence fits."""
    tried: list[dict] = []
    best, micro = 0, 1
    while micro <= cap:
        peak = _trains(engine, vocab, micro, seq_len, device)
        release(device)
        ok = peak is not None and (limit_bytes is None or peak <= limit_bytes)
        tried.append({"micro_batch": micro, "fits": ok, "peak_bytes": peak})
        if not ok:
            break
        best, micro = micro, 2 * micro
    if best == 0:
        raise StratumError(f"the plain engine cannot train one sequence of {seq_len} tokens on {device}: pick a "
                           "smaller preset or sequence length")
    return best, tried


def plain_fit(cfg: Config, model: BlockSeq, device: torch.device, cap: int) -> tuple[int, list[dict]]:
    """:func:`largest_micro_batch` of the plain engine of ``cfg`` over a copy of ``model`` within HEADROOM of a
    GPU's memory, the engine released after."""
    limit = int(HEADROOM * torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None
    engine = make_engine(cfg, copy.deepcopy(model), device)
    try:
        return largest_micro_batch(engine, model.info.vocab_size, cfg.data.seq_len, device, cap, limit)
    finally:
        del engine
        release(device)


def accumulation(tokens_per_step: int, micro: int, seq_len: int) -> int:
    """Micro-batches per optimizer step nearest ``tokens_per_step`` tokens (at least one; 0 tokens: one)."""
    return max(1, round(tokens_per_step / (micro * seq_len)))
