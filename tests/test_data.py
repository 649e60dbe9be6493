import os

import numpy as np
import pytest
import torch

from stratum.config import load_config
from stratum.data import TRAIN, VAL, BatchSampler, ByteTokenizer, build_token_cache, resolve_corpus
from stratum.data.prepare import make_tokenizer, prepare_data
from stratum.errors import StratumError


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, wörld\n"
    ids = tok.encode(text.encode())
    assert ids.max() < tok.vocab_size and tok.decode(ids) == text


def test_stdlib_corpus_is_real_and_sorted():
    c = resolve_corpus("stdlib")
    assert len(c.files) > 100 and all(f.suffix == ".py" for f in c.files)
    assert not any("site-packages" in f.parts for f in c.files)
    assert resolve_corpus("stdlib").files == c.files  # the same order every time
    assert c.total_bytes > 1_000_000


def test_directory_corpus_skips_binary_and_hidden(tmp_path):
    (tmp_path / "a.txt").write_text("alpha " * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("beta " * 50)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 100)
    (tmp_path / ".hidden").write_text("secret")
    c = resolve_corpus(str(tmp_path))
    assert [f.name for f in c.files] == ["a.txt", "b.md"]


def test_directory_corpus_follows_linked_directories_once(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "c.txt").write_text("gamma " * 50)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("alpha " * 50)
    os.symlink(tmp_path / "real", tmp_path / "corpus" / "linked")
    os.symlink(tmp_path / "real", tmp_path / "corpus" / "twice")  # the same directory by another name
    os.symlink(tmp_path / "corpus", tmp_path / "real" / "loop")  # back up the tree
    c = resolve_corpus(str(tmp_path / "corpus"))
    assert [f.relative_to(tmp_path / "corpus").as_posix() for f in c.files] == ["a.txt", "linked/c.txt"]


@pytest.mark.parametrize("setup, message", [
    (lambda p: p / "nope.txt", "does not exist"),
    (lambda p: ((p / "empty.txt").write_text(""), p / "empty.txt")[1], "holds no text"),
    (lambda p: ((p / "d").mkdir(), p / "d")[1], "holds no text"),
    (lambda p: ((p / "x.bin").write_bytes(b"\0" * 10), p / "x.bin")[1], "not a text file"),
])
def test_bad_corpus(tmp_path, setup, message):
    with pytest.raises(StratumError, match=message):
        resolve_corpus(str(setup(tmp_path)))


def test_token_cache_is_built_once_and_memory_mapped(corpus_file, tmp_path):
    c = resolve_corpus(str(corpus_file))
    t1 = build_token_cache(c, ByteTokenizer(), tmp_path)
    files = sorted(tmp_path.glob("tokens-*.bin"))
    assert len(files) == 1 and isinstance(t1, np.memmap)
    mtime = files[0].stat().st_mtime_ns
    t2 = build_token_cache(c, ByteTokenizer(), tmp_path)
    assert files[0].stat().st_mtime_ns == mtime and np.array_equal(t1, t2)
    assert len(t1) == corpus_file.stat().st_size + 1  # one newline after each file
    assert not list(tmp_path.glob("*.tmp"))


def test_batches_are_a_pure_function_of_seed_and_step():
    tokens = np.arange(10_000, dtype=np.int64) % 256
    a = BatchSampler(tokens, seq_len=16, seed=3, val_fraction=0.1)
    b = BatchSampler(tokens, seq_len=16, seed=3, val_fraction=0.1)
    for step in (0, 5, 1000):
        assert torch.equal(a.batch(TRAIN, step, 8).x, b.batch(TRAIN, step, 8).x)
    assert not torch.equal(a.batch(TRAIN, 1, 8).x, a.batch(TRAIN, 2, 8).x)
    other = BatchSampler(tokens, seq_len=16, seed=4, val_fraction=0.1)
    assert not torch.equal(a.batch(TRAIN, 1, 8).x, other.batch(TRAIN, 1, 8).x)
    full = a.batch(TRAIN, 7, 8)
    assert torch.equal(full.y[:, :-1], full.x[:, 1:])
    # the same global batch however it is cut into micro-batches
    for mb, count in ((8, 1), (4, 2), (2, 4), (1, 8)):
        parts = a.micro_batches(TRAIN, 7, mb, count)
        assert torch.equal(torch.cat([p.x for p in parts]), full.x)
    # validation windows come from the held-out tail only
    v = a.batch(VAL, 0, 4)
    assert int(v.x.min()) >= 0 and len(a.splits[VAL]) == 1000


def test_corpus_too_small_for_a_sequence():
    with pytest.raises(StratumError, match="fewer than one sequence"):
        BatchSampler(np.zeros(100, dtype=np.uint8), seq_len=128, seed=0, val_fraction=0.05)


def test_bpe_tokenizer_trains_locally_and_is_cached(corpus_file, tmp_path):
    pytest.importorskip("tokenizers")
    cfg = load_config(None, [f"data.corpus={str(corpus_file)!r}", f"data.cache_dir={str(tmp_path)!r}",
                             "data.tokenizer='bpe'", "data.bpe_vocab_size=512"])
    tok = make_tokenizer(cfg)
    assert tok.vocab_size == 512
    text = "def parse_args(self, args=None):\n    return 42\n"
    assert tok.decode(tok.encode(text.encode())) == text
    assert len(tok.encode(text.encode())) < len(text)  # merges compress
    ds = prepare_data(cfg)
    assert ds.tokenizer.name == tok.name and ds.n_tokens < os.path.getsize(corpus_file)


def test_the_bpe_trainer_gets_long_runs_without_whitespace_in_pieces():
    """Its merge counting is quadratic in a word's length: a megabyte without a space would train for hours.
    Text with no such run reaches it unchanged (the same merges as before the cut existed)."""
    from stratum.data.tokenizer import LONGEST_WORD, bounded_words

    plain = "def f(x):\n    return x  # " + "y" * LONGEST_WORD + "\n"
    assert list(bounded_words([plain])) == [plain]
    run = "A" * (2 * LONGEST_WORD + 5)
    pieces = list(bounded_words([f"head {run} tail"]))
    assert pieces == ["head ", "A" * LONGEST_WORD, "A" * LONGEST_WORD, "A" * 5, " tail"]
    assert "".join(pieces) == f"head {run} tail"


def test_bpe_trains_on_a_corpus_of_one_megabyte_word(tmp_path):
    pytest.importorskip("tokenizers")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("x" * 1_000_000 + " def f(): pass\n" * 100)
    cfg = load_config(None, [f"data.corpus={str(tmp_path / 'corpus')!r}", f"data.cache_dir={str(tmp_path)!r}",
                             "data.tokenizer='bpe'", "data.bpe_vocab_size=300"])
    tok = make_tokenizer(cfg)
    assert tok.decode(tok.encode(b"xxxx def f(): pass")) == "xxxx def f(): pass"
