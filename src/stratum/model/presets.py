"""The GPT presets' shapes and their exact parameter counts: plain data, no torch, so the config's validation and
the command line's grammar can name the presets without importing the model code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class GPTShape:
    """Architecture of a GPT preset."""

    n_layer: int
    n_head: int
    d_model: int
    max_seq_len: int
    vocab_size: int | None
    """Preset vocabulary; None means "the tokenizer's"."""


PRESETS: dict[str, GPTShape] = {
    # test- and laptop-sized, vocabulary from the tokenizer
    "tiny": GPTShape(n_layer=2, n_head=2, d_model=64, max_seq_len=256, vocab_size=None),
    "mini": GPTShape(n_layer=4, n_head=4, d_model=128, max_seq_len=512, vocab_size=None),
    "small": GPTShape(n_layer=6, n_head=6, d_model=384, max_seq_len=1024, vocab_size=None),
    # the GPT-2 family (Radford et al. 2019), vocabulary 50257
    "gpt2-124m": GPTShape(n_layer=12, n_head=12, d_model=768, max_seq_len=1024, vocab_size=50257),
    "gpt2-355m": GPTShape(n_layer=24, n_head=16, d_model=1024, max_seq_len=1024, vocab_size=50257),
    "gpt2-774m": GPTShape(n_layer=36, n_head=20, d_model=1280, max_seq_len=1024, vocab_size=50257),
    "gpt2-1.5b": GPTShape(n_layer=48, n_head=25, d_model=1600, max_seq_len=1024, vocab_size=50257),
    # GPT-3 paper shapes (Brown et al. 2020, table 2.1)
    "gpt-2.7b": GPTShape(n_layer=32, n_head=32, d_model=2560, max_seq_len=2048, vocab_size=50257),
    "gpt-6.7b": GPTShape(n_layer=32, n_head=32, d_model=4096, max_seq_len=2048, vocab_size=50257),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def gpt_param_count(shape: GPTShape, vocab_size: int) -> int:
    """Exact parameter count of :func:`build_gpt` for a shape (the head is tied, so it adds only ln_f)."""
    d, L = shape.d_model, shape.n_layer
    embed = vocab_size * d + shape.max_seq_len * d
    layer = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    head = 2 * d
    return embed + L * layer + head
