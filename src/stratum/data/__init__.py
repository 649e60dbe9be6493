"""Corpora, tokenizers, the token cache and the batch sampler."""

from stratum.data.corpus import Corpus, resolve_corpus
from stratum.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer
from stratum.data.tokens import TRAIN, VAL, Batch, BatchSampler, build_token_cache

__all__ = ["Batch", "BatchSampler", "BPETokenizer", "ByteTokenizer", "Corpus", "TRAIN", "Tokenizer", "VAL",
           "build_token_cache", "resolve_corpus"]
