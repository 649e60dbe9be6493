"""Multiplexing: a background job (train.priority = background) beside a foreground job — both finish with their
standalone losses; the background really runs under SCHED_IDLE; a foreground job's kernels take the highest CUDA
stream priority on a GPU (STRATUM_TEST_DEVICE=cuda) and nothing else about it changes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stratum.config import load_config
from stratum.errors import StratumError
from stratum.parallel.multiplex import HIGHEST_STREAM_PRIORITY, apply_priority, priority_stream
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


DEV = torch.device(os.environ.get("STRATUM_TEST_DEVICE", "cpu"))


@pytest.mark.timeout(120)
def test_a_foreground_run_keeps_its_losses_and_its_kernels_take_the_highest_stream(corpus_file, cache_dir,
                                                                                    tmp_path):
    device, nice = f"train.device={DEV.type!r}", os.getpriority(os.PRIO_PROCESS, 0)
    train(load_config(None, overrides(corpus_file, cache_dir, tmp_path / "normal", device)))
    streams: list[tuple[int, int]] = []

    def seen(step: int) -> None:
        if DEV.type == "cuda":
            current = torch.cuda.current_stream(DEV)
            streams.append((current.cuda_stream, current.priority))

    train(load_config(None, overrides(corpus_file, cache_dir, tmp_path / "fg", device,
                                      "train.priority='foreground'")), after_step=seen)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER and os.getpriority(os.PRIO_PROCESS, 0) == nice
    want = losses(tmp_path / "normal")
    # the same kernels in the same order; on a GPU the embedding's backward sums by atomics, in any order
    assert losses(tmp_path / "fg") == (pytest.approx(want, rel=1e-6) if DEV.type == "cuda" else want)
    if DEV.type == "cuda":
        highest = torch.cuda.Stream(DEV, priority=HIGHEST_STREAM_PRIORITY).priority
        default = torch.cuda.default_stream(DEV)
        assert highest < default.priority  # lower numbers go first: the device has a range at all
        assert len(streams) == 4 and {p for _, p in streams} == {highest}
        assert default.cuda_stream not in {s for s, _ in streams}
        assert torch.cuda.current_stream(DEV).cuda_stream == default.cuda_stream  # left as it was after the run


def test_foreground_changes_nothing_of_the_os_priority_nor_a_cpu_run_stream():
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    line = apply_priority("foreground", torch.device("cpu"))
    assert line.startswith("priority: foreground (normal OS priority")
    assert os.sched_getscheduler(0) == os.SCHED_OTHER and os.getpriority(os.PRIO_PROCESS, 0) == nice
    assert isinstance(priority_stream("foreground", torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(priority_stream("background", torch.device("cpu")), contextlib.nullcontext)
    assert "highest priority" in apply_priority("foreground", torch.device("cuda", 0))
    assert apply_priority("normal", torch.device("cpu")) == ""
