"""Stratum's own GPT: a pre-LN causal transformer with a weight-tied head, as a ``BlockSeq``.

Blocks: ``embed`` (token + position embedding), ``layer.0 … layer.{L-1}`` (attention + MLP), ``head`` (final
LayerNorm + projection with the embedding's weight). Each block is initialised from its own generator seeded
by (seed, block index), so any process can build any block by itself and get the same weights: the pipeline
and offload engines rely on this to materialise only the blocks they hold.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq, ModelInfo, block_seed, lm_cross_entropy
from stratum.model.presets import PRESETS


class Embed(nn.Module):
    def __init__(self, vocab_size: int, max_seq_len: int, d_model: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_seq_len, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))


class Layer(nn.Module):
    """Pre-LN transformer layer: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        # widths come from the projections, not from x: under split(n) this rank's qkv holds n_head / n heads
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=2)
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, -1)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))


class Head(nn.Module):
    """Final LayerNorm and the output projection, sharing the token embedding's weight."""

    def __init__(self, d_model: int, tied_weight: nn.Parameter):
        super().__init__()
        self.ln_f = nn.LayerNorm(d_model)
        self.weight = tied_weight

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.ln_f(x), self.weight)


def init_gpt_block(seq: BlockSeq, i: int, seed: int) -> None:
    """(Re)initialise block ``i`` of a GPT BlockSeq from (seed, i) alone (GPT-2 scheme: N(0, 0.02) weights,
    residual projections scaled by 1/sqrt(2L), zero biases, LayerNorm (1, 0)). The head's tied weight is a
    bare parameter, left to the embedding block that owns it."""
    gen = torch.Generator().manual_seed(block_seed(seed, i))
    resid_std = 0.02 / math.sqrt(2 * seq.info.n_layer)
    with torch.no_grad():
        for name, m in seq.blocks[i].named_modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.fill_(1.0)
                m.bias.zero_()
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                std = resid_std if name in ("proj", "fc_out") else 0.02
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * std)
                bias = getattr(m, "bias", None)
                if bias is not None:
                    bias.zero_()


def build_gpt(preset: str, *, vocab_size: int | None, seed: int, dropout: float = 0.0,
              device: torch.device | str = "cpu", max_seq_len: int | None = None) -> BlockSeq:
    """Build a GPT preset as a BlockSeq.

    ``vocab_size`` None takes the preset's; a preset without one needs it given. On the ``meta`` device no
    memory is allocated and no initialisation runs (the profiler and offload engine materialise blocks later).
    """
    if preset not in PRESETS:
        raise StratumError(f"unknown GPT preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    shape = PRESETS[preset]
    vocab = vocab_size or shape.vocab_size
    if not vocab:
        raise StratumError(f"preset {preset!r} takes its vocabulary from the tokenizer; give model.vocab_size")
    if shape.d_model % shape.n_head:
        raise AssertionError("preset with d_model not divisible by n_head")
    ctx = max_seq_len or shape.max_seq_len
    with torch.device(device):
        embed = Embed(vocab, ctx, shape.d_model, dropout)
        blocks: list[nn.Module] = [embed]
        blocks += [Layer(shape.d_model, shape.n_head, dropout) for _ in range(shape.n_layer)]
        blocks.append(Head(shape.d_model, cast(nn.Parameter, embed.tok.weight)))
    names = ["embed"] + [f"layer.{i}" for i in range(shape.n_layer)] + ["head"]
    info = ModelInfo(name=preset, vocab_size=vocab, max_seq_len=ctx, n_layer=shape.n_layer,
                     d_model=shape.d_model,
                     extra={"source": "gpt", "n_head": shape.n_head, "dropout": dropout})
    seq = BlockSeq(blocks, lm_cross_entropy, info, names)
    if torch.device(device).type != "meta":
        for i in range(len(seq)):
            init_gpt_block(seq, i, seed)
    return seq
