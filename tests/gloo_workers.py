"""Run a test file as N real gloo worker processes (RANK/WORLD_SIZE/MASTER_* set, one intra-op thread each), as the
distributed parity tests do: one job of N processes runs every case, so process start-up is paid once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from stratum.dist.launch import free_port


def run_workers(script: str, job: Path, world: int, timeout: float) -> None:
    """``python script job`` as ranks 0..world-1; every rank must exit 0 within ``timeout`` seconds (the others are
    killed when one overruns), else the assertion shows each rank's exit code and last output."""
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, script, str(job)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    codes = [p.returncode for p in procs]
    assert codes == [0] * world, "\n".join(f"rank {r} (exit {c}):\n{o[-3000:]}"
                                           for r, (c, o) in enumerate(zip(codes, outs)))
