"""Materialising only some blocks of a model: the blocks a rank holds, the rest left on ``meta`` (no memory).

A pipeline rank holds its stages' blocks; every other rank's blocks stay on ``meta``. Own GPT blocks are
initialised from (seed, block index) alone, so a rank builds only its own; other sources are built whole with the
seed and then the blocks this rank does not hold are dropped to ``meta``. Either way every rank's blocks hold the
values the whole model would hold under the same seed. Under the memory engine a rank's blocks stay on ``meta``
too, each given its values when the engine packs it (:func:`stage_block_init`), so no rank ever holds its stages
whole in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from stratum.config import ModelConfig
from stratum.model.blockseq import BlockSeq
from stratum.model.build import build_model
from stratum.model.gpt import init_gpt_block


def replace_tensors(model: nn.Module, make: Callable[[nn.Parameter | torch.Tensor, bool], torch.Tensor | None]
                    ) -> None:
    """Swap every parameter/buffer ``t`` for ``make(t, is_param)`` (None keeps it), the same object for all
    occurrences of one tensor so ties survive."""
    memo: dict[int, torch.Tensor] = {}
    keep_alive = []
    for mod in model.modules():
        # (a swapped-in parameter may be a plain tensor, which _parameters' annotation refuses)
        stores: tuple[tuple[dict[str, Any], bool], ...] = ((mod._parameters, True), (mod._buffers, False))
        for store, is_param in stores:
            for name, t in list(store.items()):
                if t is None:
                    continue
                if id(t) not in memo:
                    keep_alive.append(t)
                    new = make(t, is_param)
                    memo[id(t)] = t if new is None else new
                store[name] = memo[id(t)]


def param_like(t: torch.Tensor, data: torch.Tensor, is_param: bool) -> torch.Tensor:
    """``data`` in ``t``'s role: a Parameter with ``t``'s requires_grad where ``t`` is one, else the tensor."""
    return nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data


def localize(model: BlockSeq, keep: set[int], device: torch.device) -> BlockSeq:
    """Keep blocks ``keep`` on ``device`` and move every tensor used only by other blocks to ``meta`` (freed)."""
    keep_ids = {id(t) for i in keep for t in [*model.blocks[i].parameters(), *model.blocks[i].buffers()]}

    def make(t, is_param):
        if id(t) in keep_ids:
            if t.device == device or t.is_meta:  # a lazily built block: its engine gives it storage later
                return None
            return param_like(t, t.detach().to(device), is_param)
        return on_meta(t, is_param)

    with torch.no_grad():
        replace_tensors(model, make)
    return model


def on_meta(t: torch.Tensor, is_param: bool) -> torch.Tensor | None:
    """``t`` moved to ``meta`` (its memory freed), for :func:`replace_tensors`; None where it is there already."""
    return None if t.is_meta else param_like(t, torch.empty_like(t, device="meta"), is_param)


def drop_to_meta(module: nn.Module, keep: frozenset[int] = frozenset()) -> None:
    """Every tensor of ``module`` back to ``meta`` but those whose ``id`` is in ``keep`` (shared with blocks that
    stay)."""
    with torch.no_grad():
        replace_tensors(module, lambda t, is_param: None if id(t) in keep else on_meta(t, is_param))


def materialize_gpt(model: BlockSeq, keep: set[int], seed: int, device: torch.device) -> BlockSeq:
    """A GPT built on ``meta``: allocate and initialise blocks ``keep`` (from (seed, i) alone) on ``device``.

    The owner block of a tied parameter a kept block uses is initialised too (that is where the tensor's values
    come from), then everything not kept goes back to ``meta``.
    """
    owner_block = {}
    for g in model.tied:
        blocks = {int(n.split(".")[1]) for n in g.names}
        if blocks & keep:
            owner_block[int(g.owner.split(".")[1])] = True
    init = set(keep) | set(owner_block)
    ids = {id(t) for i in init for t in [*model.blocks[i].parameters(), *model.blocks[i].buffers()]}

    def make(t, is_param):
        if id(t) in ids and t.device.type == "meta":
            return param_like(t, torch.empty(t.shape, dtype=t.dtype), is_param)
        return None

    with torch.no_grad():
        replace_tensors(model, make)
    for i in sorted(init):
        init_gpt_block(model, i, seed)
    return localize(model, keep, device)


def build_blocks(cfg: ModelConfig, keep: set[int], *, tokenizer_vocab: int, seq_len: int, seed: int,
                 device: torch.device) -> BlockSeq:
    """The model with only blocks ``keep`` materialised on ``device`` (values as in the whole model)."""
    meta = build_model(cfg, tokenizer_vocab=tokenizer_vocab, seq_len=seq_len, seed=seed, device="meta")
    if cfg.source == "gpt":
        return materialize_gpt(meta, keep, seed, device)
    del meta
    full = build_model(cfg, tokenizer_vocab=tokenizer_vocab, seq_len=seq_len, seed=seed)
    return localize(full, keep, device)


def stage_block_init(whole: BlockSeq, mine: list[int]) -> Callable[[BlockSeq, int], None]:
    """The ``block_init`` of a lazily built model's blocks ``mine`` as a BlockSeq of their own (its block k is
    ``whole``'s block ``mine[k]``): block k's values from ``whole``'s initialiser. A tensor block k shares with a
    block outside ``mine`` (the GPT head's weight, tied to the embedding) takes its values from that owner block,
    initialised for the moment and then dropped back to ``meta`` but for the shared tensor."""
    init = whole.block_init
    if init is None:
        raise ValueError("the model was not built lazily: it has no block initialiser")
    held = set(mine)
    owners: dict[int, set[int]] = {}  # a held block → the blocks outside ``mine`` owning a tensor it uses
    for g in whole.tied:
        owner = int(g.owner.split(".")[1])
        if owner not in held:
            for b in {int(n.split(".")[1]) for n in g.names} & held:
                owners.setdefault(b, set()).add(owner)

    def block_init(_sub: BlockSeq, k: int) -> None:
        g = mine[k]
        init(whole, g)
        shared = frozenset(id(t) for t in whole.blocks[g].parameters())
        for o in sorted(owners.get(g, ())):
            whole.allocate(o)
            init(whole, o)
            drop_to_meta(whole.blocks[o], shared)
    return block_init
