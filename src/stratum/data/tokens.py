"""Token cache (a memory-mapped file per corpus × tokenizer) and the batch sampler.

Batches are a pure function of (seed, step): the sequences of step ``s`` start at offsets drawn from a generator
seeded with ``[seed, split, s]``, so a resumed run, or a run on another engine or another number of processes,
sees exactly the batches the reference run saw. The last ``val_fraction`` of the tokens is the validation split.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from stratum.atomic import (
    WriteError,
    atomic_write_json,
    atomic_write_stream,
    digest_mismatch,
    file_digest,
    missing_dirs,
    remove_empty_dirs,
)
from stratum.data.corpus import Corpus
from stratum.data.tokenizer import Tokenizer
from stratum.errors import StratumError
from stratum.seeds import mix

TRAIN, VAL = 0, 1


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32)


def build_token_cache(corpus: Corpus, tokenizer: Tokenizer, cache_dir: Path) -> np.memmap:
    """Tokenize the corpus once into ``cache_dir`` and memory-map the result (read-only)."""
    key = f"{tokenizer.name}-{corpus.fingerprint()}"
    path = cache_dir / f"tokens-{key}.bin"
    meta_path = path.with_suffix(".json")
    dtype = _token_dtype(tokenizer.vocab_size)
    if not (path.exists() and meta_path.exists()):
        made = missing_dirs(cache_dir)
        counted = [0]

        def pieces() -> Iterator[bytes]:
            for data in corpus.iter_bytes():
                ids = tokenizer.encode(data + b"\n")
                counted[0] += len(ids)
                yield np.asarray(ids, dtype=dtype).tobytes()

        try:
            atomic_write_stream(path, pieces(), "the token cache")
        except WriteError as e:
            remove_empty_dirs(made)
            raise StratumError(f"cannot write the token cache in {cache_dir} ({e.reason}); "
                               "set data.cache_dir to a writable directory with space") from None
        n = counted[0]
        atomic_write_json(meta_path, {"tokens": n, "dtype": dtype.name, "tokenizer": tokenizer.name,
                                      "corpus": corpus.spec, "files": len(corpus.files), **file_digest(path)})
    meta = _verified_meta(path, meta_path)
    if meta["tokens"] == 0:
        raise StratumError(f"data.corpus {corpus.spec!r} gave no tokens")
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["tokens"],))


def _verified_meta(path: Path, meta_path: Path) -> dict:
    """The token cache's metadata, after checking that ``path`` is the file it describes (size and SHA-256)."""
    def corrupt(file: Path, why: str) -> StratumError:
        return StratumError(f"token cache file {file} is corrupt ({why}); delete {path.name} and {meta_path.name} "
                            f"in {path.parent} and run again to rebuild it")

    try:
        meta = json.loads(meta_path.read_text())
        ok = (isinstance(meta, dict) and isinstance(meta.get("tokens"), int) and meta["tokens"] >= 0
              and meta.get("dtype") in ("uint8", "uint16", "uint32"))
    except (OSError, ValueError) as e:
        raise corrupt(meta_path, f"unreadable: {e}") from None
    if not ok:
        raise corrupt(meta_path, "its tokens or dtype field is missing or wrong")
    if "sha256" in meta:  # caches written before checksums were recorded are checked for size only
        if (why := digest_mismatch(path, meta)) is not None:
            raise corrupt(path, why)
    elif path.stat().st_size != meta["tokens"] * np.dtype(meta["dtype"]).itemsize:
        raise corrupt(path, f"{path.stat().st_size:,} bytes for {meta['tokens']:,} {meta['dtype']} tokens")
    return meta


@dataclass
class Batch:
    """One micro-batch: inputs ``x`` and next-token targets ``y``, both (B, T) int64 on the CPU."""

    x: torch.Tensor
    y: torch.Tensor
    stream: int | None = None
    """Dropout stream of this micro-batch (:mod:`stratum.model.streams`): a pure function of (seed, step, index in
    the step), so every engine draws the same masks for it; None draws from the global RNG."""

    @property
    def tokens(self) -> int:
        return self.y.numel()


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens, addressed by (split, step, row)."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, seed: int, val_fraction: float):
        n_val = int(len(tokens) * val_fraction)
        self.splits = (tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:])
        self.seq_len = seq_len
        self.seed = seed
        need = seq_len + 1
        for name, split in zip(("training", "validation"), self.splits):
            if name == "validation" and val_fraction == 0:
                continue
            if len(split) < need:
                raise StratumError(
                    f"the corpus' {name} split has {len(split)} tokens, fewer than one sequence "
                    f"(data.seq_len + 1 = {need}); use a larger corpus, a shorter data.seq_len"
                    + (", or a larger data.val_fraction" if name == "validation" else "")
                )

    def offsets(self, split: int, step: int, n: int) -> np.ndarray:
        """Start offsets of the ``n`` sequences of ``step``: depends on (seed, split, step) only."""
        rng = np.random.default_rng([self.seed, split, step])
        return rng.integers(0, len(self.splits[split]) - self.seq_len, size=n)

    def batch(self, split: int, step: int, n: int) -> Batch:
        """All ``n`` sequences of ``step`` as one batch."""
        data = self.splits[split]
        rows = np.stack([np.asarray(data[o: o + self.seq_len + 1], dtype=np.int64)
                         for o in self.offsets(split, step, n)])
        t = torch.from_numpy(rows)
        return Batch(x=t[:, :-1].contiguous(), y=t[:, 1:].contiguous())

    def micro_batches(self, split: int, step: int, micro_batch: int, count: int) -> list[Batch]:
        """The global batch of ``step`` (``micro_batch × count`` rows) cut into ``count`` micro-batches.

        Row ``r`` is the same whatever the cut, so engines that split the global batch differently (more
        accumulation steps, several data-parallel ranks) still see the same sequences.
        """
        full = self.batch(split, step, micro_batch * count)
        return [Batch(x=full.x[i * micro_batch:(i + 1) * micro_batch], y=full.y[i * micro_batch:(i + 1) * micro_batch],
                      stream=mix(self.seed, split, step, i)) for i in range(count)]
