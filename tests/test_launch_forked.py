"""Ranks forked from the warm forkserver behave as the ``python <argv>`` processes they replace: the same argv,
environment, ``__main__``, streams, exit codes, atexit handlers; they die with their launcher. The exec path
(``STRATUM_SPAWN=exec``) is the oracle: the same script gives the same report there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratum.dist.launch import MAX_PER_CORE, spawn_local
from stratum.errors import StratumError
from stratum.procs import pid_alive

SCRIPT = r'''
import atexit, json, os, sys, threading, time
mode = sys.argv[1]
rank = int(os.environ["RANK"])
torch = sys.modules.get("torch")  # imported already in a forked rank; not imported here otherwise
report = dict(rank=rank, argv=sys.argv[1:], argv0=os.path.basename(sys.argv[0]), name=__name__,
              path0=sys.path[0], cwd=os.getcwd(), world=os.environ["WORLD_SIZE"], extra=os.environ.get("EXTRA"),
              omp=os.environ["OMP_NUM_THREADS"], worker=os.environ["STRATUM_WORKER"],
              torch_threads_ok=torch is None or torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"]))
atexit.register(lambda: sys.stdout.write(f"atexit {rank}\n"))  # unflushed: the exit must flush it
threading.Thread(target=lambda: (time.sleep(0.2), sys.stdout.write(f"thread {rank}\n"))).start()
if mode == "report":
    sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")
    sys.stderr.write(f"stratum: rank {rank} done\n")
elif mode == "fail" and rank == 1:
    sys.exit(int(sys.argv[2]))
elif mode == "raise" and rank == 1:
    raise ValueError("boom")
elif mode == "interrupt" and rank == 1:
    raise KeyboardInterrupt
elif mode == "sleep":
    open(os.path.join(sys.argv[2], f"pid{rank}"), "w").write(str(os.getpid()))
    time.sleep(120)
elif mode == "fail-one" and rank == 1:  # rank 0 carries on (hung, or waiting on rank 1 longer than the grace)
    sys.exit(3)
elif mode == "fail-one":
    time.sleep(120)
elif mode == "stopped":  # a requested stop, as the trainer ends one: a checkpoint, then exit 130
    sys.exit(130)
elif mode == "slow-stop":  # a stop signal finishes a step that outlasts the launcher's grace, then checkpoints
    import signal
    def stop(signum, frame):
        time.sleep(float(sys.argv[3]))
        open(os.path.join(sys.argv[2], f"stopped{rank}"), "w").write(signal.Signals(signum).name)
        sys.exit(130)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    open(os.path.join(sys.argv[2], f"pid{rank}"), "w").write(str(os.getpid()))
    time.sleep(120)
'''


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "scripts" / "rank_script.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def _run(script: Path, *args: str, capfd, **kw) -> tuple[int, str, str]:
    code = spawn_local([str(script), *args], 2, grace_s=30, fail_grace_s=5, env={"EXTRA": "x"}, **kw)
    out, err = capfd.readouterr()
    return code, out, err


def test_a_forked_rank_sees_and_ends_as_an_exec_rank(script, capfd, monkeypatch):
    reports = {}
    for mode in ("exec", "fork"):
        monkeypatch.setenv("STRATUM_SPAWN", mode)
        code, out, err = _run(script, "report", capfd=capfd)
        assert code == 0, err
        lines = out.splitlines()
        reports[mode] = sorted(ln for ln in lines if ln.startswith("{"))
        assert sorted(ln for ln in lines if not ln.startswith("{")) == ["atexit 0", "atexit 1", "thread 0",
                                                                        "thread 1"], out
        assert sorted(err.splitlines()) == ["stratum: rank 0 done", "stratum: rank 1 done"]
    assert reports["fork"] == reports["exec"]
    got = json.loads(reports["fork"][1])
    assert got["argv"] == ["report"] and got["argv0"] == "rank_script.py" and got["name"] == "__main__"
    assert got["path0"] == str(script.parent) and got["extra"] == "x" and got["torch_threads_ok"]

    monkeypatch.setenv("STRATUM_SPAWN", "fork")
    assert _run(script, "fail", "7", capfd=capfd)[0] == 7
    code, _, err = _run(script, "raise", capfd=capfd)
    assert code == 1 and "Traceback" in err and "ValueError: boom" in err
    code, _, err = _run(script, "interrupt", capfd=capfd)  # an uncaught Ctrl-C ends a rank by SIGINT
    assert code == 3 and "stratum: error: rank 1 was killed by SIGINT" in err


def test_ranks_that_stop_on_request_are_not_reported_as_failed(script, capfd, monkeypatch):
    """SIGTERM sent to one rank stops the job with a checkpoint (every rank exits 130): the exit code says so,
    and no rank is reported as having failed."""
    monkeypatch.setenv("STRATUM_SPAWN", "fork")
    code, _, err = _run(script, "stopped", capfd=capfd)
    assert code == 130 and "failed" not in err, err


def test_a_rank_still_running_after_a_peer_failed_is_named_as_it_is_killed(script, capfd, monkeypatch):
    monkeypatch.setenv("STRATUM_SPAWN", "fork")
    code, _, err = _run(script, "fail-one", capfd=capfd)
    assert code == 3 and "stratum: error: rank 0 had not ended 5 s after rank 1 stopped; it was killed" in err, err


LAUNCHER = """
import sys
from stratum.dist.launch import spawn_local
if __name__ == "__main__":  # (the ranks' forkserver imports this module as its __main__ too)
    try:
        spawn_local(sys.argv[1:], 2, grace_s=1.0)
    except KeyboardInterrupt:
        sys.exit(130)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stop_waits_for_the_ranks_step_however_long_it_takes(script, tmp_path, sig):
    """A stop forwarded to the ranks lets each finish its step and checkpoint, even past the launcher's grace
    (1 s here, the ranks' steps 3 s): the grace counts only once a rank has ended."""
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER)
    proc = subprocess.Popen([sys.executable, str(launcher), str(script), "slow-stop", str(tmp_path), "3"],
                            stderr=subprocess.PIPE, text=True)
    pids = [tmp_path / f"pid{r}" for r in range(2)]
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in pids):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    proc.send_signal(sig)
    assert proc.wait(30) == 130
    assert [(tmp_path / f"stopped{r}").read_text() for r in range(2)] == [sig.name, sig.name]


