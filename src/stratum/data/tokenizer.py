"""Tokenizers that need no download: bytes (vocabulary 256), or a byte-level BPE trained locally.

The BPE is trained with the ``tokenizers`` package on the run's own corpus and stored beside the token cache,
so a second run (or a resumed one) reuses the same merges.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from stratum.atomic import atomic_write_text
from stratum.errors import StratumError

logger = logging.getLogger(__name__)

LONGEST_WORD = 1000
"""Longest run without whitespace the BPE trainer is given whole. Counting a word's merges costs time quadratic in
its length, so a megabyte without a space (base64, a hex dump, a DNA sequence) would train for hours; a longer
run is given in pieces of this length. Words of text are far shorter, so their merges are those of the whole
file."""
_LONG_RUN = re.compile(rf"\S{{{LONGEST_WORD + 1},}}")


def bounded_words(texts: Iterable[str]) -> Iterator[str]:
    """``texts`` as the BPE trainer is given them: unchanged, except that a run of more than :data:`LONGEST_WORD`
    characters without whitespace is cut into pieces of that length, each given as a text of its own."""
    for text in texts:
        pos = 0
        for m in _LONG_RUN.finditer(text):
            yield text[pos:m.start()]
            yield from (m.group()[i:i + LONGEST_WORD] for i in range(0, len(m.group()), LONGEST_WORD))
            pos = m.end()
        yield text[pos:] if pos else text


class Tokenizer(Protocol):
    name: str
    """Identifies the tokenizer and its vocabulary (part of the token-cache key)."""
    vocab_size: int

    def encode(self, data: bytes) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """Each byte is a token: lossless on any input, nothing to train."""

    name = "byte"
    vocab_size = 256

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE from the ``tokenizers`` package, trained on the corpus on first use."""

    def __init__(self, tok, path: Path):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.name = f"bpe-{self.vocab_size}-{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"

    @classmethod
    def train_or_load(cls, path: Path, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        try:
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers import decoders, models, pre_tokenizers, trainers
        except ImportError:
            raise StratumError("data.tokenizer = 'bpe' needs the tokenizers package: "
                               "pip install 'stratum[bpe]'") from None
        if not path.exists():
            tok = HFTokenizer(models.BPE())
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
            logger.info(f"training a BPE of {vocab_size:,} tokens on the corpus (once; cached in {path.parent})")
            tok.train_from_iterator(bounded_words(texts), trainer=trainer)
            atomic_write_text(path, tok.to_str())
        try:
            loaded = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers package raises a bare Exception for a malformed file
            raise StratumError(f"tokenizer file {path} is corrupt ({str(e).splitlines()[0]}); delete it and run "
                               "again to retrain it") from None
        return cls(loaded, path)

    def encode(self, data: bytes) -> np.ndarray:
        ids = self._tok.encode(data.decode("utf-8", errors="replace")).ids
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def to_json(self) -> str:
        """The trained tokenizer in the ``tokenizers`` JSON format (a ``tokenizer.json`` transformers reads)."""
        return self._tok.to_str()


def tokenizer_id(tok: Tokenizer) -> str:
    """What identifies a tokenizer's mapping of text to ids: its name, and for a trained one the hash of its saved
    form (a BPE trained again on a changed corpus maps text to other ids under the same vocabulary size)."""
    if isinstance(tok, BPETokenizer):
        return f"bpe:{hashlib.sha256(tok.to_json().encode()).hexdigest()[:16]}"
    return tok.name
