"""Measure a machine as a job's local processes see it: ``n`` processes started together, each timing its
matrix-multiply rate while the others run theirs (so the rate includes what they and the machine's other load
take from it), then a gloo all-reduce over all of them. What ``stratum hardware probe`` reads the CPU devices'
speeds and the intra-node link from. The processes are forked (:data:`START`); every wait is bounded by
``timeout_s``."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stratum.dist.launch import check_local_count, free_port
from stratum.errors import StratumError
from stratum.runtime.device import compute_rate

REPEATS = 10
RATE_SECONDS = 0.5
START = "fork"
"""Forked children start at once; spawned ones would each import torch again (seconds on a busy machine). The
children only compute on the CPU and talk over gloo, which a fork leaves safe."""


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


def run_forked(worker: Callable[..., None], n: int, args: tuple, *, timeout_s: float, what: str) -> list[tuple]:
    """Run ``worker(rank, *args, out)`` in ``n`` forked processes (:data:`START`) and return what they put on
    ``out``, once every one has ended; a process that fails or a run past ``timeout_s`` is a one-line
    StratumError naming ``what``, and no process is left behind."""
    ctx = mp.get_context(START)
    out = ctx.SimpleQueue()
    procs = mp.start_processes(worker, args=(*args, out), nprocs=n, join=False, start_method=START)
    deadline = time.monotonic() + timeout_s
    try:
        while not procs.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise StratumError(f"{what} did not finish within {timeout_s:g} s")
    except mp.ProcessRaisedException as e:
        raise StratumError(f"{what} failed: {str(e).strip().splitlines()[-1]}") from None
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
    items = []
    while not out.empty():
        items.append(out.get())
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