@pytest.mark.slow
def test_a_killed_launcher_takes_its_forked_ranks_with_it(script, tmp_path):
    """The launcher's own forkserver exits with it, and the ranks it forked get their death signal."""
    proc = subprocess.Popen([sys.executable, "-m", "stratum", "run", "--nproc", "2", str(script), "sleep",
                             str(tmp_path)], stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != "STRATUM_SPAWN"})
    pids = [tmp_path / f"pid{r}" for r in range(2)]
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in pids):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    ranks = [int(p.read_text()) for p in pids]
    assert all(os.getppid() != r for r in ranks)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 15
    while any(pid_alive(r) for r in ranks):
        assert time.monotonic() < deadline, "a rank outlived its killed launcher"
        time.sleep(0.05)


def test_more_local_processes_than_the_cores_can_take_are_refused_before_any_starts(script, tmp_path, capfd):
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(StratumError, match=rf"^{MAX_PER_CORE * cores + 1:,} local processes on {cores} usable "
                                           rf"core\(s\) is more than {MAX_PER_CORE} a core; use at most"):
        spawn_local([str(script), "sleep", str(tmp_path)], MAX_PER_CORE * cores + 1, grace_s=5)
    assert not list(tmp_path.glob("pid*"))  # no rank started


@pytest.mark.slow
def test_a_stopped_script_of_ones_own_is_not_promised_a_checkpoint(script, tmp_path):
    """`stratum run` runs the user's script, whose checkpoints (if any) are its own: the stop's line says only
    that it stopped."""
    proc = subprocess.Popen([sys.executable, "-m", "stratum", "run", "--nproc", "2", str(script), "sleep",
                             str(tmp_path)], stderr=subprocess.PIPE, text=True)
    pids = [tmp_path / f"pid{r}" for r in range(2)]
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in pids):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "stratum: interrupted" in err and "checkpoint" not in err, err
