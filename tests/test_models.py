"""Every model source builds a BlockSeq with explicit ties and trains with decreasing loss."""

import sys

import pytest
import torch
from torch import nn

from stratum.config import ModelConfig
from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq, ModelInfo, lm_cross_entropy
from stratum.model.build import build_model
from stratum.model.gpt import build_gpt, init_gpt_block
from stratum.model.presets import PRESETS, gpt_param_count
from stratum.model.sequential import build_sequential, from_block_builders, from_sequential


def _train_losses(seq: BlockSeq, steps: int = 12, lr: float = 3e-3) -> list[float]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, seq.info.vocab_size, (4, 32), generator=gen)
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(seq.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = seq.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("preset", list(PRESETS))
def test_gpt_presets_have_the_analytic_parameter_count(preset):
    seq = build_gpt(preset, vocab_size=None if PRESETS[preset].vocab_size else 256, seed=0, device="meta")
    shape = PRESETS[preset]
    assert seq.num_params() == gpt_param_count(shape, seq.info.vocab_size)
    assert len(seq) == shape.n_layer + 2
    assert [list(g.names) for g in seq.tied] == [["blocks.0.tok.weight", f"blocks.{len(seq) - 1}.weight"]]


def test_gpt2_family_sizes_are_the_published_ones():
    sizes = {p: gpt_param_count(PRESETS[p], 50257) / 1e6 for p in ("gpt2-124m", "gpt2-355m", "gpt2-774m",
                                                                   "gpt2-1.5b", "gpt-2.7b", "gpt-6.7b")}
    assert round(sizes["gpt2-124m"]) == 124 and round(sizes["gpt2-355m"]) == 355
    assert round(sizes["gpt2-774m"]) == 774 and 1500 < sizes["gpt2-1.5b"] < 1600
    assert 2600 < sizes["gpt-2.7b"] < 2800 and 6500 < sizes["gpt-6.7b"] < 6900


def test_gpt_trains_and_tied_weight_gets_both_gradients():
    seq = build_gpt("tiny", vocab_size=256, seed=1)
    assert seq.blocks[0].tok.weight is seq.blocks[-1].weight
    losses = _train_losses(seq)
    assert losses[-1] < losses[0] - 0.3


def test_gpt_blocks_initialise_from_seed_and_index_alone():
    a = build_gpt("tiny", vocab_size=256, seed=5)
    b = build_gpt("tiny", vocab_size=256, seed=5)
    c = build_gpt("tiny", vocab_size=256, seed=6)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
        if p.ndim == 2:
            assert not torch.equal(p, r), n
    # a block materialised on its own gets the same values as in the full build
    meta = build_gpt("tiny", vocab_size=256, seed=5, device="meta")
    meta.blocks[1].to_empty(device="cpu")
    init_gpt_block(meta, 1, seed=5)
    for (n, p), (_, q) in zip(meta.blocks[1].named_parameters(), a.blocks[1].named_parameters()):
        assert torch.equal(p, q), n


def test_gpt_is_causal():
    seq = build_gpt("tiny", vocab_size=256, seed=0).eval()
    x = torch.randint(0, 256, (1, 16))
    x2 = x.clone()
    x2[0, 10] = (x2[0, 10] + 1) % 256
    with torch.no_grad():
        a, b = seq(x), seq(x2)
    assert torch.equal(a[0, :10], b[0, :10]) and not torch.equal(a[0, 10:], b[0, 10:])


def test_unknown_preset():
    with pytest.raises(StratumError, match="unknown GPT preset"):
        build_gpt("gpt-9", vocab_size=256, seed=0)


def test_sequential_source_trains():
    seq = build_sequential("stratum.model.sequential:example_lm", vocab_size=256, seq_len=32)
    assert len(seq) == 7 and seq.info.extra["source"] == "sequential"
    losses = _train_losses(seq)
    assert losses[-1] < losses[0] - 0.3


def test_sequential_shared_parameters_become_a_tied_group():
    emb = nn.Embedding(64, 16)
    head = nn.Linear(16, 64, bias=False)
    head.weight = emb.weight
    seq = from_sequential(nn.Sequential(emb, nn.Linear(16, 16), head), vocab_size=64)
    assert [g.names for g in seq.tied] == [("blocks.0.weight", "blocks.2.weight")]
    assert seq.block_param_names(2) == ["blocks.0.weight"]
    assert [n for n, _ in seq.owned_parameters(2)] == []
    assert seq.num_params() == 64 * 16 + 16 * 16 + 16


def test_block_constructors_build_the_same_values_lazily_and_eagerly():
    """A factory returning one constructor per block: the lazy build holds no parameter memory, and building
    its blocks one at a time, in any order, gives the eager build's values; the seed decides them and the
    caller's RNG is left alone."""
    spec = "stratum.model.sequential:example_lm_blocks"
    eager = build_sequential(spec, vocab_size=256, seq_len=32, seed=3)
    lazy = build_sequential(spec, vocab_size=256, seq_len=32, seed=3, lazy=True)
    assert len(lazy) == len(eager) == 7 and not eager.tied and eager.block_init is None
    assert lazy.block_init is not None and all(p.is_meta for p in lazy.parameters())
    state = torch.random.get_rng_state()
    for i in reversed(range(len(lazy))):
        lazy.allocate(i)
        lazy.materialize(i)
    assert torch.equal(torch.random.get_rng_state(), state)
    got, want = dict(lazy.named_parameters()), dict(eager.named_parameters())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    other = build_sequential(spec, vocab_size=256, seq_len=32, seed=4)
    assert not torch.equal(other.blocks[1].inner[1].conv.weight, eager.blocks[1].inner[1].conv.weight)
    assert _train_losses(eager)[-1] < _train_losses(build_sequential(spec, vocab_size=256, seq_len=32,
                                                                     seed=3))[0] - 0.3


def test_build_model_builds_block_constructors_lazily_only_when_asked():
    """The trainer's route (build_model with lazy=True for the offload engine): a block-constructor factory gets
    meta parameters and a block initialiser; an nn.Sequential factory is built whole either way."""
    from stratum.config import ModelConfig
    from stratum.model.build import build_model
    blocks = ModelConfig(source="sequential", factory="stratum.model.sequential:example_lm_blocks")
    lazy = build_model(blocks, tokenizer_vocab=256, seq_len=32, seed=1, lazy=True)
    assert lazy.block_init is not None and all(p.is_meta for p in lazy.parameters())
    eager = build_model(blocks, tokenizer_vocab=256, seq_len=32, seed=1)
    assert eager.block_init is None and not any(p.is_meta for p in eager.parameters())
    whole = build_model(ModelConfig(source="sequential"), tokenizer_vocab=256, seq_len=32, seed=1, lazy=True)
    assert whole.block_init is None and not any(p.is_meta for p in whole.parameters())


@pytest.mark.parametrize("builders, message", [
    ([], "non-empty list"),
    ([lambda: nn.Linear(2, 2), "not callable"], "non-empty list"),
    ([lambda: nn.Linear(2, 2), lambda: 3], "constructor 1 returned int"),
])
def test_bad_block_constructors(builders, message):
    with pytest.raises(StratumError, match=message):
        from_block_builders(builders, seed=0)


def test_block_constructors_cannot_share_parameters():
    shared = nn.Linear(4, 4)
    with pytest.raises(StratumError, match="must not share parameters"):
        from_block_builders([lambda: shared, lambda: shared], seed=0)


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "must look like"),
    ("not_a_module_xyz:f", "cannot import"),
    ("stratum.model.sequential:nope", "has no callable"),
    ("stratum.model.presets:preset_names", "must accept keyword arguments vocab_size and seq_len"),
    ("builtins:dict", "returned dict"),
])
def test_bad_factories(spec, message):
    with pytest.raises(StratumError, match=message):
        build_sequential(spec, vocab_size=256, seq_len=32)


