"""Asynchronous transfers between tiers, in submission order.

One background thread executes transfers FIFO, so a write-back of an evicted chunk always lands before a later
fetch into the same slot or of the same chunk. With a GPU the copies run on a side CUDA stream: before a
transfer overwrites a slot, the side stream waits for an event recorded on the compute stream when the slot was
released, and the consumer waits for an event recorded after the copy; the host thread never blocks the
compute stream. On a CPU the thread does disk reads and writes (they release the GIL and wait on the disk while
compute goes on); a CPU's memcpys between RAM tiers run on the training thread instead (:class:`Inline`), since
compute already keeps every core busy.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future, ThreadPoolExecutor

import torch


def background_pool(device: torch.device, name: str) -> ThreadPoolExecutor:
    """One worker thread beside training. On a CPU it runs its torch ops on one core: compute already uses
    every core, and a second OpenMP team of two threads made both wait on each other (GPT ``small`` at a 25 %
    budget, each engine's steps in one run: 0.82-0.88x plain, 0.90-0.93x with the transfer and optimizer threads
    at one thread each). A GPU machine keeps torch's default (its host AdamW needs the cores)."""
    if device.type != "cpu":
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=torch.set_num_threads,
                              initargs=(1,))


class Inline(Executor):
    """Runs each task as it is submitted, on the caller's thread, and hands back its finished future: the
    engine's transfer and optimizer "pools" where the work is a CPU's own (step_model.runs_inline)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # the waiter sees it, as with a thread pool
            fut.set_exception(e)
        return fut


class Transfers:
    def __init__(self, device: torch.device, inline: bool = False):
        """``inline``: run every transfer on the caller's thread (step_model.runs_inline: a CPU's memcpys)."""
        self.device = device
        self.pool = Inline() if inline else background_pool(device, "stratum-prefetch")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` in order after everything submitted before; returns a future to :meth:`wait` on."""
        if self.stream is None:
            return self.pool.submit(fn, *args)
        released = torch.cuda.Event()
        released.record(torch.cuda.current_stream(self.device))
        stream = self.stream

        def on_stream():
            with torch.cuda.stream(stream):
                stream.wait_event(released)
                fn(*args)
                done = torch.cuda.Event()
                done.record(stream)
            return done
        return self.pool.submit(on_stream)

    def wait(self, fut: Future | None) -> None:
        if fut is None:
            return
        res = fut.result()
        if self.stream is not None and isinstance(res, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(res)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
