"""Measure a machine as a job's local processes see it: ``n`` processes started together, each timing its
matrix-multiply rate while the others run theirs (so the rate includes what they and the machine's other load
take from it), then a gloo all-reduce over all of them. What ``stratum hardware probe`` reads the CPU devices'
speeds and the intra-node link from. The processes are forked from the warm forkserver (:func:`run_forked`);
every wait is bounded by ``timeout_s``."""

from __future__ import annotations

import datetime
import multiprocessing.connection
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from stratum.dist.forked import context, start_forked
from stratum.dist.launch import check_local_count, free_port
from stratum.errors import StratumError
from stratum.runtime.device import compute_rate

REPEATS = 10
RATE_SECONDS = 0.5
PRELOAD = ("torch", "torch.distributed")
"""What the forkserver imports once for the probes' processes (those of a run's ranks join the list)."""


@dataclass(frozen=True, kw_only=True)
class ProcessProbe:
    rates: tuple[float, ...]
    """Matrix-multiply GFLOP/s of every process, measured while all of them ran."""
    allreduce_s: tuple[float, ...]
    """Best-of-``REPEATS`` seconds of an all-reduce over all processes, one per buffer size asked for."""


def _best_s(n: int) -> float:
    buf = torch.ones(max(1, n // 4))
    dist.all_reduce(buf)  # warm-up: the first call sets the pairs up
    best = float("inf")
    for _ in range(REPEATS):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        best = min(best, time.perf_counter() - t0)
    return best


def _worker(rank: int, world: int, port: int, threads: int, sizes: tuple[int, ...], timeout_s: float, out) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        dist.barrier()  # the rates are measured together
        out.put(("rate", rank, compute_rate(torch.device("cpu"), seconds=RATE_SECONDS)))
        times = [_best_s(n) for n in sizes]
        if rank == 0:
            out.put(("allreduce", 0, times))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_one(worker: Callable[..., None], rank: int, args: tuple, out) -> None:
    """One probe process: ``worker(rank, *args, out)``; what it raises goes to ``out`` for the parent to say."""
    try:
        worker(rank, *args, out)
    except BaseException as e:
        text = str(e).strip()
        out.put(("failed", rank, f"{type(e).__name__}: {text.splitlines()[-1] if text else '(no message)'}"))
        raise SystemExit(1) from None


def run_forked(worker: Callable[..., None], n: int, args: tuple, *, timeout_s: float, what: str) -> list[tuple]:
    """Run ``worker(rank, *args, out)`` in ``n`` processes and return what they put on ``out``, once every one
    has ended; a process that fails or a run past ``timeout_s`` is a one-line StratumError naming ``what``, and no
    process is left behind. ``worker`` and ``args`` travel pickled.

    The processes are forked from the warm forkserver (:mod:`stratum.dist.forked`), not from this process: this
    one has run its own matrix multiplies (a profile, the step probe) by now, and a child forked after OpenMP's
    threads started hangs in its first multi-threaded operation (GNU libgomp is not fork-safe). The server has
    imported torch but never computed."""
    ctx = context(PRELOAD)
    out = ctx.SimpleQueue()
    procs = [start_forked(_run_one, (worker, rank, args, out), name=f"stratum-probe-{rank}", preload=PRELOAD,
                          death_signal=signal.SIGKILL) for rank in range(n)]
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.exitcode is None for p in procs) and not any(p.exitcode for p in procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise StratumError(f"{what} did not finish within {timeout_s:g} s")
            multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=left)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join(timeout=10)
    items = []
    while not out.empty():
        items.append(out.get())
    failed = [x[2] for x in items if x[0] == "failed"]
    if failed:
        raise StratumError(f"{what} failed: {failed[0]}")
    if any(p.exitcode for p in procs):
        code = next(p.exitcode for p in procs if p.exitcode)
        raise StratumError(f"{what} failed: a process ended with exit code {code}")
    return items


def probe_processes(n: int, *, threads: int, sizes: tuple[int, ...], timeout_s: float) -> ProcessProbe:
    """Start ``n`` (>= 2) processes of ``threads`` threads each; their rates and all-reduce times."""
    if n < 2:
        raise StratumError(f"the process probe needs at least 2 processes, got {n}")
    check_local_count(n)
    items = run_forked(_worker, n, (n, free_port(), threads, sizes, timeout_s), timeout_s=timeout_s,
                       what="the process probe")
    rates = {rank: value for kind, rank, value in items if kind == "rate"}
    times: list[float] = next((value for kind, _, value in items if kind == "allreduce"), [])
    if len(rates) != n or len(times) != len(sizes):
        raise StratumError("the process probe ended without all of its results")
    return ProcessProbe(rates=tuple(rates[r] for r in range(n)), allreduce_s=tuple(times))
