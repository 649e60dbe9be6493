"""Shared fixtures: a small real-text corpus, a private cache, and a fast training config."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest
import torch

from stratum.config import Config, load_config

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several test processes share the cores (`make test` runs two): one intra-op thread each, and the
    # processes tests spawn inherit it — threads of several processes waiting on each other's cores run many
    # times slower than one thread each.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    """About 300 KB of real text: a few standard-library modules, concatenated in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = [(stdlib / name).read_text() for name in ("argparse.py", "dataclasses.py", "textwrap.py",
                                                     "difflib.py")]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(parts))
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def make_cfg(corpus_file, cache_dir, tmp_path):
    """A fast config on the tiny GPT; extra ``section.key=value`` overrides win."""

    def make(*overrides: str, out: str | Path | None = None) -> Config:
        base = [
            f"data.corpus={str(corpus_file)!r}", f"data.cache_dir={str(cache_dir)!r}", "data.seq_len=32",
            "model.preset='tiny'", "train.micro_batch_size=4", "train.steps=8", "train.eval_interval=0",
            "train.eval_batches=2", "optim.warmup_steps=2", "optim.lr=3e-3",
            f"train.out_dir={str(out or tmp_path / 'run')!r}",
        ]
        return load_config(None, base + list(overrides))

    return make
