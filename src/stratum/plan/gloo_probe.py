"""Time a gloo all-reduce between two local processes: what ``stratum hardware probe`` reads the intra-node link
from. Each process is a fresh interpreter (``spawn``); every wait is bounded by ``timeout_s``."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stratum.dist.launch import free_port
from stratum.errors import StratumError

REPEATS = 10


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


def _worker(rank: int, port: int, sizes: tuple[int, ...], timeout_s: float, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        times = [_best_s(n) for n in sizes]
        if rank == 0:
            out.put(times)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def allreduce_times(*sizes: int, timeout_s: float) -> tuple[float, ...]:
    """Best-of-``REPEATS`` seconds of a 2-process gloo all-reduce of each of ``sizes`` bytes."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = mp.start_processes(_worker, args=(free_port(), sizes, timeout_s, out), nprocs=2, join=False,
                               start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not procs.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise StratumError(f"the gloo all-reduce probe did not finish within {timeout_s:g} s")
    except mp.ProcessRaisedException as e:
        raise StratumError(f"the gloo all-reduce probe failed: {str(e).strip().splitlines()[-1]}") from None
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
    if out.empty():
        raise StratumError("the gloo all-reduce probe ended without a result")
    return tuple(out.get())
