"""The profiler's byte counts equal the analytic ones; times are measured; the Profile file round-trips."""

import json

import pytest
import torch
from torch import nn

from stratum.errors import StratumError
from stratum.model.gpt import build_gpt
from stratum.model.presets import PRESETS
from stratum.model.sequential import from_sequential
from stratum.profile import Profile
from stratum.profile.profiler import block_static_bytes, profile_blockseq, profile_from_config

F32 = 4


def _analytic_gpt_block_params(preset: str, vocab: int) -> list[int]:
    s = PRESETS[preset]
    d = s.d_model
    layer = 12 * d * d + 13 * d
    return [(vocab + s.max_seq_len) * d] + [layer] * s.n_layer + [2 * d]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_static_bytes_equal_analytic_for_every_gpt_preset(preset):
    vocab = PRESETS[preset].vocab_size or 256
    seq = build_gpt(preset, vocab_size=vocab, seed=0, device="meta")
    expected = _analytic_gpt_block_params(preset, vocab)
    for i, n in enumerate(expected):
        b = block_static_bytes(seq, i)
        assert b == {"n_params": n, "param_bytes": n * F32, "grad_bytes": n * F32, "optim_bytes": n * 8}, i


def test_profile_of_tiny_gpt_measures_every_block():
    seq = build_gpt("tiny", vocab_size=256, seed=0)
    b, t, d = 2, 16, PRESETS["tiny"].d_model
    prof = profile_blockseq(seq, micro_batch=b, seq_len=t, device=torch.device("cpu"), runs=2)
    assert [x.name for x in prof.blocks] == ["embed", "layer.0", "layer.1", "head"]
    assert [x.n_params for x in prof.blocks] == _analytic_gpt_block_params("tiny", 256)
    assert prof.n_params == seq.num_params()
    assert [x.out_bytes for x in prof.blocks] == [b * t * d * F32] * 3 + [0]
    assert [x.logits_bytes for x in prof.blocks] == [None] * 3 + [b * t * 256 * F32]  # the head's, before the loss
    assert all(x.fwd_s > 0 and x.bwd_s > 0 and x.act_saved_bytes > 0 for x in prof.blocks)
    assert prof.blocks[0].bwd_input_s == 0 and prof.blocks[1].bwd_input_s > 0
    # a transformer layer saves at least its input, the attention inputs and the 4d-wide MLP activations
    assert prof.blocks[1].act_saved_bytes >= b * t * d * F32 * (1 + 3 + 4)
    assert prof.tied == [["blocks.0.tok.weight", "blocks.3.weight"]]


def test_activation_bytes_are_exact_for_known_blocks():
    v, d, h, b, t = 32, 8, 16, 3, 5
    seq = from_sequential(nn.Sequential(nn.Embedding(v, d), nn.Linear(d, h), nn.ReLU(), nn.Linear(h, v)),
                          vocab_size=v)
    prof = profile_blockseq(seq, micro_batch=b, seq_len=t, device=torch.device("cpu"), runs=1)
    acts = [x.act_saved_bytes for x in prof.blocks]
    assert acts[0] == b * t * 8            # embedding saves its int64 indices
    assert acts[1] == b * t * d * F32      # linear saves its input
    assert acts[2] == b * t * h * F32      # relu saves its output
    assert acts[3] >= b * t * h * F32 + b * t * v * F32  # linear input + log-softmax of the loss


def test_meta_model_is_profiled_block_by_block_and_stays_meta():
    seq = build_gpt("tiny", vocab_size=256, seed=0, device="meta")
    prof = profile_blockseq(seq, micro_batch=1, seq_len=8, device=torch.device("cpu"), runs=1)
    assert prof.param_bytes == seq.num_params() * F32
    assert all(p.is_meta for p in seq.parameters())


def test_profile_json_round_trip_and_table(tmp_path):
    seq = build_gpt("tiny", vocab_size=256, seed=0)
    prof = profile_blockseq(seq, micro_batch=1, seq_len=8, device=torch.device("cpu"), runs=1)
    path = tmp_path / "p.json"
    prof.save(path)
    again = Profile.load(path)
    assert again == prof
    assert again.train_state_bytes == seq.num_params() * (4 + 4 + 8)
    table = prof.table()
    assert "layer.1" in table and "total" in table


