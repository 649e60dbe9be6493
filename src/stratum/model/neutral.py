"""Training state that is not parameters: RNG streams and module buffers, and the one rule that keeps them.

Every engine must reproduce the plain engine's run, and the plain engine's run draws dropout masks from the
global RNG and moves buffers (BatchNorm's running statistics) only in its training steps. Anything else Stratum
runs — bandwidth and optimizer probes, profiles, shape probes, planners, a recomputed forward — must leave both as
it found them, or the next training step draws other masks and normalises with other statistics. ``neutral`` is
that rule: every such piece of work runs inside it (grep ``neutral(`` for all of them).

Buffers also cross checkpoints: :func:`persistent_buffers` names them canonically (``blocks.<i>.<name>``, the
first occurrence of a shared tensor) so that a state saved under one placement loads under another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import Tensor, nn

from stratum.model.streams import forked


class BufferSnapshot:
    """The buffers of some modules at one moment (their values and which tensor each module held), so they can be
    put back after work that moves them, or set to these values for a replay."""

    def __init__(self, modules: Iterable[nn.Module]):
        self.saved: list[tuple[nn.Module, str, Tensor, Tensor]] = []
        seen: set[int] = set()
        for root in modules:
            for mod in root.modules():
                if id(mod) in seen:
                    continue
                seen.add(id(mod))
                for name, t in mod._buffers.items():
                    if t is not None and t.device.type != "meta":
                        self.saved.append((mod, name, t, t.detach().clone()))

    def restore(self) -> None:
        """Every buffer back to the tensor and the values it had when the snapshot was taken.

        The values are written through ``.data``, which leaves the tensor's version counter alone: a training-mode
        forward saves its buffers for a backward that still lies ahead (BatchNorm saves its running statistics,
        though its backward does not read them), and autograd refuses a saved tensor whose version moved — as the
        plain engine's graph sees them, updated only by the forward's own kernel."""
        with torch.no_grad():
            for mod, name, t, value in self.saved:
                mod._buffers[name] = t  # a forward may have rebound the attribute to a new tensor
                t.data.copy_(value)


def _rng_devices(devices: Iterable[torch.device]) -> list[int]:
    return sorted({torch.device(d).index or 0 for d in devices if torch.device(d).type == "cuda"})


@contextlib.contextmanager
def neutral(*modules: nn.Module, devices: Iterable[torch.device] = ()) -> Iterator[None]:
    """Run the body without touching training state: the CPU RNG and the RNG of every CUDA device in ``devices``
    are forked (restored on exit), and the buffers of ``modules`` are restored on exit to the tensors and values
    they had on entry. Work that only draws random numbers passes no modules."""
    snapshot = BufferSnapshot(modules)
    with forked(_rng_devices(devices)):
        try:
            yield
        finally:
            snapshot.restore()


def all_persistent_buffers(model: nn.Module) -> dict[str, Tensor]:
    """Every persistent buffer of ``model`` (what ``state_dict`` would hold, those on ``meta`` included) by
    canonical name, each shared tensor once under its first name."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for prefix, mod in model.named_modules():
        for name, t in mod._buffers.items():
            if t is None or name in mod._non_persistent_buffers_set or id(t) in seen:
                continue
            seen.add(id(t))
            out[f"{prefix}.{name}" if prefix else name] = t
    return out


def persistent_buffers(model: nn.Module, blocks: Iterable[int] | None = None) -> dict[str, Tensor]:
    """The persistent buffers of a BlockSeq with values here (:func:`all_persistent_buffers` less those on
    ``meta``, another rank's); ``blocks`` restricts them to those blocks' (a pipeline rank's own)."""
    keep = None if blocks is None else tuple(f"blocks.{i}." for i in blocks)
    return {name: t for name, t in all_persistent_buffers(model).items()
            if t.device.type != "meta" and (keep is None or name.startswith(keep))}


def buffers_to_cpu(model: nn.Module, blocks: Iterable[int] | None = None) -> dict[str, Tensor]:
    """:func:`persistent_buffers` copied to the CPU: the ``buffers`` of a TrainState."""
    return {n: t.detach().to("cpu", copy=True) for n, t in persistent_buffers(model, blocks).items()}


def load_buffers(model: nn.Module, values: Mapping[str, Tensor]) -> None:
    """Copy ``values`` (canonical name → tensor) into the model's persistent buffers of those names. A buffer the
    values do not name keeps its own value (a state saved before buffers were saved), and names the model does
    not hold here are skipped (another pipeline rank's)."""
    with torch.no_grad():
        for name, t in persistent_buffers(model).items():
            if name in values:
                t.copy_(values[name])


@contextlib.contextmanager
def evaluating(modules: Iterable[nn.Module]) -> Iterator[None]:
    """``modules`` in eval mode for the block, then every submodule back in the mode it had: an evaluation leaves
    the modes a caller chose (a frozen BatchNorm in eval mode inside a training model) as they were, so training
    never sets a mode of its own."""
    before = [(m, m.training) for top in modules for m in top.modules()]
    for m, _ in before:
        m.training = False
    try:
        yield
    finally:
        for m, mode in before:
            m.training = mode
