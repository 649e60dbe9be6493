"""Nothing lost on Ctrl-C: SIGINT/SIGTERM to a real `stratum train` stops it after the step in progress with a
checkpoint, and the same command resumes there, on the plain engine and across the ranks of a pipeline; the
time-based checkpoint interval; a run refused for bad input leaves no empty out_dir behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratum.cli import main
from stratum.train.checkpoint import latest_checkpoint, load_checkpoint
from stratum.train.trainer import read_metrics, train


def _args(corpus_file, cache_dir, out, *extra: str) -> list[str]:
    sets = [f"data.corpus={str(corpus_file)!r}", f"data.cache_dir={str(cache_dir)!r}", "model.preset='tiny'",
            "data.seq_len=32", "train.micro_batch_size=4", "train.steps=400", "train.eval_interval=0",
            "train.eval_batches=2", "optim.lr=3e-3", f"train.out_dir={str(out)!r}", *extra]
    return ["train"] + [x for s in sets for x in ("--set", s)]


def to_group(sig: int):
    """Send ``sig`` to the job's process group, as a terminal's Ctrl-C reaches every process of the job."""
    return lambda p: os.killpg(p.pid, sig)


def to_launcher(sig: int):
    """Send ``sig`` to the `stratum` process alone, as `kill PID` does."""
    return lambda p: p.send_signal(sig)


def _run_until_steps(argv: list[str], out: Path, steps: int, send) -> tuple[subprocess.CompletedProcess, int]:
    """Start `stratum <argv>` in a process group of its own, ``send(process)`` a signal once ``steps`` steps are
    in metrics.jsonl; (the finished process, the number of steps recorded when the signal was sent)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "stratum", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, start_new_session=True)
    deadline = time.monotonic() + 240
    seen = 0
    while time.monotonic() < deadline and p.poll() is None:
        seen = len(read_metrics(out))
        if seen >= steps:
            break
        time.sleep(0.05)
    assert p.poll() is None, p.communicate()
    send(p)
    stdout, stderr = p.communicate(timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr), seen


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_checkpoints_and_the_same_command_resumes_there(corpus_file, cache_dir, tmp_path, sig):
    out = tmp_path / "run"
    argv = _args(corpus_file, cache_dir, out)
    res, seen = _run_until_steps(argv, out, 3, to_group(sig))
    assert res.returncode == 130, res.stderr
    assert "Traceback" not in res.stderr and signal.Signals(sig).name in res.stderr
    ckpt = latest_checkpoint(out)
    done = len(read_metrics(out))
    assert ckpt is not None and load_checkpoint(ckpt).step == done and 3 <= done < 400
    assert f"at step {done} of 400, with a checkpoint" in res.stdout
    assert json.loads((out / "summary.json").read_text())["steps_done"] == done

    # the same command (plus a stop) resumes at the checkpoint, and matches a run that was never interrupted
    assert main([*argv, "--stop-at", str(done + 2)]) == 0
    resumed = read_metrics(out)
    assert [r["step"] for r in resumed] == list(range(1, done + 3))
    ref = tmp_path / "ref"
    assert main([*_args(corpus_file, cache_dir, ref), "--stop-at", str(done + 2)]) == 0
    assert [r["loss"] for r in resumed] == [r["loss"] for r in read_metrics(ref)]


@pytest.mark.slow
@pytest.mark.parametrize("send, said", [(to_group(signal.SIGINT), "SIGINT"), (to_launcher(signal.SIGTERM), "SIGTERM")],
                         ids=["ctrl-c-to-every-process", "sigterm-to-the-launcher"])
def test_a_signal_to_a_pipeline_run_checkpoints_every_rank_consistently(corpus_file, cache_dir, tmp_path, send,
                                                                        said):
    """Ctrl-C reaches the launcher and both ranks (and the launcher forwards it once more); SIGTERM to the
    launcher alone is forwarded as SIGTERM. The ranks agree on the step, rank 0 writes one checkpoint, every process exits
    cleanly, and the run resumes from it."""
    out = tmp_path / "run"
    argv = _args(corpus_file, cache_dir, out, "train.engine='pipeline'", "pipeline.ranks=2", "train.grad_accum=2")
    res, _ = _run_until_steps(argv, out, 2, send)
    assert res.returncode == 130, res.stderr
    assert "Traceback" not in res.stderr
    assert f"stopped by {said} at step" in res.stdout + res.stderr, res.stdout + res.stderr
    assert (res.stdout + res.stderr).count("stopping after this step") == 1, res.stderr  # rank 0's, for all
    done = len(read_metrics(out))
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and load_checkpoint(ckpt).step == done
    assert not list((out / "checkpoints").glob("*.tmp*"))
    assert main([*argv, "--stop-at", str(done + 1)]) == 0
    assert [r["step"] for r in read_metrics(out)] == list(range(1, done + 2))


def test_checkpoints_are_also_saved_by_time(make_cfg, monkeypatch):
    """train.ckpt_minutes: a checkpoint whenever that much time has passed since the last one (a fake clock:
    each reading 61 s after the one before, so one is due after every step)."""
    from stratum.train import stopping
    clock = iter(range(0, 10**6, 61))
    monkeypatch.setattr(stopping.time, "monotonic", lambda: float(next(clock)))
    cfg = make_cfg("train.steps=5", "train.ckpt_minutes=1.0", "train.keep_checkpoints=10")
    train(cfg, stop_at=4)
    steps = sorted(load_checkpoint(p).step for p in (Path(cfg.train.out_dir) / "checkpoints").glob("step_*"))
    assert steps == [1, 2, 3, 4]


def test_no_checkpoint_by_time_before_it_is_due(make_cfg):
    cfg = make_cfg("train.steps=5", "train.keep_checkpoints=10")  # the default: 10 minutes
    assert cfg.train.ckpt_minutes == 10.0
    train(cfg, stop_at=4)
    steps = [load_checkpoint(p).step for p in (Path(cfg.train.out_dir) / "checkpoints").glob("step_*")]
    assert steps == [4]


def test_a_refused_run_leaves_no_empty_out_dir_and_keeps_what_was_there(corpus_file, cache_dir, tmp_path, capsys):
    new = tmp_path / "new" / "deeper" / "run"
    bad = ["--set", "model.vocab_size=100"]  # refused when the model is built, after out_dir is made
    assert main([*_args(corpus_file, cache_dir, new), *bad]) == 2
    assert "smaller than the tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()

    old = tmp_path / "old"
    old.mkdir()
    (old / "notes.txt").write_text("mine")
    (old / "empty-before").mkdir()
    assert main([*_args(corpus_file, cache_dir, old), *bad]) == 2
    assert (old / "notes.txt").read_text() == "mine" and (old / "empty-before").is_dir()


@pytest.mark.slow
def test_a_multi_process_run_refused_by_its_workers_leaves_no_empty_out_dir(corpus_file, cache_dir, tmp_path):
    """The launcher makes out_dir; the workers find the bad input (building the model) and exit with code 2."""
    new = tmp_path / "new" / "run"
    argv = _args(corpus_file, cache_dir, new, "train.engine='pipeline'", "pipeline.ranks=2", "model.vocab_size=100")
    res = subprocess.run([sys.executable, "-m", "stratum", *argv], capture_output=True, text=True, timeout=240)
    assert res.returncode == 2 and "smaller than the tokenizer" in res.stderr, res.stderr
    assert not (tmp_path / "new").exists()