def test_bad_profile_files(tmp_path):
    with pytest.raises(StratumError, match="does not exist"):
        Profile.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(StratumError, match="not valid JSON"):
        Profile.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"format_version": 1, "hello": 1}))
    with pytest.raises(StratumError, match="not a Stratum profile"):
        Profile.load(tmp_path / "other.json")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(StratumError, match="nests arrays or objects too deeply"):
        Profile.load(tmp_path / "deep.json")


@pytest.mark.parametrize("where, key, value, message", [
    ("block", "fwd_s", "abc", "block 0: fwd_s = 'abc' is not a finite, non-negative float"),
    ("block", "param_bytes", None, "block 0: param_bytes = None is not a finite, non-negative int"),
    ("block", "out_bytes", 1.5, "block 0: out_bytes = 1.5 is not a finite, non-negative int"),
    ("block", "bwd_s", True, "block 0: bwd_s = True is not a finite, non-negative float"),
    ("profile", "micro_batch", "2", "micro_batch = '2' is not a finite, non-negative int"),
    ("block", "fwd_s", -1.0, "block 0: fwd_s = -1.0 is not a finite, non-negative float"),
])
def test_a_profile_with_a_field_of_the_wrong_type_is_refused_naming_it(tmp_path, where, key, value, message):
    seq = build_gpt("tiny", vocab_size=256, seed=0)
    doc = profile_blockseq(seq, micro_batch=1, seq_len=8, device=torch.device("cpu"), runs=1).to_dict()
    (doc["blocks"][0] if where == "block" else doc)[key] = value
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(StratumError, match="^[^\n]*$") as e:
        Profile.load(tmp_path / "p.json")
    assert message in str(e.value)


def test_profile_from_config(make_cfg):
    prof = profile_from_config(make_cfg("train.micro_batch_size=2"), runs=1)
    assert prof.micro_batch == 2 and prof.seq_len == 32 and len(prof.blocks) == 4


def test_profiling_leaves_no_tensor_alive():
    """The saved-bytes hook must not keep the counted forward's graph alive: an output saved by its own grad_fn
    and returned as is by the hook makes a cycle through C++ that gc cannot collect (it kept GPT-2 774M's LM head
    and logits, 0.4 GiB, resident through training)."""
    import gc
    m = build_gpt("tiny", vocab_size=64, seed=0, device="meta")
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}
    profile_blockseq(m, micro_batch=2, seq_len=16, device=torch.device("cpu"), runs=1)
    gc.collect()
    left = [tuple(o.shape) for o in gc.get_objects()
            if isinstance(o, torch.Tensor) and id(o) not in before and not o.is_meta and o.numel() > 64]
    assert left == []


def test_profiles_and_probes_leave_rng_and_buffers_as_they_were(tmp_path):
    """The block profile (full and the offload planner's quick one) and the bandwidth/AdamW probes run under
    ``neutral``: a model with BatchNorm and dropout keeps its running statistics, and the RNG its state."""
    from stratum.model.neutral import persistent_buffers
    from stratum.model.sequential import batchnorm_lm_blocks, from_block_builders
    from stratum.offload import tiers
    from stratum.offload.setup import quick_profile

    seq = from_block_builders(batchnorm_lm_blocks(vocab_size=64, seq_len=8, d_model=16, n_layer=1, dropout=0.1),
                              seed=0)
    with torch.no_grad():  # statistics a training step would have moved
        for t in persistent_buffers(seq).values():
            t.add_(3)
    before = {n: t.clone() for n, t in persistent_buffers(seq).items()}
    rng = torch.get_rng_state()
    cpu = torch.device("cpu")
    profile_blockseq(seq, micro_batch=2, seq_len=8, device=cpu, runs=1)
    quick_profile(seq, micro_batch=2, seq_len=8, device=cpu)
    tiers._measure_adam_here.cache_clear()  # the AdamW probes draw their inputs once per process: draw them here
    tiers._measure_adam_beside.cache_clear()
    tiers.measure_bandwidths(cpu, str(tmp_path), host_bytes=1 << 16, disk_bytes=1 << 16)
    assert torch.equal(torch.get_rng_state(), rng)
    after = persistent_buffers(seq)
    assert before.keys() == after.keys() and len(before) == 6  # 2 BatchNorms: running mean, var, count
    for n, t in before.items():
        assert torch.equal(after[n], t), n
