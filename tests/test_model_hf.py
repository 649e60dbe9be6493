"""The Hugging Face ``transformers`` model source: parity with the model's own forward, ties, loading, errors."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from stratum.errors import StratumError  # noqa: E402
from stratum.model.hf import build_hf  # noqa: E402

pytestmark = pytest.mark.hf

V = 256
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def gpt2_config(**kw):
    return transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=V, n_positions=64,
                                   **SPECIAL, **kw)


def llama_config(**kw):
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                    max_position_embeddings=64, **SPECIAL, **kw)


CONFIGS = {"gpt2": gpt2_config, "llama": llama_config}


@pytest.fixture(params=list(CONFIGS))
def family(request):
    return request.param


def save_config(tmp_path, cfg, name="cfg"):
    d = tmp_path / name
    cfg.save_pretrained(d)
    return d


def reference(cfg_dir, seed):
    """The HF model built the way build_hf builds it (same config file, seed, attention), outside Stratum."""
    cfg = transformers.AutoConfig.from_pretrained(str(cfg_dir), local_files_only=True)
    cfg.use_cache = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                                             dtype=torch.float32)


def copy_values(ref, seq):
    """Give the HF reference model the BlockSeq's values (random init draws them block by block)."""
    src, dst = list(seq.parameters()), list(ref.parameters())
    assert [p.shape for p in src] == [p.shape for p in dst]
    with torch.no_grad():
        for a, b in zip(src, dst):
            b.copy_(a)
    return ref


def materialized(seq, order=None):
    """A lazily built BlockSeq with every block given storage and its values (in ``order``)."""
    for i in range(len(seq)) if order is None else order:
        seq.allocate(i)
        seq.materialize(i)
    return seq


def assert_same_parameters(want_seq, *seqs):
    want = dict(want_seq.named_parameters())
    for seq in seqs:
        got = dict(seq.named_parameters())
        assert got.keys() == want.keys()
        for n in want:
            assert torch.equal(got[n], want[n]), n


