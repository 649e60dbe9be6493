"""Multi-process runs end to end through ``stratum train``: parity with the plain engine through the trainer,
checkpoints across engines, and a dead or hung rank stopping the others with a clear error within 60 s, under
the pipeline engine and the other layouts (replicate with Adasum, split, split over offload, burst)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_in_process import run_main

from stratum.train.checkpoint import latest_checkpoint, load_checkpoint
from stratum.train.trainer import read_metrics, train


@pytest.fixture(autouse=True)
def _one_thread():
    """In-process reference runs of tiny models: one thread is fastest and does not fight the workers."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _args(cfg, *extra: str) -> list[str]:
    """``stratum train`` arguments reproducing the fixture config ``cfg`` plus ``extra`` overrides."""
    d, t = cfg.data, cfg.train
    base = [f"data.corpus={d.corpus!r}", f"data.cache_dir={d.cache_dir!r}", f"data.seq_len={d.seq_len}",
            f"model.preset={cfg.model.preset!r}", f"train.micro_batch_size={t.micro_batch_size}",
            f"train.steps={t.steps}", f"train.eval_interval={t.eval_interval}",
            f"train.eval_batches={t.eval_batches}", f"optim.warmup_steps={cfg.optim.warmup_steps}",
            f"optim.lr={cfg.optim.lr}", f"train.grad_accum={t.grad_accum}", f"train.out_dir={t.out_dir!r}"]
    out = ["train"]
    for o in base + list(extra):
        out += ["--set", o]
    return out


def _stratum(args: list[str], *, env: dict | None = None, timeout: float = 150) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "stratum", *args], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, **(env or {})))
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_pipeline_run_matches_plain_and_resumes_across_engines(make_cfg, tmp_path):
    """`stratum train` (run in this process: cli_in_process.py) spawns 2 ranks itself; losses equal the plain
    engine's; a plain checkpoint resumes under the pipeline engine and continues exactly like an uninterrupted
    plain run."""
    steps = ["train.steps=6", "train.grad_accum=4", "train.eval_interval=3"]
    plain = make_cfg(*steps, out=tmp_path / "plain")
    train(plain)
    want = read_metrics(tmp_path / "plain")

    pipe = make_cfg(*steps, out=tmp_path / "pipe")
    code, out = run_main(_args(pipe, "train.engine='pipeline'", "pipeline.ranks=2", "pipeline.schedule='zb-1f1b'"))
    assert code == 0, out
    got = read_metrics(tmp_path / "pipe")
    assert [r["step"] for r in got] == list(range(1, 7))
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        if "eval_loss" in w:
            assert g["eval_loss"] == pytest.approx(w["eval_loss"], rel=1e-5)
    assert out.count("done:") == 1  # only rank 0 prints
    # the pipeline checkpoint holds the full, placement-independent state
    ck = load_checkpoint(latest_checkpoint(tmp_path / "pipe"))
    ref = load_checkpoint(latest_checkpoint(tmp_path / "plain"))
    assert ck.state.params.keys() == ref.state.params.keys()
    assert ck.state.optim.keys() == ref.state.optim.keys()

    # plain for 3 steps, then the pipeline (wave: 4 stages on 2 ranks) resumes to 6
    mixed = make_cfg(*steps, out=tmp_path / "mixed")
    train(mixed, stop_at=3)
    code, out = run_main(_args(mixed, "train.engine='pipeline'", "pipeline.ranks=2", "pipeline.schedule='wave'"))
    assert code == 0, out
    resumed = read_metrics(tmp_path / "mixed")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for g, w in zip(resumed, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_dead_or_hung_rank_stops_the_others_with_a_clear_error(make_cfg, tmp_path, mode):
    cfg = make_cfg("train.steps=50", "train.grad_accum=3", out=tmp_path / "run")
    # kill: rank 1 of 3 dies (SIGKILL) before its 4th action of step 2; hang: rank 1 of 2 stops (SIGSTOP) there
    fault = "1:2:3" + (":stop" if mode == "hang" else "")
    ranks = 3 if mode == "kill" else 2
    mark = tmp_path / "fault_time"
    code, out, err, wall = _stratum(_args(cfg, "train.engine='pipeline'", f"pipeline.ranks={ranks}",
                                          "pipeline.timeout_s=4"),
                                    env={"STRATUM_TEST_FAULT": fault, "STRATUM_TEST_FAULT_FILE": str(mark)},
                                    timeout=150)
    ended = time.time()
    assert code != 0
    assert mark.exists(), err
    after = ended - float(mark.read_text())
    limit = 4 + 10 if mode == "hang" else 60  # a stopped rank: within pipeline.timeout_s + 10 s (issue 16)
    assert after < limit, f"the other ranks took {after:.0f} s to stop after the fault"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert any(ln.startswith("stratum: error: rank 0:") and ("died or hung" in ln) for ln in lines), err
    if mode == "kill":
        assert "stratum: error: rank 1 was killed by SIGKILL" in err
        assert code == 3
    else:
        assert code == 3
    assert all(ln.startswith("stratum: error:") for ln in lines), err


def _rank_pids(launcher: int, n: int) -> list[int] | None:
    """The process ids of the ``n`` ranks ``stratum train`` (process ``launcher``) started, in rank order, or None
    before they all exist: the ranks are forked from the launcher's forkserver (dist/forked.py) one after another,
    so they are its children in start order. Read from /proc (psutil is not a dependency)."""
    def children(pid: int) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            try:
                stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
            if fields and int(fields[1]) == pid:
                found.append((int(fields[19]), int(entry)))  # (start time, pid)
        return [p for _, p in sorted(found)]

    servers = [kids for child in children(launcher) if len(kids := children(child)) >= n]
    return servers[0][:n] if servers else None


def _lines(path: Path) -> int:
    """Complete lines in ``path`` so far (0 before it exists)."""
    try:
        return path.read_text().count("\n")
    except OSError:
        return 0


# Layouts beside the pipeline engine's (above): a rank killed mid-run, and a hung one under split, whose DTensor
# collectives run inside the layers' forward and backward rather than through World.wait.
_LAYOUTS = [("replicate(2, reduce=adasum)", "kill"), ("split(2)", "kill"), ("split(2, offload())", "kill"),
            ("burst(2, widths=1:2:2:1)", "kill"), ("split(2)", "hang")]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("plan", "mode"), _LAYOUTS, ids=[f"{p}-{m}" for p, m in _LAYOUTS])
