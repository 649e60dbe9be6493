"""Build the ``BlockSeq`` a config asks for, from any of the three sources."""

from __future__ import annotations

import functools

import torch

from stratum.config import ModelConfig
from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq
from stratum.model.gpt import build_gpt, init_gpt_block
from stratum.model.hf import build_hf
from stratum.model.meta_init import no_meta_init
from stratum.model.presets import PRESETS
from stratum.model.sequential import build_sequential


def build_model(cfg: ModelConfig, *, tokenizer_vocab: int, seq_len: int, seed: int,
                device: torch.device | str = "cpu", lazy: bool = False) -> BlockSeq:
    """The configured model, initialised from ``seed`` (``device='meta'`` allocates nothing).

    ``lazy``: where the source can, parameters stay on the meta device and ``seq.materialize(i)`` gives block i
    the values an eager build would (own GPT: always; transformers: weights in safetensors files or a random
    init; sequential: a factory that returns one constructor per block). Engines that
    build block by block (offload) use it for models larger than RAM; other models are built eagerly.

    The model's vocabulary must cover the tokenizer's, and its context the training sequence length.
    """
    with no_meta_init():
        return _build(cfg, tokenizer_vocab=tokenizer_vocab, seq_len=seq_len, seed=seed, device=device, lazy=lazy)


def _build(cfg: ModelConfig, *, tokenizer_vocab: int, seq_len: int, seed: int, device: torch.device | str,
           lazy: bool) -> BlockSeq:
    if cfg.source == "gpt":
        vocab = cfg.vocab_size or PRESETS[cfg.preset].vocab_size or tokenizer_vocab
        _check_vocab(vocab, tokenizer_vocab)
        if seq_len > PRESETS[cfg.preset].max_seq_len:
            raise StratumError(f"data.seq_len = {seq_len} exceeds preset {cfg.preset!r}'s context of "
                               f"{PRESETS[cfg.preset].max_seq_len}")
        if lazy:
            seq = build_gpt(cfg.preset, vocab_size=vocab, seed=seed, dropout=cfg.dropout, device="meta")
            seq.block_init = functools.partial(init_gpt_block, seed=seed)
            return seq
        return build_gpt(cfg.preset, vocab_size=vocab, seed=seed, dropout=cfg.dropout, device=device)
    if cfg.source == "sequential":
        vocab = cfg.vocab_size or tokenizer_vocab
        _check_vocab(vocab, tokenizer_vocab)
        torch.manual_seed(seed)
        with torch.device(device):
            return build_sequential(cfg.factory, vocab_size=vocab, seq_len=seq_len, seed=seed, lazy=lazy,
                                    device=device)
    if cfg.source == "hf":
        seq = build_hf(cfg.hf_path, seed=seed, dropout=cfg.dropout, device=device,
                       vocab_size=cfg.vocab_size or None, lazy=lazy)
        _check_vocab(seq.info.vocab_size, tokenizer_vocab)
        if seq.info.max_seq_len and seq_len > seq.info.max_seq_len:
            raise StratumError(f"data.seq_len = {seq_len} exceeds the model's context of {seq.info.max_seq_len}")
        return seq
    raise StratumError(f"model.source = {cfg.source!r} is not one of: gpt, sequential, hf")


def _check_vocab(model_vocab: int, tokenizer_vocab: int) -> None:
    if model_vocab < tokenizer_vocab:
        raise StratumError(f"the model's vocabulary ({model_vocab}) is smaller than the tokenizer's "
                           f"({tokenizer_vocab}); raise model.vocab_size or use a smaller tokenizer")