def batch(seed=0, b=2, t=16):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, V, (b, t + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def test_parity_with_hf_forward(tmp_path, family):
    d = save_config(tmp_path, CONFIGS[family]())
    seq = build_hf(str(d / "config.json"), seed=7).eval()  # a bare config.json file: random init
    ref = copy_values(reference(d, 7), seq).eval()
    x, y = batch()
    with torch.no_grad():
        logits = seq(x)
        ref_logits = ref(x).logits
        assert logits.shape == (2, 16, V)
        torch.testing.assert_close(logits, ref_logits, atol=1e-6, rtol=0)
        ce = F.cross_entropy(ref_logits.reshape(-1, V), y.reshape(-1))
        torch.testing.assert_close(seq.loss(x, y), ce, atol=1e-6, rtol=0)
    # every HF parameter is in the BlockSeq exactly once
    assert seq.num_params() == sum(p.numel() for p in ref.parameters())
    # causal: changing a later token leaves earlier logits unchanged
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % V
    with torch.no_grad():
        assert torch.equal(seq(x2)[:, :10], logits[:, :10])

    n = seq.info.n_layer
    assert len(seq) == n + 2 and seq.block_names == ["embed"] + [f"layer.{i}" for i in range(n)] + ["head"]
    assert (seq.info.name, seq.info.vocab_size, seq.info.max_seq_len, seq.info.d_model) == (family, V, 64, 32)
    extra = seq.info.extra
    assert extra["source"] == "hf" and extra["model_type"] == family
    assert "transformers_version" not in extra["config"] and "_name_or_path" not in extra["config"]
    json.dumps(seq.fingerprint())  # checkpoint fingerprints must be JSON


def test_gpt2_tied_embedding_gets_both_gradients(tmp_path):
    seq = build_hf(str(save_config(tmp_path, gpt2_config())), seed=0, dropout=0.0)
    assert [g.names for g in seq.tied] == [("blocks.0.wte.weight", f"blocks.{len(seq) - 1}.lm_head.weight")]
    tied = seq.blocks[0].wte.weight
    assert seq.blocks[-1].lm_head.weight is tied
    x, y = batch()
    seq.loss(x, y).backward()
    total = tied.grad.clone()
    # split the tied weight into two independent copies: one gradient per use
    emb_w = tied.detach().clone().requires_grad_()
    head_w = tied.detach().clone().requires_grad_()
    names = seq.tied[0].names
    out = torch.func.functional_call(seq, {names[0]: emb_w, names[1]: head_w}, (x,), tie_weights=False)
    F.cross_entropy(out.reshape(-1, V), y.reshape(-1)).backward()
    assert emb_w.grad.abs().sum() > 0 and head_w.grad.abs().sum() > 0
    torch.testing.assert_close(emb_w.grad + head_w.grad, total)


def test_llama_untied_by_default_tied_when_asked(tmp_path):
    assert build_hf(str(save_config(tmp_path, llama_config(), "a")), seed=0).tied == []
    tied = build_hf(str(save_config(tmp_path, llama_config(tie_word_embeddings=True), "b")), seed=0)
    assert len(tied.tied) == 1 and tied.blocks[0].embed_tokens.weight is tied.blocks[-1].lm_head.weight


def test_weights_in_model_dir_are_loaded(tmp_path, family):
    cfg_dir = save_config(tmp_path, CONFIGS[family]())
    model = reference(cfg_dir, 123)
    with torch.no_grad():
        for p in model.parameters():  # weights no seed would produce
            p.add_(0.01 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "model")
    seq = build_hf(str(tmp_path / "model"), seed=0).eval()
    x, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(seq(x), model.eval()(x).logits, atol=1e-6, rtol=0)
    if family == "gpt2":
        assert len(seq.tied) == 1


def test_same_seed_same_weights_different_seed_differs(tmp_path, family):
    path = str(save_config(tmp_path, CONFIGS[family]()))
    torch.manual_seed(5)
    expected_next = torch.rand(3)
    torch.manual_seed(5)
    a = build_hf(path, seed=1)
    assert torch.equal(torch.rand(3), expected_next), "build_hf must not disturb the caller's RNG"
    b, c = build_hf(path, seed=1), build_hf(path, seed=2)
    pa, pb, pc = (dict(s.named_parameters()) for s in (a, b, c))
    assert pa.keys() == pb.keys() == pc.keys()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not all(torch.equal(pa[k], pc[k]) for k in pa)


def test_adamw_reduces_loss(tmp_path, family):
    seq = build_hf(str(save_config(tmp_path, CONFIGS[family]())), seed=0, dropout=0.0)
    opt = torch.optim.AdamW(seq.parameters(), lr=1e-2)
    x, y = batch()
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = seq.loss(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_dropout_and_vocab_overrides(tmp_path):
    path = str(save_config(tmp_path, gpt2_config()))
    cfg = build_hf(path, seed=0, dropout=0.0).info.extra["config"]
    assert cfg["resid_pdrop"] == cfg["embd_pdrop"] == cfg["attn_pdrop"] == 0.0
    assert build_hf(path, seed=0).info.extra["config"]["resid_pdrop"] == 0.1  # the config's own
    llama = build_hf(str(save_config(tmp_path, llama_config(), "l")), seed=0, dropout=0.2)
    assert llama.info.extra["config"]["attention_dropout"] == 0.2

    bigger = build_hf(path, seed=0, vocab_size=300)  # random init: sized to the tokenizer
    assert bigger.info.vocab_size == 300 and bigger(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 300)
    with pytest.raises(StratumError, match="dropout"):
        build_hf(path, seed=0, dropout=1.5)


def test_meta_device_builds_structure_only(tmp_path):
    seq = build_hf(str(save_config(tmp_path, gpt2_config())), seed=0, device="meta")
    assert all(p.is_meta for p in seq.parameters()) and len(seq.tied) == 1


def test_a_vocabulary_larger_than_the_pretrained_models_is_refused(tmp_path):
    reference(save_config(tmp_path, gpt2_config()), 0).save_pretrained(tmp_path / "model")
    with pytest.raises(StratumError, match=rf"^model.vocab_size = {V + 1} is larger than the pretrained model's "
                                           rf"vocabulary of {V}; set at most {V}"):
        build_hf(str(tmp_path / "model"), seed=0, vocab_size=V + 1)


def test_bad_inputs(tmp_path):
    with pytest.raises(StratumError, match="does not exist"):
        build_hf(str(tmp_path / "nope"), seed=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(StratumError, match="without config.json"):
        build_hf(str(tmp_path / "empty"), seed=0)
    bert = save_config(tmp_path, transformers.BertConfig(hidden_size=32, num_hidden_layers=1,
                                                         num_attention_heads=2, intermediate_size=64), "bert")
    with pytest.raises(StratumError, match=r"model_type 'bert' is not supported.*gpt2.*llama"):
        build_hf(str(bert), seed=0)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(StratumError, match="not a readable JSON config"):
        build_hf(str(bad), seed=0)
    bad.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(StratumError, match="not a readable JSON config"):
        build_hf(str(bad), seed=0)
    untyped = tmp_path / "untyped.json"
    untyped.write_text('{"vocab_size": 10}')
    with pytest.raises(StratumError, match="no 'model_type'"):
        build_hf(str(untyped), seed=0)


def test_missing_transformers_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(StratumError, match=r"pip install 'stratum\[hf\]'"):
        build_hf(str(tmp_path), seed=0)


def _saved_model(tmp_path, family, **kw):
    cfg_dir = save_config(tmp_path, CONFIGS[family](**kw))
    model = reference(cfg_dir, 123)
    with torch.no_grad():
        for p in model.parameters():  # weights no seed would produce
            p.add_(0.01 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


@pytest.mark.parametrize("tied", [False, True])
def test_lazy_build_loads_safetensors_block_by_block_with_the_eager_values(tmp_path, family, tied):
    """Models larger than RAM: parameters stay on meta (buffers real) until materialize(i) reads block i's
    tensors from the files; every block then equals the eager from_pretrained build, and a deep copy loads into
    itself."""
    import copy
    d = _saved_model(tmp_path, family, **({"tie_word_embeddings": tied} if family == "llama" else {}))
    eager = build_hf(str(d), seed=0)
    lazy = build_hf(str(d), seed=0, lazy=True)
    assert all(p.is_meta for p in lazy.parameters()) and not any(b.is_meta for b in lazy.buffers())
    assert len(lazy.tied) == len(eager.tied)
    twin = copy.deepcopy(lazy)
    assert_same_parameters(eager, materialized(lazy), materialized(twin))
    x, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(lazy.eval()(x), eager.eval()(x), atol=0, rtol=0)


def test_lazy_build_refuses_weights_missing_a_tensor(tmp_path):
    from safetensors.torch import load_file, save_file
    d = _saved_model(tmp_path, "llama")
    tensors = load_file(str(d / "model.safetensors"))
    gone = next(k for k in tensors if "layers.1.mlp" in k)
    del tensors[gone]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(StratumError, match="no tensor for"):
        build_hf(str(d), seed=0, lazy=True)


@pytest.mark.parametrize("tied", [False, True])
def test_random_init_is_drawn_block_by_block_lazy_equals_eager(tmp_path, family, tied):
    """A bare config: every block is initialised by the model's own _init_weights under a seed of its own, so a
    lazy build materialised block by block (in any order, or a deep copy of it) equals the eager build, and the
    values follow transformers' scheme (the same per-parameter mean and spread as from_config's)."""
    import copy
    d = save_config(tmp_path, CONFIGS[family](**({"tie_word_embeddings": tied} if family == "llama" else {})))
    eager = build_hf(str(d), seed=3)
    assert eager.block_init is None and not any(p.is_meta for p in eager.parameters())
    lazy = build_hf(str(d), seed=3, lazy=True)
    assert all(p.is_meta for p in lazy.parameters()) and not any(b.is_meta for b in lazy.buffers())
    twin = copy.deepcopy(lazy)
    assert_same_parameters(eager, materialized(lazy, reversed(range(len(lazy)))), materialized(twin))
    assert not torch.equal(*[build_hf(str(d), seed=s).blocks[1].layer.mlp.c_fc.weight if family == "gpt2"
                             else build_hf(str(d), seed=s).blocks[1].layer.mlp.up_proj.weight for s in (3, 4)])
    ref = reference(d, 3)
    for (n, a), b in zip(eager.named_parameters(), ref.parameters()):
        if a.numel() > 100:
            assert abs(a.std().item() - b.std().item()) <= 0.15 * b.std().item() + 1e-6, n
            assert abs(a.mean().item() - b.mean().item()) <= 0.2 * b.std().item() + 1e-6, n
        else:
            assert torch.equal(a, b) or abs(a.std().item() - b.std().item()) <= 0.5 * b.std().item(), n


def test_lazy_build_reads_pytorch_model_bin_memory_mapped(tmp_path):
    """pytorch_model.bin weights: read block by block through torch.load(mmap=True), equal to from_pretrained."""
    cfg_dir = save_config(tmp_path, gpt2_config())
    model = reference(cfg_dir, 123)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.config.save_pretrained(tmp_path / "model")  # transformers 5 writes safetensors only: a legacy .bin
    torch.save(model.state_dict(), tmp_path / "model" / "pytorch_model.bin")
    eager = build_hf(str(tmp_path / "model"), seed=0)
    lazy = build_hf(str(tmp_path / "model"), seed=0, lazy=True)
    assert all(p.is_meta for p in lazy.parameters())
    assert_same_parameters(eager, materialized(lazy))
