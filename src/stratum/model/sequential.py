"""Any ``nn.Sequential`` as a ``BlockSeq``: each child is one block.

A config names a factory ``"package.module:function"`` that is called as ``factory(vocab_size=V,
seq_len=T)`` and returns one of:

* an ``nn.Sequential`` mapping token ids (B, T) to logits (B, T, V); children that share a parameter object
  become a tied group automatically. It is built whole, in RAM.
* a list of zero-argument block constructors, one per block (:func:`from_block_builders`): each block is built
  under a seed of its own, so the offload engine can build a model larger than RAM one block at a time, with
  the values an eager build gives (a factory's own initialisation code cannot be replayed per block any other
  way). Blocks built this way cannot share parameters.
* a ready ``BlockSeq``.
"""

from __future__ import annotations

import importlib
import inspect
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq, LossFn, ModelInfo, block_seed, lm_cross_entropy, parameters_on_meta
from stratum.model.neutral import evaluating, neutral


def from_sequential(model: nn.Sequential, *, name: str = "sequential", loss_fn: LossFn = lm_cross_entropy,
                    vocab_size: int = 0, max_seq_len: int = 0) -> BlockSeq:
    """Wrap an ``nn.Sequential`` (children become blocks, in order) with a loss."""
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise StratumError(f"{name}: expected a non-empty nn.Sequential, got {type(model).__name__}")
    children = _positions(model)
    info = ModelInfo(name=name, vocab_size=vocab_size, max_seq_len=max_seq_len,
                     extra={"source": "sequential", "factory": name})
    names = [f"{n}:{type(m.inner if isinstance(m, _Again) else m).__name__}" for n, m in children]
    for i, (_, m) in enumerate(children[:-1]):  # (the last one's output goes to the loss, which takes anything)
        if (earlier := _CHECKS.pop(m, None)) is not None:  # one check per module, however often it is wrapped
            earlier.remove()
        _CHECKS[m] = m.register_forward_hook(_one_tensor(i, names[i]))
    return BlockSeq([m for _, m in children], loss_fn, info, names)


_CHECKS: weakref.WeakKeyDictionary[nn.Module, RemovableHandle] = weakref.WeakKeyDictionary()
"""The one-tensor check each wrapped module carries (a caller's module wrapped again gets it once)."""


