"""CPU memory for the offload engine: long-lived buffers straight from the kernel, temporaries from glibc's heap.

Two kinds of CPU allocation meet in an offload run and want opposite treatment:

* Long-lived buffers (chunk slots, staging, activation arenas and ring buffers) are large, live for the whole
  run or until resized, and must start on a page for direct I/O. They are anonymous mappings of their own
  (:func:`page_aligned_empty`): page-aligned by construction, and returned to the OS the moment they are freed,
  so the process never holds more than the tiers account for.
* Temporaries (the kernels' outputs in each block's forward and backward: 2-30 MB at typical sizes) are
  allocated and freed hundreds of times a step. They must be recycled from the heap: glibc's default sends any
  allocation above its mmap threshold to a fresh mapping, and every page of a fresh mapping costs a page fault
  on first touch: millions of faults a step for a large model, a large part of its time (docs/offload.md).

:func:`tune_allocator` fixes the threshold above those temporaries (glibc's dynamic threshold would grow to the
same value, but also its trim threshold, which kept up to 0.9 GB of freed heap resident), and
:func:`release_free_heap` hands freed heap pages back at a step's end when enough are free (256 MiB), so that what
a big step freed is not held into the next one. glibc only; elsewhere both are no-ops.

On a GPU the long-lived buffers of the host tier are page-locked for DMA (:func:`pinned_empty`): the same mappings,
registered with CUDA at their own size. torch's pinned allocator (``pin_memory=True``) rounds every request up to a
power of two and caches freed blocks, so a 257 MiB chunk would lock 512 MiB: up to twice what the tier accounts for,
which for a model filling the host (gpt-6.7b's 94 GB of masters and moments on a 128 GB machine) cannot be locked.
Short-lived pinned tensors (a step's staging of one activation) stay with torch's allocator, whose cached blocks
and stream events suit them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys
import time
import weakref

import torch
from torch import Tensor

from stratum.errors import StratumError
from stratum.units import fmt_bytes

PAGE = mmap.PAGESIZE
HEAP_MAX_ALLOC = 16 << 20
"""Bytes: allocations up to this size come from the heap (recycled), larger ones get their own mapping."""
RELEASE_MIN = 256 << 20
"""Bytes: free heap below this is kept for the next step (see release_free_heap)."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.lru_cache(maxsize=1)
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    return libc


def tune_allocator() -> None:
    """Recycle temporaries up to HEAP_MAX_ALLOC bytes from the heap and trim its top above that (see the module
    docstring); call before the model allocates anything."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return
    libc.mallopt(_M_MMAP_THRESHOLD, HEAP_MAX_ALLOC)
    libc.mallopt(_M_TRIM_THRESHOLD, HEAP_MAX_ALLOC)


def free_heap_bytes() -> int | None:
    """Bytes free inside glibc's heap (held by the process, not in use); None where it cannot be asked."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    return int(libc.mallinfo2().fordblks)


def release_free_heap(min_bytes: int = RELEASE_MIN) -> None:
    """Return the heap's free pages to the OS (glibc's malloc_trim) when at least ``min_bytes`` are free, so
    peak RSS is one step's, not the run's. Below that it is not worth it: the pages are faulted in again next
    step (trimming every step cost a 0.26 s step 3 %)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return
    free = free_heap_bytes()
    if free is None or free >= min_bytes:
        libc.malloc_trim(0)


class HeapTrim:
    """Calls :func:`release_free_heap` at step ends while its own cost stays within ``share`` of the time between
    calls. Asking glibc how much is free walks the heap's free lists, milliseconds a call: on a short step it
    runs every few steps, on a long one (where RSS matters most) every step."""

    def __init__(self, share: float = 0.005):
        self.share = share
        self.spent = 0.0
        """Seconds spent in release_free_heap."""
        self.elapsed = 0.0
        """Seconds between the first call and the last."""
        self._last: float | None = None

    def step_end(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.elapsed += now - self._last
        if self.spent <= self.share * self.elapsed:
            release_free_heap()
            self.spent += time.perf_counter() - now
        self._last = time.perf_counter()


def page_aligned_empty(nbytes: int) -> Tensor:
    """An uninitialised uint8 CPU tensor of ``nbytes`` in its own anonymous mapping (page-aligned, unmapped
    when the tensor is freed)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    # the mapping object stays alive as long as the tensor: torch.frombuffer keeps a reference to it
    # private, like malloc's own mappings (mmap's default for anonymous memory is shared: shmem-backed)
    try:
        mm = mmap.mmap(-1, -(-nbytes // PAGE) * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:  # (ENOMEM: the machine's memory, or the process's address-space limit)
        raise StratumError(f"out of host memory: {fmt_bytes(nbytes)} of the offload engine's host tier could not "
                           f"be mapped ({e.strerror}); lower offload.host_budget (the rest goes to disk) or "
                           "free memory") from None
    return torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]


def cuda_host_register(ptr: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` at ``ptr`` for the GPU's copy engines (cudaHostRegister, portable to every context)."""
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))
    if err != 0:
        raise StratumError(f"CUDA could not page-lock {nbytes:,} bytes of host memory (cudaError {err}); "
                          "lower offload.host_budget so that the host tier leaves room for the system")


def cuda_host_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _unpin(ptr: int, mapping: mmap.mmap) -> None:
    """A pinned buffer's end: every copy queued from or into it is done (a device-wide sync: buffers end at a
    resize or the run's end, seldom), then it is unregistered. ``mapping`` is held here until then, so the
    pages are unmapped only after (the memoryview exporting them may be gone already)."""
    if torch.cuda.is_initialized():
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)
    cuda_host_unregister(ptr)
    del mapping


def pinned_empty(nbytes: int) -> Tensor:
    """An uninitialised uint8 CPU tensor of ``nbytes`` in its own anonymous mapping, page-locked for a GPU at its
    own size (see the module docstring); unregistered, then unmapped, when the tensor is freed."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    size = -(-nbytes // PAGE) * PAGE
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor keeps the view, the view keeps an export of the mapping; the finaliser holds the mapping itself
    view = memoryview(mapping)
    t = torch.frombuffer(view, dtype=torch.uint8)
    ptr = t.data_ptr()
    cuda_host_register(ptr, size)
    finaliser = weakref.finalize(view, _unpin, ptr, mapping)
    finaliser.atexit = False  # at exit the process's memory goes with it, and CUDA may be torn down first
    return t[:nbytes]
