"""`stratum sample` and `stratum export` from real checkpoints of every model source: sampling is a function of
the seed, exported directories load in transformers with the trained model's logits, bad input is one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from stratum.cli import main
from stratum.config import load_config
from stratum.errors import StratumError
from stratum.train.sample import SampleSpec, generate, next_token
from stratum.train.trained import load_trained
from stratum.train.trainer import train

from test_hardening import full_fs, ro_fs  # noqa: F401 (fixtures: small real filesystems, full or read-only)

transformers = pytest.importorskip("transformers")

V = 256
SOURCES = ("gpt", "sequential", "gpt2", "llama")
HF_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=V, n_positions=64),
    "llama": lambda: transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                              max_position_embeddings=64, pad_token_id=0),
}


def _source_overrides(source: str, tmp, corpus_file) -> list[str]:
    if source == "gpt":  # the own GPT with a BPE tokenizer, so the export carries a tokenizer.json too
        small = tmp / "small-corpus.txt"  # a BPE trains on 40 kB in a fraction of the time 300 kB take
        small.write_text(corpus_file.read_text()[:40_000])
        return ["model.source='gpt'", "model.preset='tiny'", "data.tokenizer='bpe'", "data.bpe_vocab_size=300",
                f"data.corpus={str(small)!r}"]
    if source == "sequential":
        return ["model.source='sequential'", "model.factory='stratum.model.sequential:example_lm_blocks'"]
    cfg_dir = tmp / f"{source}-config"
    HF_CONFIGS[source]().save_pretrained(cfg_dir)
    return ["model.source='hf'", f"model.hf_path={str(cfg_dir)!r}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_file, cache_dir):
    """A 3-step run per model source (trained once for the module): source → its out_dir."""
    tmp = tmp_path_factory.mktemp("runs")
    out = {}
    for source in SOURCES:
        cfg = load_config(None, [
            f"data.corpus={str(corpus_file)!r}", f"data.cache_dir={str(cache_dir)!r}", "data.seq_len=32",
            "train.micro_batch_size=2", "train.steps=3", "train.eval_interval=0", "train.eval_batches=1",
            "optim.warmup_steps=1", f"train.out_dir={str(tmp / source)!r}",
            *_source_overrides(source, tmp, corpus_file)])
        train(cfg)
        out[source] = tmp / source
    return out


@pytest.mark.parametrize("source", SOURCES)
def test_sampling_is_a_function_of_the_seed(runs, source):
    trained = load_trained(runs[source])
    assert trained.step == 3 and trained.cfg.model.source == ("hf" if source in HF_CONFIGS else source)
    prompt = [int(i) for i in trained.tokenizer.encode(b"def ")]

    def draw(seed):
        spec = SampleSpec(new_tokens=12, temperature=1.0, top_k=0, seed=seed, num_samples=2)
        return generate(trained.model, prompt, spec, window=trained.cfg.data.seq_len, vocab=V)

    state = torch.get_rng_state()
    a, b, c = draw(7), draw(7), draw(8)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is left alone
    assert a.shape == (2, len(prompt) + 12) and a[:, :len(prompt)].tolist() == [prompt, prompt]
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.max()) < trained.tokenizer.vocab_size


def test_greedy_and_top_k_one_take_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 4.0]])
    gen = torch.Generator().manual_seed(0)
    greedy = next_token(logits, SampleSpec(new_tokens=1, temperature=0.0, top_k=0, seed=0), gen)
    top1 = next_token(logits, SampleSpec(new_tokens=1, temperature=2.0, top_k=1, seed=0), gen)
    assert greedy.tolist() == top1.tolist() == [[1], [0]]
    top2 = [next_token(logits, SampleSpec(new_tokens=1, temperature=5.0, top_k=2, seed=0), gen)[0, 0].item()
            for _ in range(200)]
    assert set(top2) == {1, 3}  # only the two largest logits are ever drawn


@pytest.mark.parametrize("temperature", [1e-300, 5e-324])
def test_a_temperature_near_zero_takes_the_argmax(temperature):
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 4.0]])  # logits / 1e-300 overflow to ±inf
    spec = SampleSpec(new_tokens=1, temperature=temperature, top_k=0, seed=0)
    assert next_token(logits, spec, torch.Generator().manual_seed(0)).tolist() == [[1], [0]]


def test_sample_command_prints_the_prompt_and_its_continuation(runs, capsys):
    argv = ["sample", str(runs["gpt"]), "--prompt", "def ", "--tokens", "8", "--seed", "3", "--num-samples", "2"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first
    assert first.count("---------- sample") == 2 and first.count("def ") >= 2
    # the run's checkpoints directory names the run's latest checkpoint too
    assert main(["sample", str(runs["gpt"] / "checkpoints"), *argv[2:]]) == 0
    assert capsys.readouterr().out == first


@pytest.mark.parametrize("source", ["gpt", "gpt2", "llama"])
def test_export_loads_in_transformers_with_equal_logits(runs, source, tmp_path):
    out = tmp_path / "exported"
    assert main(["export", str(runs[source]), "--out", str(out)]) == 0
    trained = load_trained(runs[source])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    want_arch = {"gpt": "GPT2LMHeadModel", "gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[source]
    assert type(model).__name__ == want_arch
    ids = torch.randint(0, trained.tokenizer.vocab_size, (2, trained.cfg.data.seq_len),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, trained.model(ids), rtol=1e-5, atol=1e-5)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left
    if source == "gpt":  # the BPE tokenizer went along and encodes as Stratum's does
        tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
        text = "def main(argv):\n    return 0\n"
        assert tok(text)["input_ids"] == [int(i) for i in trained.tokenizer.encode(text.encode())]


def test_bad_input_is_one_line(runs, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "file").write_text("x")
    cases = [
        (["sample", str(tmp_path / "nothing")], "does not exist"),
        (["sample", str(tmp_path)], "holds no checkpoint"),
        (["sample", str(runs["gpt"]), "--temperature", "-1"], "--temperature"),
        (["sample", str(runs["gpt"]), "--temperature", "nan"], "--temperature"),
        (["sample", str(runs["gpt"]), "--tokens", "0"], "--tokens"),
        (["sample", str(runs["gpt"]), "--top-k", "-2"], "--top-k"),
        (["sample", str(runs["gpt"]), "--prompt", ""], "no tokens"),
        (["export", str(runs["gpt"]), "--out", str(taken)], "already exists"),
        (["export", str(runs["gpt"]), "--out", str(taken / "file")], "is a file; name a new directory"),
        (["export", str(runs["gpt"]), "--out", str(taken / "file" / "x")], "not a directory"),
        (["export", str(runs["sequential"]), "--out", str(tmp_path / "seq")], "cannot be exported"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("stratum: error: ") and err.count("\n") == 1 and message in err, (argv, err)
    assert (taken / "file").read_text() == "x" and not (tmp_path / "seq").exists()


def test_a_bpe_run_whose_corpus_is_gone_says_so(runs, capsys):
    corpus = runs["gpt"].parent / "small-corpus.txt"
    saved = corpus.read_text()
    corpus.unlink()
    try:  # the BPE is cached by the corpus's contents: without the corpus it cannot be found
        assert main(["sample", str(runs["gpt"])]) == 2
    finally:
        corpus.write_text(saved)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bpe tokenizer cannot be rebuilt" in err and "does not exist" in err


def test_a_checkpoint_whose_config_was_edited_to_nonsense_is_one_line(runs, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(runs["gpt"], copy)
    for meta in copy.glob("checkpoints/step_*/meta.json"):
        doc = json.loads(meta.read_text())
        doc["config"]["model"]["preset"] = "tinyy"
        meta.write_text(json.dumps(doc))
    assert main(["sample", str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "meta.json's config is not valid (model.preset = 'tinyy'" in err, err


def test_a_bpe_run_whose_corpus_changed_is_refused_not_decoded_with_another_tokenizer(runs, capsys):
    corpus = runs["gpt"].parent / "small-corpus.txt"
    saved = corpus.read_text()
    corpus.write_text(saved + " xylophone flarb wibble snork glorp" * 2000)
    try:  # the BPE is found by the corpus's contents: a changed corpus trains another one
        assert main(["sample", str(runs["gpt"])]) == 2
    finally:
        corpus.write_text(saved)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was trained with tokenizer bpe:" in err and "restore the corpus" in err, err
    assert main(["sample", str(runs["gpt"]), "--tokens", "3"]) == 0  # the corpus as it was: its tokenizer again


def test_a_model_that_changed_since_the_checkpoint_is_refused(runs):
    config = runs["gpt2"].parent / "gpt2-config" / "config.json"
    saved = config.read_text()
    try:  # the hf_path the run was trained from now holds a 1-layer model
        transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=V,
                                n_positions=64).save_pretrained(config.parent)
        with pytest.raises(StratumError, match="not the one it holds"):
            load_trained(runs["gpt2"])
    finally:
        config.write_text(saved)


@pytest.mark.parametrize("where", ["full", "read-only"])
def test_export_to_a_full_or_read_only_filesystem_is_one_line(where, runs, full_fs, ro_fs, capsys):  # noqa: F811
    fs = full_fs if where == "full" else ro_fs
    before = sorted(p.name for p in fs.iterdir())
    assert main(["export", str(runs["gpt"]), "--out", str(fs / "exported")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stratum: error: cannot write") and err.count("\n") == 1, err
    assert sorted(p.name for p in fs.iterdir()) == before  # no half-written directory left


def test_a_run_given_relative_paths_samples_and_exports_from_any_directory(tmp_path, corpus_file, cache_dir,
                                                                            monkeypatch, capsys):
    """model.hf_path and data.corpus given relative to where the run started: its checkpoints record them
    absolute, so sample and export (which rebuild the model and the BPE from them) work from anywhere."""
    here = tmp_path / "project"
    here.mkdir()
    (here / "corpus.txt").write_text(corpus_file.read_text()[:40_000])
    HF_CONFIGS["gpt2"]().save_pretrained(here / "gpt2-config")
    monkeypatch.chdir(here)
    train(load_config(None, [
        "data.corpus='corpus.txt'", f"data.cache_dir={str(cache_dir)!r}", "data.seq_len=32", "data.tokenizer='bpe'",
        "data.bpe_vocab_size=300", "model.source='hf'", "model.hf_path='gpt2-config'", "model.vocab_size=300",
        "train.micro_batch_size=2", "train.steps=2", "train.eval_interval=0", "optim.warmup_steps=1", "train.out_dir='run'"]))
    saved = json.loads(next((here / "run" / "checkpoints").glob("step_*/meta.json")).read_text())["config"]
    assert saved["data"]["corpus"] == str(here / "corpus.txt")
    assert saved["model"]["hf_path"] == str(here / "gpt2-config")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["sample", str(here / "run"), "--prompt", "def ", "--tokens", "4", "--seed", "1"]) == 0
    assert main(["export", str(here / "run"), "--out", str(tmp_path / "exported")]) == 0, capsys.readouterr().err
    assert (tmp_path / "exported" / "tokenizer.json").is_file()