class _Again(nn.Module):
    """A module that an ``nn.Sequential`` runs at more than one position, at a later one: a block of its own (the
    engines keep per-block hooks and state) whose parameters are the first position's, so they become a tied
    group like any parameter two blocks share."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _positions(model: nn.Sequential) -> list[tuple[str, nn.Module]]:
    """Every position of ``model`` with its module, in order — a module placed twice at both (its own
    ``named_children`` lists a module once)."""
    seen: set[int] = set()
    out = []
    for name, m in model._modules.items():
        if m is None:
            raise StratumError(f"the nn.Sequential's child {name!r} is None; remove it")
        out.append((name, _Again(m) if id(m) in seen else m))
        seen.add(id(m))
    return out


def _one_tensor(i: int, name: str):
    """A forward hook refusing a block output that is not one tensor: every engine hands one tensor from a
    block to the next (a pipeline sends it between processes), so a tuple fails there with an error of its own."""
    def check(module: nn.Module, args, out) -> None:
        if not isinstance(out, torch.Tensor):
            raise StratumError(f"block {i} ({name}) returned a {type(out).__name__}; the blocks of an nn.Sequential "
                               "pass one tensor each to the next: return one (keep masks and the like inside the "
                               "blocks that use them)")
    return check


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


def example_lm_blocks(*, vocab_size: int, seq_len: int, d_model: int = 128,
                      n_layer: int = 2) -> list[Callable[[], nn.Module]]:
    """The built-in sequential example as one constructor per block (a factory a lazy build can use)."""
    def mix():
        return _Residual(nn.Sequential(nn.LayerNorm(d_model), _CausalMix(d_model)))

    def mlp():
        return _Residual(nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                       nn.Linear(4 * d_model, d_model)))
    return ([lambda: nn.Embedding(vocab_size, d_model)] + [mix, mlp] * n_layer
            + [lambda: nn.LayerNorm(d_model), lambda: nn.Linear(d_model, vocab_size)])


def example_lm(*, vocab_size: int, seq_len: int, d_model: int = 128, n_layer: int = 2) -> nn.Sequential:
    """A small causal language model written as a plain ``nn.Sequential`` (the built-in sequential example)."""
    return nn.Sequential(*(make() for make in example_lm_blocks(vocab_size=vocab_size, seq_len=seq_len,
                                                                d_model=d_model, n_layer=n_layer)))


class _TokenBatchNorm(nn.BatchNorm1d):
    """BatchNorm1d over the channels of (B, T, C) activations, statistics over batch and positions."""

    def forward(self, x):
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


def batchnorm_lm_blocks(*, vocab_size: int, seq_len: int, d_model: int = 64, n_layer: int = 4,
                        dropout: float = 0.0) -> list[Callable[[], nn.Module]]:
    """A small language model whose blocks carry buffers (BatchNorm's running mean, variance and batch count) and,
    with ``dropout`` > 0, draw from the RNG: what engines must keep exactly as the plain engine does. Its batch
    statistics mix positions, so it is not causal: a test model, not one to train for text. BatchNorm sits only
    inside the residual branches: a final one would cancel every per-channel shift of the residual stream, leave
    the biases feeding it a gradient of rounding noise, and AdamW would turn that noise into full-size steps."""
    def mix():
        return _Residual(nn.Sequential(_TokenBatchNorm(d_model), _CausalMix(d_model)))

    def mlp():
        return _Residual(nn.Sequential(_TokenBatchNorm(d_model), nn.Linear(d_model, 2 * d_model), nn.GELU(),
                                       nn.Dropout(dropout), nn.Linear(2 * d_model, d_model)))
    return ([lambda: nn.Embedding(vocab_size, d_model)] + [mix, mlp] * n_layer
            + [lambda: nn.LayerNorm(d_model), lambda: nn.Linear(d_model, vocab_size)])


def from_block_builders(builders: Sequence[Callable[[], nn.Module]], *, seed: int, lazy: bool = False,
                        device: torch.device | str = "cpu", name: str = "sequential",
                        loss_fn: LossFn = lm_cross_entropy, vocab_size: int = 0, max_seq_len: int = 0) -> BlockSeq:
    """A BlockSeq from one zero-argument constructor per block, block ``i`` built under the seed (seed, i) with
    the caller's RNG state left as it was. ``lazy``: parameters stay on the meta device and ``seq.materialize(i)``
    builds block ``i`` for real and copies its values in (one block in RAM at a time); otherwise every block is
    built now, on ``device``, with the same values. ``device='meta'``: the structure only."""
    if any(isinstance(b, nn.Module) for b in builders):
        raise StratumError(f"{name} returned a list of modules; return them as an nn.Sequential, or return one "
                           "zero-argument constructor per block (e.g. lambda: nn.Linear(8, 8))")
    if not builders or not all(callable(b) for b in builders):
        raise StratumError(f"{name}: expected a non-empty list of zero-argument block constructors")

    def make(i: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(block_seed(seed, i))
            try:
                block = builders[i]()
            except Exception as e:  # the user's code: one line, as for the factory itself
                raise StratumError(f"{name}: block constructor {i} raised {type(e).__name__}: "
                                   f"{_first_line(e)}") from None
        if not isinstance(block, nn.Module):
            raise StratumError(f"{name}: block constructor {i} returned {type(block).__name__}, expected an "
                               "nn.Module")
        return block

    with parameters_on_meta(), torch.device("cpu"):
        blocks = [make(i) for i in range(len(builders))]
    ids = [id(p) for b in blocks for p in b.parameters()]
    if len(ids) != len(set(ids)):
        raise StratumError(f"{name}: block constructors must not share parameters (return an nn.Sequential to "
                           "tie them)")
    info = ModelInfo(name=name, vocab_size=vocab_size, max_seq_len=max_seq_len,
                     extra={"source": "sequential", "factory": name})
    seq = BlockSeq(blocks, loss_fn, info, [f"{i}:{type(b).__name__}" for i, b in enumerate(blocks)])

    def block_init(seq: BlockSeq, i: int) -> None:
        with torch.device("cpu"):
            real = make(i)
        with torch.no_grad():
            for (_, p), (_, v) in zip(seq.blocks[i].named_parameters(), real.named_parameters()):
                p.copy_(v)
            for (_, b), (_, rb) in zip(seq.blocks[i].named_buffers(), real.named_buffers()):
                b.copy_(rb)  # a buffer drawn at random follows the real build's draws, not the structure's
    seq.block_init = block_init
    dev = torch.device(device)
    if not lazy and dev.type != "meta":
        for i in range(len(seq)):
            seq.allocate(i, dev)
            seq.materialize(i)
            seq.blocks[i].to(dev)  # buffers
    if not lazy or dev.type == "meta":
        seq.block_init = None
    return seq


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


def build_sequential(factory: str, *, vocab_size: int, seq_len: int, seed: int = 0, lazy: bool = False,
                     device: torch.device | str = "cpu") -> BlockSeq:
    """Call a factory and wrap what it returns (see the module docstring); ``lazy`` applies to a list of block
    constructors, the one form that can be built block by block."""
    fn = load_factory(factory)
    try:
        inspect.signature(fn).bind(vocab_size=vocab_size, seq_len=seq_len)
    except TypeError:
        raise StratumError(f"model.factory {factory!r} must accept keyword arguments vocab_size and seq_len") from None
    except ValueError:
        pass  # builtins without a signature: let the call decide
    try:
        made = fn(vocab_size=vocab_size, seq_len=seq_len)
    except Exception as e:  # the user's code: its failure is bad input to this run, said in one line
        raise StratumError(f"model.factory {factory!r} raised {type(e).__name__}: {_first_line(e)}") from None
    if isinstance(made, (list, tuple)):
        seq = from_block_builders(made, seed=seed, lazy=lazy, device=device, name=factory,
                                  vocab_size=vocab_size, max_seq_len=seq_len)
    elif isinstance(made, BlockSeq):
        seq = made
    elif isinstance(made, nn.Sequential):
        seq = from_sequential(made, name=factory, vocab_size=vocab_size, max_seq_len=seq_len)
    else:
        raise StratumError(f"model.factory {factory!r} returned {type(made).__name__}, "
                           "expected an nn.Sequential, a list of block constructors or a BlockSeq")
    if not lazy:
        check_lm_output(seq, factory, vocab_size)
    return seq


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else "(no message)"


def check_lm_output(seq: BlockSeq, factory: str, vocab_size: int) -> None:
    """The factory's model maps token ids (B, T) to logits (B, T, vocab_size), as next-token training needs; one
    line naming what it does instead. Checked on two tokens, in eval mode, leaving RNG and buffers as they were.
    Built on ``meta`` (a plan's dry build), only the shapes are computed, and a forward that fails there says
    nothing: a tensor the model makes on the CPU meets the meta ones, which the real build does not."""
    device = next((p.device for p in seq.parameters()), torch.device("cpu"))
    x = torch.zeros(1, 2, dtype=torch.long, device=device)
    try:
        with torch.no_grad(), neutral(seq), evaluating([seq]):
            out = seq(x)
    except StratumError:
        raise
    except Exception as e:  # the user's model, on the input every run gives it
        if device.type == "meta":
            return
        raise StratumError(f"model.factory {factory!r}: its model fails on token ids of shape (1, 2) "
                           f"({type(e).__name__}: {_first_line(e)}); it must map (batch, tokens) ids to "
                           f"(batch, tokens, {vocab_size}) logits") from None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, 2, vocab_size):
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
        raise StratumError(f"model.factory {factory!r}: its model maps token ids of shape (1, 2) to {got}, not "
                           f"the logits (1, 2, {vocab_size}) next-token training needs (the vocabulary is "
                           f"{vocab_size}: model.vocab_size, or the tokenizer's)")
