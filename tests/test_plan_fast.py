"""A fast `stratum plan`: bytes from shapes without running the model, block times measured on a small batch,
scaled, and cached per architecture, device and batch shape, with a line per measured block."""

from __future__ import annotations

import json

import pytest
import torch

import stratum.profile.fast as fast
from stratum.cli import main
from stratum.model.gpt import build_gpt
from stratum.profile.profiler import profile_blockseq

CPU = torch.device("cpu")


def _no_measuring(*args, **kwargs):
    raise AssertionError("a block was run")


def _model(name: str, tmp_path):
    """A tiny model of each kind on the meta device: the own GPT, or transformers' GPT-2 or Llama."""
    if name == "gpt":
        return build_gpt("tiny", vocab_size=256, seed=0, device="meta")
    transformers = pytest.importorskip("transformers")
    from stratum.model.hf import build_hf
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=64)
    else:  # rotary buffers, grouped-query attention
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                          max_position_embeddings=64)
    config.save_pretrained(tmp_path / name)
    return build_hf(str(tmp_path / name), seed=0, device="meta")


@pytest.mark.parametrize("name, slack", [("gpt", 1.0), ("gpt2", 1.0), ("llama", 1.15)])
def test_shape_profile_gives_the_bytes_without_running_a_block(name, slack, tmp_path, monkeypatch):
    measured = profile_blockseq(_model(name, tmp_path), micro_batch=4, seq_len=32, device=CPU, runs=1)
    monkeypatch.setattr(fast, "_measure_block", _no_measuring)
    state = torch.get_rng_state()
    shapes = fast.shape_profile(_model(name, tmp_path), micro_batch=4, seq_len=32, device=CPU)
    assert torch.equal(torch.get_rng_state(), state)
    assert len(shapes.blocks) == len(measured.blocks)
    for s, m in zip(shapes.blocks, measured.blocks):
        assert (s.n_params, s.param_bytes, s.grad_bytes, s.optim_bytes, s.out_bytes, s.logits_bytes) == \
               (m.n_params, m.param_bytes, m.grad_bytes, m.optim_bytes, m.out_bytes, m.logits_bytes)
        # exact for GPT and GPT-2; a Llama layer counts more than it saves when run (an upper bound)
        assert m.act_saved_bytes <= s.act_saved_bytes <= slack * m.act_saved_bytes, s.name
        assert s.fwd_s == s.bwd_s == 0.0


def test_the_probe_batch_shrinks_with_the_model():
    assert fast.probe_batch(build_gpt("tiny", vocab_size=256, seed=0, device="meta"), 16, 128) == 16
    big = build_gpt("gpt-6.7b", vocab_size=None, seed=0, device="meta")
    assert fast.probe_batch(big, 16, 128) == 1 and fast.probe_batch(big, 16, 2048) == 1


def test_a_scaled_profile_has_the_full_batchs_bytes(monkeypatch):
    model = build_gpt("tiny", vocab_size=256, seed=0, device="meta")
    monkeypatch.setattr(fast, "PROBE_FLOPS", 6 * 49_984 * 64 * 4)  # the largest block (a layer) on 4 sequences
    assert fast.probe_batch(model, 16, 64) == 4
    scaled = fast.scaled_profile(model, micro_batch=16, seq_len=64, device=CPU)
    full = profile_blockseq(model, micro_batch=16, seq_len=64, device=CPU, runs=1)
    assert scaled.micro_batch == 16 and scaled.runs == fast.PROBE_RUNS
    for s, f in zip(scaled.blocks, full.blocks):
        assert (s.out_bytes, s.param_bytes, s.logits_bytes) == (f.out_bytes, f.param_bytes, f.logits_bytes)
        assert s.fwd_s > 0 and s.bwd_s > 0
        if s.kind == "Layer":  # all of a layer's saved bytes grow with the batch
            assert (s.act_saved_bytes, s.spill_bytes) == (f.act_saved_bytes, f.spill_bytes)
        else:  # the embedding also saves its position ids, one copy whatever the batch: scaled, an upper bound
            assert f.act_saved_bytes <= s.act_saved_bytes <= 1.2 * f.act_saved_bytes
    assert all(p.is_meta for p in model.parameters())  # measured on copies: the model itself stays unbuilt


def test_sliding_window_layers_are_measured_apart_from_full_attention_ones(tmp_path):
    """Layers of the same class and shapes that attend differently (Qwen2's sliding-window layers beside full
    ones) save different bytes: each kind is measured, by the scaled profile and the offload engine's quick one,
    and each agrees with the full profiler's figure for its own layers."""
    transformers = pytest.importorskip("transformers")
    from stratum.model.hf import build_hf
    from stratum.offload.setup import quick_profile
    transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             use_sliding_window=True, sliding_window=16, max_window_layers=2,
                             layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2).save_pretrained(tmp_path)
    model = build_hf(str(tmp_path), seed=0)
    assert fast._distinct_count(model) == 4  # embedding, full layer, sliding layer, head
    full = profile_blockseq(model, micro_batch=4, seq_len=32, device=CPU, runs=1, precision="bf16")
    saved = [b.half_act_saved_bytes for b in full.blocks]
    assert saved[1] == saved[2] != saved[3] == saved[4]
    for prof in (fast.scaled_profile(model, micro_batch=4, seq_len=32, device=CPU, precision="bf16"),
                 quick_profile(model, micro_batch=4, seq_len=32, device=CPU, precision="bf16")):
        assert [b.half_act_saved_bytes for b in prof.blocks][1:5] == saved[1:5]


