"""Materialising some blocks of a model: a lazily built model's stage blocks get the whole model's values one
block at a time (stage_block_init), a tied tensor's included, and nothing outside them stays in memory."""

from __future__ import annotations

import pytest
import torch

from stratum.config import ModelConfig
from stratum.model.build import build_model
from stratum.model.placement import localize, stage_block_init


@pytest.mark.parametrize("mine", [[0, 1], [3, 4, 5], [5]])
def test_a_lazy_stage_gets_the_eager_values_block_by_block(mine):
    eager = dict(build_model(ModelConfig(preset="mini"), tokenizer_vocab=256, seq_len=32, seed=7).named_parameters())
    whole = build_model(ModelConfig(preset="mini"), tokenizer_vocab=256, seq_len=32, seed=7, lazy=True)
    assert len(whole) == 6 and whole.tied  # embedding, 4 layers, a head tied to the embedding
    localize(whole, set(mine), torch.device("cpu"))  # a lazy rank's blocks stay on meta
    assert all(p.is_meta for p in whole.parameters())
    alias = {n: g.owner for g in whole.tied for n in g.names}  # the head's weight is the embedding's
    sub = whole.part(mine)
    sub.block_init = stage_block_init(whole, mine)
    for k, g in enumerate(mine):
        sub.allocate(k)
        sub.materialize(k)
        for name, p in whole.blocks[g].named_parameters(remove_duplicate=False):
            full = f"blocks.{g}.{name}"
            torch.testing.assert_close(p, eager[alias.get(full, full)], rtol=0, atol=0, msg=full)
        # only the blocks materialised so far hold memory: the head's tie initialised the embedding for the
        # moment, whose other tensors went back to meta
        held = {id(p) for j in mine[:k + 1] for p in whole.blocks[j].parameters()}
        assert all(p.is_meta for p in whole.parameters() if id(p) not in held)


def test_a_model_built_eagerly_has_no_stage_initialiser():
    whole = build_model(ModelConfig(preset="tiny"), tokenizer_vocab=256, seq_len=32, seed=7)
    with pytest.raises(ValueError, match="not built lazily"):
        stage_block_init(whole, [0])
