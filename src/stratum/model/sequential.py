"""Any ``nn.Sequential`` as a ``BlockSeq``: each child is one block.

A config names a factory ``"package.module:function"`` that is called as ``factory(vocab_size=V,
seq_len=T)`` and returns an ``nn.Sequential`` (or a ready ``BlockSeq``) mapping token ids (B, T) to logits
(B, T, V). Children that share a parameter object become a tied group automatically.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

from torch import nn

from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq, LossFn, ModelInfo, lm_cross_entropy


def from_sequential(model: nn.Sequential, *, name: str = "sequential", loss_fn: LossFn = lm_cross_entropy,
                    vocab_size: int = 0, max_seq_len: int = 0) -> BlockSeq:
    """Wrap an ``nn.Sequential`` (children become blocks, in order) with a loss."""
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise StratumError(f"{name}: expected a non-empty nn.Sequential, got {type(model).__name__}")
    children = list(model.named_children())
    info = ModelInfo(name=name, vocab_size=vocab_size, max_seq_len=max_seq_len,
                     extra={"source": "sequential", "factory": name})
    return BlockSeq([m for _, m in children], loss_fn, info, [f"{n}:{type(m).__name__}" for n, m in children])


class _Residual(nn.Module):
    """x + f(x): lets a plain Sequential stack deep blocks without losing the signal."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)


class _CausalMix(nn.Module):
    """Mixes each position with the previous ``width`` ones (a causal depthwise convolution)."""

    def __init__(self, d_model: int, width: int = 4):
        super().__init__()
        self.width = width
        self.conv = nn.Conv1d(d_model, d_model, width, groups=d_model)

    def forward(self, x):
        y = nn.functional.pad(x.transpose(1, 2), (self.width - 1, 0))
        return self.conv(y).transpose(1, 2)


def example_lm(*, vocab_size: int, seq_len: int, d_model: int = 128, n_layer: int = 2) -> nn.Sequential:
    """A small causal language model written as a plain ``nn.Sequential`` (the built-in sequential example)."""
    layers: list[nn.Module] = [nn.Embedding(vocab_size, d_model)]
    for _ in range(n_layer):
        layers.append(_Residual(nn.Sequential(nn.LayerNorm(d_model), _CausalMix(d_model))))
        layers.append(_Residual(nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 4 * d_model),
                                              nn.GELU(), nn.Linear(4 * d_model, d_model))))
    layers += [nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size)]
    return nn.Sequential(*layers)


def load_factory(spec: str) -> Callable[..., object]:
    """Import ``"package.module:function"``; a clear error if it cannot be found."""
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise StratumError(f"model.factory {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise StratumError(f"model.factory: cannot import {mod_name!r} ({e}); is it on PYTHONPATH?") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise StratumError(f"model.factory: {mod_name!r} has no callable {fn_name!r}")
    return fn


def build_sequential(factory: str, *, vocab_size: int, seq_len: int) -> BlockSeq:
    """Call a factory and wrap what it returns."""
    fn = load_factory(factory)
    try:
        inspect.signature(fn).bind(vocab_size=vocab_size, seq_len=seq_len)
    except TypeError:
        raise StratumError(f"model.factory {factory!r} must accept keyword arguments vocab_size and seq_len")
    except ValueError:
        pass  # builtins without a signature: let the call decide
    made = fn(vocab_size=vocab_size, seq_len=seq_len)
    if isinstance(made, BlockSeq):
        return made
    if not isinstance(made, nn.Sequential):
        raise StratumError(f"model.factory {factory!r} returned {type(made).__name__}, "
                           "expected an nn.Sequential or a BlockSeq")
    return from_sequential(made, name=factory, vocab_size=vocab_size, max_seq_len=seq_len)
