"""Asynchronous transfers between tiers, in submission order.

One background thread executes transfers FIFO, so a write-back of an evicted chunk always lands before a later
fetch into the same slot or of the same chunk. With a GPU the copies run on a side CUDA stream: before a
transfer overwrites a slot, the side stream waits for an event recorded on the compute stream when the slot was
released, and the consumer waits for an event recorded after the copy; the host thread never blocks the
compute stream. On the CPU the thread simply does the copies (``copy_`` and file reads release the GIL).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Transfers:
    def __init__(self, device: torch.device):
        self.device = device
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stratum-prefetch")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` in order after everything submitted before; returns a future to :meth:`wait` on."""
        if self.stream is None:
            return self.pool.submit(fn, *args)
        released = torch.cuda.Event()
        released.record(torch.cuda.current_stream(self.device))

        def on_stream():
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(released)
                fn(*args)
                done = torch.cuda.Event()
                done.record(self.stream)
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
