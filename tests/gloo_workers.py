"""Run a test file as N real gloo worker processes (RANK/WORLD_SIZE/MASTER_* set, one intra-op thread each), as the
distributed parity tests do: one job of N processes runs every case, so process start-up is paid once. The workers
are forked from the warm forkserver ``stratum train`` forks its ranks from (dist/forked_rank.py): each runs
``python script job`` as that interpreter would, without paying torch's imports again."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from stratum.dist.forked_rank import ForkedRank
from stratum.dist.launch import free_port


def run_workers(script: str, job: Path, world: int, timeout: float) -> None:
    """``python script job`` as ranks 0..world-1; every rank must exit 0 within ``timeout`` seconds (the others are
    killed when one overruns), else the assertion shows each rank's exit code and last output (its stderr; what
    it prints to stdout goes to the test's)."""
    port = free_port()
    procs = []
    with ThreadPoolExecutor(max_workers=world) as readers:
        outs = []
        try:
            for r in range(world):
                env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
                procs.append(ForkedRank([script, str(job)], env, name=f"gloo-worker-{r}"))
                outs.append(readers.submit(procs[-1].stderr.read))  # read as it comes: a full pipe would block
            deadline = time.monotonic() + timeout
            for p in procs:
                p.wait(timeout=max(1, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
        codes = [p.returncode for p in procs]
        texts = [o.result(timeout=10) for o in outs]
        for p in procs:
            p.stderr.close()
    assert codes == [0] * world, "\n".join(f"rank {r} (exit {c}):\n{o[-3000:]}"
                                           for r, (c, o) in enumerate(zip(codes, texts)))