def test_the_profile_is_cached_per_batch_shape(tmp_path, monkeypatch, caplog):
    model = build_gpt("tiny", vocab_size=256, seed=0, device="meta")
    kw = dict(seq_len=32, device=CPU, cache_dir=tmp_path)
    first = fast.cached_profile(model, micro_batch=4, **kw)
    files = list((tmp_path / fast.CACHE_SUBDIR).iterdir())
    assert len(files) == 1
    monkeypatch.setattr(fast, "_measure_block", _no_measuring)
    assert fast.cached_profile(build_gpt("tiny", vocab_size=256, seed=1, device="meta"), micro_batch=4,
                               **kw) == first  # other weights, same architecture: the same costs
    with pytest.raises(AssertionError, match="a block was run"):
        fast.cached_profile(model, micro_batch=8, **kw)  # another batch shape is measured anew
    files[0].write_text("{not json")
    with pytest.raises(AssertionError, match="a block was run"):
        fast.cached_profile(model, micro_batch=4, **kw)  # an unreadable cache is measured again
    assert "ignoring the unreadable cached profile" in caplog.text


def _plan_args(corpus_file, cache_dir, *extra):
    sets = [f"data.corpus={str(corpus_file)!r}", f"data.cache_dir={str(cache_dir)!r}", "data.seq_len=32",
            "model.preset='tiny'", "train.micro_batch_size=4", "offload.device_budget='2MB'", *extra]
    return ["plan"] + [a for s in sets for a in ("--set", s)]


def test_plan_estimate_answers_from_shapes_alone(corpus_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fast, "_measure_block", _no_measuring)
    monkeypatch.setattr("stratum.offload.setup.quick_profile", _no_measuring)
    assert main([*_plan_args(corpus_file, tmp_path), "--estimate"]) == 0
    out = capsys.readouterr().out
    assert "predicted peak" in out and "from the shapes); step time not predicted" in out
    assert "predicted step time" not in out and not (tmp_path / fast.CACHE_SUBDIR).exists()
    assert main([*_plan_args(corpus_file, tmp_path), "--estimate", "--sweep", "200%,400%"]) == 0
    rows = capsys.readouterr().out.splitlines()[-2:]
    assert all(r.split()[-1] == "-" for r in rows)  # no step time in an estimate's rows
    assert main([*_plan_args(corpus_file, tmp_path), "--estimate", "--profile", "p.json"]) == 2
    assert "give one" in capsys.readouterr().err
    # bf16 or fp16 with the optimizer state on the host: 16-bit chunks on the device, half the parameter bytes
    peaks = {}
    for precision in ("fp32", "bf16", "fp16"):
        out = tmp_path / f"{precision}.json"
        assert main([*_plan_args(corpus_file, tmp_path, f"train.precision='{precision}'",
                                 "offload.optimizer_tier='host'", "offload.activations='recompute'",
                                 "offload.chunk_size='128KB'", "offload.resident_chunks=4"),
                     "--estimate", "--json", str(out)]) == 0
        plan = json.loads(out.read_text())
        peaks[precision] = (plan["predicted_peak"]["device"] - plan["act_bytes"], plan["half_params"])
        assert ("16-bit working copies on the device" in capsys.readouterr().out) == (precision != "fp32")
    assert peaks["bf16"][1] and not peaks["fp32"][1] and peaks["bf16"][0] < peaks["fp32"][0] / 2
    assert peaks["fp16"] == peaks["bf16"]


def test_plan_takes_an_offload_leafs_budgets_and_refuses_a_plan_of_several_processes(corpus_file, tmp_path,
                                                                                      monkeypatch, capsys):
    monkeypatch.setattr(fast, "_measure_block", _no_measuring)
    out = tmp_path / "leaf.json"
    assert main([*_plan_args(corpus_file, tmp_path, "parallel.plan='offload(device_budget=3MB)'"), "--estimate",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["device_budget"] == 3_000_000  # the leaf's, not [offload]'s 2MB
    capsys.readouterr()
    assert main([*_plan_args(corpus_file, tmp_path, "parallel.plan='pipeline(2, offload)'"), "--estimate"]) == 2
    assert "runs several processes: `stratum train --dry-run` prints each rank's placement" in capsys.readouterr().err


def test_plan_measures_once_with_a_line_per_block_then_reads_the_cache(corpus_file, tmp_path, capsys):
    assert main(_plan_args(corpus_file, tmp_path)) == 0
    out = capsys.readouterr().out
    assert "measuring tiny's blocks on 4 × 32 tokens" in out and "measuring block layer.0 (2 of ~3 distinct)" in out
    assert "predicted step time" in out
    assert main(_plan_args(corpus_file, tmp_path)) == 0
    out = capsys.readouterr().out
    assert "block costs from the cached profile" in out and "measuring block" not in out
