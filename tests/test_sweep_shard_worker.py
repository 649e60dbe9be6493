"""The shard worker's job threads: their dropout draws, each its own beside the others; their CUDA streams; a Ray
worker's devices."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import torch

from stratum.model.neutral import neutral
from stratum.model.streams import block_stream, thread_draws_nothing
from stratum.sweep.ray_backend import actor_devices
from stratum.sweep.shard_worker import job_stream


def _draw_blocks(stream: int, blocks: int, quiet: bool, out: list, start: threading.Barrier | None) -> None:
    """A job thread's block forwards, each drawing twice with a thread switch between (``quiet``: a model without
    dropout, which draws nothing), and a recompute's fork after each."""
    if quiet:
        thread_draws_nothing()
    if start is not None:
        start.wait()
    for k in range(blocks):
        with block_stream(stream, k, torch.device("cpu")):
            a = torch.rand(3) if not quiet else torch.zeros(3)
            time.sleep(0)  # another thread runs here
            out.append(torch.cat([a, torch.rand(3) if not quiet else torch.zeros(3)]))
        with neutral():
            time.sleep(0)


def test_job_threads_draw_the_masks_they_draw_alone():
    """Two drawing threads and a quiet one inside their blocks at once: each drawing thread's numbers are those
    it draws alone (the lock makes their forks exclusive; the quiet one forks nothing), and the global RNG is
    left as it was."""
    alone: dict[int, list] = {7: [], 8: []}
    for stream in alone:
        _draw_blocks(stream, 20, False, alone[stream], None)
    before = torch.get_rng_state()
    got: dict[int, list] = {7: [], 8: [], 9: []}
    start = threading.Barrier(3)
    threads = [threading.Thread(target=_draw_blocks, args=(s, 20, s == 9, got[s], start)) for s in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for stream in alone:
        assert torch.equal(torch.stack(got[stream]), torch.stack(alone[stream])), stream
    assert torch.equal(torch.get_rng_state(), before)


DEV = torch.device(os.environ.get("STRATUM_TEST_DEVICE", "cpu"))


def test_each_job_thread_computes_on_a_stream_of_its_own():
    """On a GPU (STRATUM_TEST_DEVICE=cuda) two job threads' kernels go to two streams of their own, neither the
    default stream, and each thread's result is its own; on a CPU nothing changes."""
    if DEV.type != "cuda":
        assert isinstance(job_stream(DEV), contextlib.nullcontext)
        return
    seen: dict[int, tuple[int, float]] = {}

    def job(i: int) -> None:
        with job_stream(DEV):
            x = torch.full((256, 256), float(i + 1), device=DEV)
            seen[i] = (torch.cuda.current_stream(DEV).cuda_stream, float((x @ x).sum().item()))

    threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    default = torch.cuda.default_stream(DEV).cuda_stream
    assert seen[0][0] != seen[1][0] and default not in (seen[0][0], seen[1][0])
    assert [v for _, v in (seen[0], seen[1])] == [256.0 ** 3 * (i + 1) ** 2 for i in range(2)]


def test_a_ray_worker_knows_its_gpus_from_0_in_the_order_named():
    assert actor_devices(["cuda:2", "cuda:2", "cuda:5", "cpu"]) == ["cuda:0", "cuda:0", "cuda:1", "cpu"]
    assert actor_devices(["cpu", "cpu"]) == ["cpu", "cpu"]
