"""From a config to a tokenizer and a batch sampler (the corpus tokenized and cached once)."""

from __future__ import annotations

from dataclasses import dataclass

from stratum.config import Config
from stratum.data.corpus import Corpus, resolve_corpus
from stratum.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer
from stratum.data.tokens import BatchSampler, build_token_cache


@dataclass
class Dataset:
    corpus: Corpus
    tokenizer: Tokenizer
    sampler: BatchSampler
    n_tokens: int


def make_tokenizer(cfg: Config, corpus: Corpus | None = None) -> Tokenizer:
    """The configured tokenizer; a BPE is trained on the corpus the first time (then read from the cache)."""
    if cfg.data.tokenizer == "byte":
        return ByteTokenizer()
    corpus = corpus or resolve_corpus(cfg.data.corpus)
    path = cfg.cache_dir / f"bpe-{cfg.data.bpe_vocab_size}-{corpus.fingerprint()}.json"
    texts = (b.decode("utf-8", errors="replace") for b in corpus.iter_bytes())
    return BPETokenizer.train_or_load(path, texts, cfg.data.bpe_vocab_size)


def prepare_data(cfg: Config) -> Dataset:
    corpus = resolve_corpus(cfg.data.corpus)
    tok = make_tokenizer(cfg, corpus)
    tokens = build_token_cache(corpus, tok, cfg.cache_dir)
    sampler = BatchSampler(tokens, seq_len=cfg.data.seq_len, seed=cfg.train.seed,
                           val_fraction=cfg.data.val_fraction)
    return Dataset(corpus=corpus, tokenizer=tok, sampler=sampler, n_tokens=len(tokens))
