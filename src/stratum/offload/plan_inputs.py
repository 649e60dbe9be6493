"""What a placement of a config's model is planned from, without training: the model on the meta device, its
block costs (measured on a small batch and cached, read from a profile, or estimated from its shapes) and the
bandwidths — for ``stratum plan``, the plan search and the dry run alike."""

from __future__ import annotations

from collections.abc import Callable

import torch

from stratum.config import Config
from stratum.data.corpus import resolve_corpus
from stratum.data.prepare import make_tokenizer
from stratum.model.blockseq import BlockSeq
from stratum.model.build import build_model
from stratum.offload.host_alloc import tune_allocator
from stratum.offload.setup import placement_inputs
from stratum.profile import Profile
from stratum.profile.fast import cached_profile, shape_profile
from stratum.runtime.device import resolve_device


def planning_profile(cfg: Config, model: BlockSeq, device: torch.device) -> Profile:
    """The block costs a plan of ``model`` (built on meta) is made from: measured on a small batch, scaled and
    cached (:mod:`stratum.profile.fast`)."""
    t = cfg.train
    tune_allocator()  # blocks are measured under the allocator policy training runs with
    return cached_profile(model, micro_batch=t.micro_batch_size, seq_len=cfg.data.seq_len, device=device,
                          cache_dir=cfg.cache_dir, precision=t.precision, seed=t.seed)


def estimated_profile(cfg: Config, model: BlockSeq, device: torch.device) -> Profile:
    """The block costs from ``model``'s shapes alone: bytes, no times (``stratum plan --estimate``)."""
    t = cfg.train
    return shape_profile(model, micro_batch=t.micro_batch_size, seq_len=cfg.data.seq_len, device=device,
                         precision=t.precision)


def profile_for(cfg: Config, model: BlockSeq, profile_path: str) -> Profile:
    """The profile at ``profile_path``, refused unless it was taken of ``model`` (its blocks' parameter counts) at
    ``cfg``'s batch shape and precision (:meth:`Profile.load_for`)."""
    return Profile.load_for(profile_path, block_params=[model.owned_numel(i) for i in range(len(model))],
                            micro_batch=cfg.train.micro_batch_size,
                            seq_len=cfg.data.seq_len, precision=cfg.train.precision)


ProfileSource = Callable[[Config, BlockSeq, torch.device], Profile]
"""Where a plan's block costs come from: :func:`planning_profile`, :func:`estimated_profile`, or a file's
(:func:`profile_from`)."""


def profile_from(path: str) -> ProfileSource:
    """The profile in the file at ``path``, checked against the model and config (:func:`profile_for`)."""
    return lambda cfg, model, device: profile_for(cfg, model, path)


def planning_inputs(cfg: Config, source: ProfileSource = planning_profile) -> tuple[dict, BlockSeq]:
    """(``make_placement``'s keyword arguments for ``cfg``, the model on the meta device) with the bandwidths measured
    once and the block costs from ``source``."""
    cfg.check_delayed_update()
    device = resolve_device(cfg.train.device)
    tok = make_tokenizer(cfg, resolve_corpus(cfg.data.corpus))
    model = build_model(cfg.model, tokenizer_vocab=tok.vocab_size, seq_len=cfg.data.seq_len, seed=cfg.train.seed,
                        device="meta")
    prof = source(cfg, model, device)
    return placement_inputs(cfg, model, device, profile=prof, always_profile=True), model
