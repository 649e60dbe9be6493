"""Multiplexing: a background job (train.priority = background) beside a foreground job — both finish with their
standalone losses; the background really runs under SCHED_IDLE."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stratum.config import load_config
from stratum.errors import StratumError
from stratum.train.trainer import read_metrics, train


def overrides(corpus_file: Path, cache_dir: Path, out: Path, *extra: str) -> list[str]:
    return [f"data.corpus={str(corpus_file)!r}", f"data.cache_dir={str(cache_dir)!r}", "data.seq_len=16",
            "model.preset='tiny'", "train.micro_batch_size=4", "train.steps=4", "train.eval_interval=0",
            "train.eval_batches=2", "optim.warmup_steps=2", "optim.lr=3e-3", f"train.out_dir={str(out)!r}", *extra]


def start(sets: list[str]) -> subprocess.Popen:
    argv = [sys.executable, "-m", "stratum", "train"]
    for s in sets:
        argv += ["--set", s]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
@pytest.mark.timeout(180)
def test_background_and_foreground_finish_with_their_standalone_losses(corpus_file, cache_dir, tmp_path):
    # Both jobs train the same model on the same data, so one standalone run (in this process) is the reference
    # of both. The foreground runs in this process at normal priority while the background job runs beside it
    # under SCHED_IDLE. (A burst foreground's idle ranks are what the background fills in
    # benchmarks/multiplex_bench.py; here one process keeps the test's start-up cost to one process.)
    alone = tmp_path / "alone"
    train(load_config(None, overrides(corpus_file, cache_dir, alone)))
    bg = start(overrides(corpus_file, cache_dir, tmp_path / "bg", "train.priority='background'"))
    try:
        train(load_config(None, overrides(corpus_file, cache_dir, tmp_path / "fg")))
        bg_out = bg.communicate(timeout=150)[0]
    finally:
        if bg.poll() is None:
            bg.kill()
            bg.wait(timeout=10)
    assert bg.returncode == 0, bg_out[-3000:]
    assert "priority: background (SCHED_IDLE" in bg_out
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the foreground (this process) kept its priority
    want = losses(alone)
    assert len(want) == 4
    assert losses(tmp_path / "bg") == pytest.approx(want, rel=1e-6)
    assert losses(tmp_path / "fg") == pytest.approx(want, rel=1e-6)


def test_an_unknown_priority_is_one_line():
    with pytest.raises(StratumError, match="train.priority") as e:
        load_config(None, ["train.priority='low'"])
    assert "\n" not in str(e.value)
