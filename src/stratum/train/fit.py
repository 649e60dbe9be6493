"""Sizes checked before work: a run whose batches or (on the plain engine) training state cannot fit in memory is
refused up front with the bytes it needs and what to do, instead of an allocator traceback or hours of work.

The estimates are lower bounds — what the run certainly needs — so a refusal is never wrong; a run that passes
may still need more (activations beyond the logits).
"""

from __future__ import annotations

import torch

from stratum.config import Config
from stratum.errors import StratumError
from stratum.ir.plan import Local
from stratum.model.build import build_model
from stratum.runtime.device import device_memory_bytes
from stratum.train.dryrun import plain_fit
from stratum.units import fmt_bytes

TOKEN_BYTES = 8
"""int64 token ids."""
BATCH_COPIES = 3
"""The sampler's rows, then inputs and targets cut from them: three copies of a batch's tokens at once."""
STATE_BYTES_PER_PARAM = 16
"""fp32 parameter, gradient and two AdamW moments."""
LOGITS_COPIES = 3
"""Logits, their softmax and its gradient (fp32) live together during the loss's backward."""


def batch_bytes(cfg: Config) -> int:
    """Host bytes of the token tensors a step holds: the global batch and the evaluation batches."""
    t, row = cfg.train, cfg.data.seq_len + 1
    rows = max(cfg.global_batch, t.eval_batches * t.micro_batch_size)
    return rows * row * TOKEN_BYTES * BATCH_COPIES


def logits_bytes(cfg: Config, vocab_size: int) -> int:
    """fp32 logits of one micro-batch, with their softmax and gradient."""
    return cfg.train.micro_batch_size * cfg.data.seq_len * vocab_size * 4 * LOGITS_COPIES


def check_batches(cfg: Config) -> None:
    """Refuse token batches (training and evaluation) that cannot fit in host RAM."""
    host = device_memory_bytes(torch.device("cpu"))
    need = batch_bytes(cfg)
    if host is not None and need > host:
        raise StratumError(f"the token batches alone take {fmt_bytes(need)} (train.micro_batch_size × "
                           f"train.grad_accum × replicas, or × train.eval_batches for evaluation, × data.seq_len) "
                           f"but {fmt_bytes(host)} of RAM is available; lower train.micro_batch_size or "
                           "train.eval_batches")


def check_blocks(cfg: Config, *, tokenizer_vocab: int):
    """Refuse batches that cannot fit in host RAM, and a model with a block whose training state cannot: every
    engine (and the profiler) holds at least one whole block at a time. Returns the model on the meta device."""
    check_batches(cfg)
    model = build_model(cfg.model, tokenizer_vocab=tokenizer_vocab, seq_len=cfg.data.seq_len, seed=cfg.train.seed,
                        device="meta")
    host = device_memory_bytes(torch.device("cpu"))
    sizes = [model.owned_numel(i) * STATE_BYTES_PER_PARAM for i in range(len(model))]
    if host is not None and sizes and max(sizes) > host:
        i = sizes.index(max(sizes))
        raise StratumError(f"block {model.block_names[i]} alone needs {fmt_bytes(sizes[i])} for its parameters, "
                           f"gradients and AdamW moments, more than the {fmt_bytes(host)} of RAM available; every "
                           "engine holds a whole block at a time: make it smaller (model.vocab_size, the preset)")
    return model


def check_fits(cfg: Config, device: torch.device, *, tokenizer_vocab: int) -> None:
    """Refuse a run that cannot fit: :func:`check_blocks`, and on a one-process plain engine its training state
    and one micro-batch's logits on ``device``."""
    model = check_blocks(cfg, tokenizer_vocab=tokenizer_vocab)
    if not isinstance(cfg.plan.root, Local):
        return  # parallel plans split the state over processes; the offload engine plans its own tiers
    state, available = model.train_state_bytes(), device_memory_bytes(device)
    if available is None:
        return
    if state >= available:
        raise StratumError(plain_fit(state, available, device, cfg.offload.disk_dir).removeprefix("fit: "))
    need = state + logits_bytes(cfg, model.info.vocab_size or 0)
    if need > available:
        raise StratumError(f"the training state ({fmt_bytes(state)}) and one micro-batch's logits need "
                           f"{fmt_bytes(need)}, more than the {fmt_bytes(available)} available on "
                           f"{device.type}; lower train.micro_batch_size (with more train.grad_accum) or use the "
                           "offload engine (stratum plan --set train.engine=offload checks a placement)")