def test_blockseq_rejects_empty_and_misnamed():
    with pytest.raises(ValueError):
        BlockSeq([], lm_cross_entropy, ModelInfo(name="x"))
    with pytest.raises(ValueError):
        BlockSeq([nn.Linear(2, 2)], lm_cross_entropy, ModelInfo(name="x"), ["a", "b"])


def test_a_sequential_block_returning_a_tuple_is_a_one_line_error():
    class Pair(nn.Module):
        def forward(self, x):
            return x, x

    seq = from_sequential(nn.Sequential(nn.Embedding(16, 8), Pair(), nn.Linear(8, 16)))
    with pytest.raises(StratumError, match=r"^block 1 \(1:Pair\) returned a tuple; the blocks of an nn.Sequential "
                                           r"pass one tensor each"):
        seq(torch.zeros(2, 4, dtype=torch.long))


def _factory_module(tmp_path, monkeypatch, body: str) -> None:
    (tmp_path / "user_factories.py").write_text("import torch\nfrom torch import nn\n\n\n" + body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_factories", raising=False)  # (each case's own module)


@pytest.mark.parametrize("body, message", [
    ("def lm(*, vocab_size, seq_len):\n    raise RuntimeError('boom\\nmore')\n",
     r"^model.factory 'user_factories:lm' raised RuntimeError: boom$"),
    ("def lm(*, vocab_size, seq_len):\n    return nn.Sequential(nn.Embedding(vocab_size, 8), nn.Linear(8, 7))\n",
     r"^model.factory 'user_factories:lm': its model maps token ids of shape \(1, 2\) to shape \(1, 2, 7\), not "
     r"the logits \(1, 2, 64\)"),
    ("def lm(*, vocab_size, seq_len):\n    return (nn.Embedding(vocab_size, 8), nn.Linear(8, vocab_size))\n",
     r"^user_factories:lm returned a list of modules; return them as an nn.Sequential"),
    ("def lm(*, vocab_size, seq_len):\n    return [lambda: nn.Embedding(vocab_size, 8), lambda: 1 / 0]\n",
     r"block constructor 1 raised ZeroDivisionError: division by zero$"),
    ("def lm(*, vocab_size, seq_len):\n    return nn.Sequential(nn.Linear(8, vocab_size))\n",
     r"^model.factory 'user_factories:lm': its model fails on token ids of shape \(1, 2\) \(RuntimeError: "),
])
def test_a_factory_that_fails_or_maps_to_other_shapes_is_one_line(tmp_path, monkeypatch, body, message):
    """The user's factory and model are bad input: what they raise, or the shape they give instead of the
    logits, is one line before any training (`stratum train` printed their traceback at the first step)."""
    _factory_module(tmp_path, monkeypatch, body)
    with pytest.raises(StratumError, match=message) as e:
        build_model(ModelConfig(source="sequential", factory="user_factories:lm"), tokenizer_vocab=64, seq_len=8,
                    seed=0)
    assert "\n" not in str(e.value)


def test_the_check_of_a_factory_model_leaves_its_statistics_and_modes():
    seq = build_model(ModelConfig(source="sequential", factory="stratum.model.sequential:batchnorm_lm_blocks"),
                      tokenizer_vocab=64, seq_len=8, seed=0)
    assert seq.training and all(m.training for m in seq.modules())
    for m in seq.modules():
        if isinstance(m, torch.nn.BatchNorm1d):
            assert torch.equal(m.running_mean, torch.zeros_like(m.running_mean))
            assert int(m.num_batches_tracked) == 0


def test_a_module_wrapped_again_carries_one_check():
    """Each wrap (a parallelize, a rebuild) checks a block's output once: the hooks do not pile up."""
    m = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))
    for _ in range(3):
        from_sequential(m)
    assert [len(c._forward_hooks) for c in m] == [1, 0]