def test_a_dead_or_hung_rank_stops_every_layout_and_the_run_resumes(make_cfg, tmp_path, plan, mode):
    """Rank 1 gets SIGKILL (or SIGSTOP) from outside after step 3, a checkpoint written at step 2: rank 0 stops
    within parallel.timeout_s (+ the launcher's grace for a stopped rank) with one line, exit code 3, no
    traceback; the checkpoints written before stay loadable and a rerun resumes from the last."""
    out = tmp_path / "run"
    cfg = make_cfg("train.steps=400", out=out)
    args = _args(cfg, f"parallel.plan={plan!r}", "parallel.timeout_s=4", "train.ckpt_interval=2")
    p = subprocess.Popen([sys.executable, "-m", "stratum", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        ranks = None
        while p.poll() is None and not (ranks and _lines(out / "metrics.jsonl") >= 3):
            time.sleep(0.1)
            ranks = ranks or _rank_pids(p.pid, 2)
        assert p.poll() is None and ranks, p.communicate()[1]
        os.kill(ranks[1], signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        faulted = time.monotonic()
        err = p.communicate(timeout=60)[1]
        after = time.monotonic() - faulted
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert after < (4 + 10 if mode == "hang" else 30), f"the other ranks took {after:.0f} s to stop after the fault"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode == 3 and "Traceback" not in err, err
    assert all(ln.startswith("stratum: error:") for ln in lines), err
    assert any(ln.startswith("stratum: error: rank 0:") and "died or hung" in ln for ln in lines), err
    if mode == "kill":
        assert "stratum: error: rank 1 was killed by SIGKILL" in err
    ckpt = load_checkpoint(latest_checkpoint(out))
    assert ckpt.step >= 2 and ckpt.step % 2 == 0
    if mode == "hang":  # the rerun continues from that checkpoint, to two steps past it
        code, _, err, _ = _stratum(_args(cfg, f"parallel.plan={plan!r}", f"train.steps={ckpt.step + 2}"))
        assert code == 0, err
        assert [r["step"] for r in read_metrics(out)] == list(range(1, ckpt.step + 3))


def test_only_the_backends_reports_of_a_failed_exchange_count_as_a_peers_failure():
    """The trainer turns these into one line (a PeerError); any other RuntimeError is the rank's own bug and keeps
    its traceback."""
    import torch.distributed as dist

    from stratum.dist.launch import from_backend
    gloo = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset"
    assert from_backend(RuntimeError(gloo))
    assert from_backend(RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out"))
    assert from_backend(dist.DistBackendError("NCCL communicator was aborted"))
    assert not from_backend(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x64 and 32x64)"))
    assert not from_backend(RuntimeError("[enforce fail at alloc_cpu.cpp:117] not enough memory"))
    assert not from_backend(ValueError(gloo))
