"""Memory tiers (device → host → disk): byte budgets, exact accounting, bandwidths measured at start-up.

On a CUDA machine the device tier is GPU memory and the host tier pinned RAM; on a CPU-only machine the device
tier is RAM under the device budget and the host tier RAM under the host budget. The disk tier is files under
``offload.disk_dir`` read and written by a thread pool; a full disk is a :class:`StratumError`. Every file the
disk tier and its probes make has no name (``O_TMPFILE``, or unlinked the moment it is opened): the kernel frees
it when the process ends, however it ends, so a killed run leaves nothing behind. Bandwidths are measured by
timing real copies (never hard-coded) and cached per process.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import os
import re
import resource
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor

from stratum.atomic import unwritable_dir
from stratum.errors import StratumError
from stratum.model.neutral import neutral
from stratum.offload.cpu_adam import adamw_flat
from stratum.offload.host_alloc import page_aligned_empty, pinned_empty
from stratum.offload.prefetch import background_pool
from stratum.procs import pid_alive
from stratum.units import fmt_bytes

DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)
F32 = 4
"""Bytes per element of the chunks, gradients and moments (fp32)."""
HALF = 2
"""Bytes per element of a chunk's 16-bit (bf16) working copy on the device, and of a gradient on its way to the
host, under mixed-precision placement (``step_model.half_chunks``)."""


class Tier:
    """Byte accounting of one tier: ``used`` never exceeds ``budget`` (``None`` = unlimited); ``peak`` kept."""

    def __init__(self, name: str, budget: int | None):
        self.name = name
        self.budget = budget
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    def charge(self, nbytes: int, what: str = "") -> None:
        with self._lock:
            if self.budget is not None and self.used + nbytes > self.budget:
                raise StratumError(f"the {self.name} tier would hold {fmt_bytes(self.used + nbytes)} "
                                   f"({what}) but its budget is {fmt_bytes(self.budget)}")
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
            assert self.used >= 0, f"{self.name} tier accounting went negative"

    def note_transient(self, nbytes: int) -> None:
        """Record a short-lived extra (activations) in the peak without holding it."""
        with self._lock:
            self.peak = max(self.peak, self.used + nbytes)

    def check(self, extra: int = 0) -> None:
        """Assert the accounting is within budget (called every step)."""
        if self.budget is not None:
            assert self.used + extra <= self.budget, (
                f"{self.name} tier holds {self.used + extra} bytes, over its budget {self.budget}")


@dataclass(kw_only=True)
class Bandwidths:
    """Measured bytes per second of each link the engine uses, plus CPU AdamW throughput."""

    h2d: float
    """host → device copy."""
    d2h: float
    """device → host copy."""
    disk_read: float
    disk_write: float
    adam_params_per_s: float
    """Parameters per second of torch's fused AdamW on the CPU, run on the optimizer thread."""
    adam_inline_params_per_s: float = 0.0
    """The same run on the training thread with all of its threads (planner.updates_inline); 0 = unknown, taken
    as ``adam_params_per_s``."""
    async_copies: bool = False
    """Host↔device copies run beside compute (a GPU's side stream); on a CPU they are memcpys on the cores."""

    def to_dict(self) -> dict:
        return dict(h2d=self.h2d, d2h=self.d2h, disk_read=self.disk_read, disk_write=self.disk_write,
                    adam_params_per_s=self.adam_params_per_s,
                    adam_inline_params_per_s=self.adam_inline_params_per_s, async_copies=self.async_copies)


def _best_rate(fn, nbytes: int, repeats: int = 5) -> float:
    """Bytes (or items) per second of the fastest of ``repeats`` runs: the best run is the one least disturbed
    by other processes on a shared machine."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / max(best, 1e-9)


@functools.lru_cache(maxsize=8)
def _measure_copy(device_str: str, nbytes: int) -> tuple[float, float]:
    device = torch.device(device_str)
    n = nbytes // 4
    if device.type == "cuda":
        h = torch.empty(n, dtype=torch.float32, pin_memory=True)
        d = torch.empty(n, dtype=torch.float32, device=device)

        def h2d():
            d.copy_(h, non_blocking=True)
            torch.cuda.synchronize(device)

        def d2h():
            h.copy_(d, non_blocking=True)
            torch.cuda.synchronize(device)
    else:
        h = torch.ones(n, dtype=torch.float32)
        d = torch.ones(n, dtype=torch.float32)

        def h2d():
            d.copy_(h)

        def d2h():
            h.copy_(d)
    h2d()
    return _best_rate(h2d, nbytes), _best_rate(d2h, nbytes)


MIN_DISK_PROBE = 64 << 10
"""Bytes per probe request below which the disk is too full to measure (or to hold a chunk)."""


@functools.lru_cache(maxsize=4)
def _measure_disk(dirname: str, nbytes: int, pieces: int = 8) -> tuple[float, float]:
    """Sustained read and write bytes/s of the disk store's own I/O path (direct where the file system allows
    it): ``pieces`` requests of ``nbytes`` written (then synced) and read back one after another, as training
    streams chunks. A single request measures the disk's burst rate instead, well above what a stream of chunks
    sustains, and the planner would then expect a disk-bound backward to be compute-bound."""
    base = Path(dirname)
    # a nearly full disk gets a smaller probe (at most half its free space), and none below MIN_DISK_PROBE: its
    # rate reads as 0, and the planner, which also sees the free bytes, keeps the training state off it
    nbytes = min(round_up(nbytes), disk_free_bytes(base) // (2 * pieces) // ALIGN * ALIGN)
    if nbytes < MIN_DISK_PROBE:
        return 0.0, 0.0
    total = pieces * nbytes
    buf = aligned_empty(nbytes, torch.uint8)
    buf.fill_(1)
    direct = direct_io_works(base)
    try:
        fd = anonymous_file(base, direct)
        try:
            t0 = time.perf_counter()
            for k in range(pieces):
                _pwrite_all(fd, buf, k * nbytes)
            os.fsync(fd)
            t1 = time.perf_counter()
            if not direct:  # bound from below: drop the pages just written so the reads reach the disk
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                except (AttributeError, OSError):
                    pass
            for k in range(pieces):
                _pread_all(fd, buf, k * nbytes)
            t2 = time.perf_counter()
        finally:
            os.close(fd)
    except OSError as e:
        raise StratumError(f"cannot measure the disk under offload.disk_dir {dirname!r} ({e.strerror}); free space "
                           "there or point offload.disk_dir at a writable disk with room") from None
    return total / max(t2 - t1, 1e-9), total / max(t1 - t0, 1e-9)


def _measure_adam(n: int) -> float:
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    step = torch.zeros(())

    def run():
        adamw_flat(p, g, m, v, step, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    run()
    return _best_rate(run, n, repeats=9)  # one call is ~1 ms: a single preemption would spoil a short series


PROBE_BYTES = 32 << 20
"""Bytes each host↔device copy probe moves, and the disk probe's request size, where no model sizes them."""
MIN_HOST_PROBE = 1 << 20
"""The smallest host probe a model gets: below a mebibyte a copy or AdamW call is per-call overhead."""


def host_probe_bytes(n_params: int) -> int:
    """Bytes of the host copy and AdamW probes that price the plan of a model of ``n_params`` parameters: its
    fp32 weights, within [MIN_HOST_PROBE, PROBE_BYTES]. No transfer or update of its training moves more than
    that at once, and a larger probe times a bigger working set (out of the caches a small model's state stays
    in) at up to a second of start-up per engine process."""
    return max(MIN_HOST_PROBE, min(PROBE_BYTES, round_up(F32 * n_params)))


def measure_bandwidths(device: torch.device, disk_dir: str | None, *, host_bytes: int = PROBE_BYTES,
                       disk_bytes: int = PROBE_BYTES) -> Bandwidths:
    """Time real copies of ``host_bytes`` host↔device, AdamW over ``host_bytes / 8`` parameters (each of its four
    fp32 tensors half the copy's size) and a disk write+read of requests of ``disk_bytes`` under ``disk_dir``
    (each cached per process and size). The disk probe keeps its size whatever the model: a short one times the
    disk's burst rate, not the sustained one a run streams at (``_measure_disk``).
    The AdamW probe draws random numbers: the training run's RNG streams must not see it (``neutral``)."""
    adam_n = max(1, host_bytes // (2 * F32))
    with neutral(devices=[device]):
        h2d, d2h = _measure_copy(str(device), host_bytes)
        read, write = (_measure_disk(str(disk_dir), disk_bytes) if disk_dir else (0.0, 0.0))
        return Bandwidths(h2d=h2d, d2h=d2h, disk_read=read, disk_write=write,
                          adam_params_per_s=_measure_adam_beside(device, adam_n),
                          adam_inline_params_per_s=_measure_adam_here(adam_n) if device.type == "cpu" else 0.0,
                          async_copies=device.type == "cuda")


@functools.lru_cache(maxsize=4)
def _measure_adam_here(n: int) -> float:
    """CPU AdamW parameters/s on the calling (training) thread, with all of its threads, over ``n`` parameters."""
    return _measure_adam(n)


@functools.lru_cache(maxsize=4)
def _measure_adam_beside(device: torch.device, n: int) -> float:
    """CPU AdamW parameters/s as the optimizer thread runs it (prefetch.background_pool: one thread on a CPU)."""
    pool = background_pool(device, "stratum-adam-probe")
    try:
        return pool.submit(_measure_adam, n).result()
    finally:
        pool.shutdown()


def disk_base(disk_dir: str) -> Path:
    """The directory offload.disk_dir names (``""`` = the system temp dir), as it is: not created."""
    return Path(disk_dir).expanduser() if disk_dir else Path(tempfile.gettempdir())


def resolve_disk_dir(disk_dir: str) -> Path:
    """The configured directory (:func:`disk_base`), created and proven writable."""
    base = disk_base(disk_dir)
    try:
        base.mkdir(parents=True, exist_ok=True)
        fd = anonymous_file(base, direct=False)
        try:
            os.pwrite(fd, b"ok", 0)
        finally:
            os.close(fd)
    except OSError as e:
        raise unwritable_dir("offload.disk_dir", base, e) from None
    remove_dead_leftovers(base)
    return base


# Names the disk tier and its probes gave files before they were nameless (and the fallback's instant before its
# unlink): each carries the pid of the process that made it.
_LEFTOVER = re.compile(r"^(?:stratum-offload|\.stratum-offload|\.bw|\.stratum-direct|\.stratum-write-test)"
                       r"-(\d+)(?:-|$)")


def remove_dead_leftovers(base: Path) -> list[Path]:
    """Remove disk-tier files and directories under ``base`` that a killed process of an earlier Stratum left
    (their names carry its pid, and no such process lives); returns what was removed."""
    removed = []
    for entry in base.iterdir():
        m = _LEFTOVER.match(entry.name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
    return removed


def disk_free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


ALIGN = 4096
"""Bytes: direct I/O needs the buffer address, file offset and length aligned to the disk's logical block
(512 B or 4 KiB); a page covers both. Chunk capacities are rounded to it (chunks.pack)."""


_N = TypeVar("_N", int, float)


def round_up(nbytes: _N, to: int = ALIGN) -> _N:
    return -(-nbytes // to) * to


def aligned_empty(n: int, dtype: torch.dtype = torch.float32, pin: bool = False) -> Tensor:
    """An uninitialised 1-D CPU tensor of ``n`` elements whose data starts on an ALIGN-byte boundary, so the disk
    store can read and write it directly: its own page-aligned mapping, page-locked for a GPU with ``pin``."""
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    return (pinned_empty(nbytes) if pin else page_aligned_empty(nbytes)).view(dtype)


def _is_aligned(t: Tensor, offset: int) -> bool:
    return t.data_ptr() % ALIGN == 0 and (t.numel() * t.element_size()) % ALIGN == 0 and offset % ALIGN == 0


def _bytes(t: Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy().data).cast("B") if t.numel() else memoryview(b"")


def anonymous_file(base: Path, direct: bool) -> int:
    """A descriptor of a new read-write file on ``base``'s filesystem that has no name: the kernel frees it when
    its last descriptor closes, so no kill leaves it behind. ``O_TMPFILE`` where the filesystem has it; else a
    file created and unlinked at once (a kill between the two calls is the only way one can stay)."""
    flags = os.O_RDWR | (os.O_DIRECT if direct else 0)
    if hasattr(os, "O_TMPFILE"):
        try:
            return os.open(base, flags | os.O_TMPFILE, 0o600)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):  # only "no O_TMPFILE here" falls back
                raise
    path = base / f".stratum-offload-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    return fd


def _raise_open_file_limit() -> None:
    """Lift the soft limit on open descriptors to the hard one: the disk tier holds one per file."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _pread_all(fd: int, t: Tensor, offset: int) -> int:
    """Read into contiguous CPU tensor ``t`` from byte ``offset``; returns the bytes read (short only at EOF)."""
    view, done = _bytes(t), 0
    while done < len(view):
        k = os.preadv(fd, [view[done:]], offset + done)
        if k == 0:
            break
        done += k
    return done


def _pwrite_all(fd: int, t: Tensor, offset: int) -> None:
    view, done = _bytes(t), 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)


@functools.lru_cache(maxsize=16)
def direct_io_works(base: Path) -> bool:
    """Whether files under ``base`` accept O_DIRECT reads and writes (not tmpfs, not every network file system)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    buf = aligned_empty(ALIGN, torch.uint8)
    buf.fill_(7)
    try:
        fd = anonymous_file(base, direct=True)
        try:
            _pwrite_all(fd, buf, 0)
            buf.zero_()
            return _pread_all(fd, buf, 0) == ALIGN and bool((buf == 7).all())
        finally:
            os.close(fd)
    except OSError:
        return False


class DiskStore:
    """Flat tensors as nameless files under ``base`` (:func:`anonymous_file`), read/written by a thread pool; an
    open descriptor per file is all that holds one, so the files go when the store closes or the process ends.

    Where the file system allows it, files are opened with O_DIRECT: the data moves between the disk and the
    caller's buffer by DMA. Through the page cache every byte is also copied by a core, and that copy competes
    with training for this machine's two cores: a background writer slowed matrix products 2.2× through the page
    cache, 1.2× with O_DIRECT (``benchmarks/offload_bench.py`` quotes the engine-level effect). Aligned buffers
    (``aligned_empty``, chunk slots and staging) go straight to the disk; any other buffer passes through an
    aligned bounce buffer (checkpoint paths only). ``bounce_bytes`` counts those, so a test can hold the hot
    path to zero.
    """

    def __init__(self, base: Path, tier: Tier, workers: int = 2):
        self.dir = Path(base)
        self.tier = tier
        self.direct = direct_io_works(self.dir)  # probed once per directory
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stratum-disk")
        self.sizes: dict[str, int] = {}
        self.bounce_bytes = 0
        self.bytes_read = 0
        """Bytes read from and written to the store's files so far (what was asked for, not block padding)."""
        self.bytes_written = 0
        self._count = threading.Lock()  # reads and writes run on the store's threads and the caller's
        self._fds: dict[str, int] = {}
        self._fds_lock = threading.Lock()
        _raise_open_file_limit()
        self._finalizer = weakref.finalize(self, DiskStore._cleanup, self._fds, self.pool)
        atexit.register(self._finalizer)

    @staticmethod
    def _cleanup(fds: dict[str, int], pool: ThreadPoolExecutor) -> None:
        pool.shutdown(wait=True)
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        fds.clear()

    def _where(self, key: str) -> str:
        return f"{key} under {self.dir}"

    @contextlib.contextmanager
    def _fd(self, key: str):
        """A private duplicate of ``key``'s descriptor for one read or write: a concurrent :meth:`remove` closes
        the original, never the one in use (whose number the kernel could otherwise hand to another file)."""
        with self._fds_lock:
            if key not in self._fds:
                raise KeyError(f"offload file {self._where(key)} does not exist")
            fd = os.dup(self._fds[key])
        try:
            yield fd
        finally:
            os.close(fd)

    def file_bytes(self) -> int:
        """Bytes the store's files take on the disk, as the file system reports their sizes."""
        with self._fds_lock:
            return sum(os.fstat(fd).st_size for fd in self._fds.values())

    def create(self, key: str, t: torch.Tensor) -> None:
        """Create a file for ``key`` holding ``t`` (charged to the disk tier, rounded up to ALIGN bytes),
        synchronously."""
        nbytes = round_up(t.numel() * t.element_size())
        self.tier.charge(nbytes, f"file {key}")
        self.sizes[key] = nbytes
        try:
            fd = anonymous_file(self.dir, self.direct)
            try:
                os.ftruncate(fd, nbytes)  # the tail block exists, so a direct write of it needs no extension
            except OSError:
                os.close(fd)
                raise
        except OSError as e:
            self.sizes.pop(key)
            self.tier.release(nbytes)
            raise self._write_error(key, e) from None
        with self._fds_lock:
            old = self._fds.pop(key, None)
            self._fds[key] = fd
        if old is not None:
            os.close(old)
        self.write(key, t)

    def _write_error(self, key: str, e: OSError) -> StratumError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return StratumError(f"the disk under offload.disk_dir ({self.dir}) is full; free space or "
                                "point offload.disk_dir at a larger disk")
        if e.errno == errno.EMFILE:
            return StratumError("the disk tier holds more files than this process may open; raise the limit "
                                "(ulimit -n) or offload.chunk_size")
        return StratumError(f"cannot write offload file {self._where(key)} ({e.strerror})")

    def write(self, key: str, t: torch.Tensor) -> None:
        """Overwrite ``key``'s file in place: never truncated, so its size (the tier's charge) stays exact while
        a background write is in flight."""
        self.write_range(key, 0, t)

    def read(self, key: str, into: torch.Tensor) -> torch.Tensor:
        """Fill the CPU tensor ``into`` from ``key``'s file."""
        return self.read_range(key, 0, into)

    def read_range(self, key: str, offset: int, into: torch.Tensor) -> torch.Tensor:
        """Fill contiguous CPU tensor ``into`` from ``key``'s file starting at element ``offset`` (of into's
        dtype)."""
        at = offset * into.element_size()
        n = into.numel() * into.element_size()
        with self._fd(key) as fd:
            if not self.direct or _is_aligned(into, at):
                got = _pread_all(fd, into, at)
            else:
                lo, buf = self._bounce(at, n)
                got = min(_pread_all(fd, buf, lo) - (at - lo), n)
                into.view(torch.uint8).reshape(-1).copy_(buf[at - lo:at - lo + n])
        if got != n:
            raise StratumError(f"offload file {self._where(key)} is truncated ({got} of {n} bytes at byte {at}); "
                               "the disk run is corrupt")
        with self._count:
            self.bytes_read += n
        return into

    def write_range(self, key: str, offset: int, src: torch.Tensor) -> None:
        """Write ``src`` into ``key``'s file at element ``offset``, in place."""
        data = src.detach().contiguous().cpu()
        at = offset * data.element_size()
        n = data.numel() * data.element_size()
        try:
            with self._fd(key) as fd:
                if not self.direct or _is_aligned(data, at):
                    _pwrite_all(fd, data, at)
                else:  # read-modify-write of the aligned span: its first and last blocks keep their other bytes
                    lo, buf = self._bounce(at, n)
                    _pread_all(fd, buf, lo)
                    buf[at - lo:at - lo + n].copy_(data.view(torch.uint8).reshape(-1))
                    _pwrite_all(fd, buf, lo)
        except OSError as e:
            raise self._write_error(key, e) from None
        with self._count:
            self.bytes_written += n

    def _bounce(self, at: int, n: int) -> tuple[int, Tensor]:
        lo = at // ALIGN * ALIGN
        size = round_up(at + n) - lo
        self.bounce_bytes += size
        return lo, aligned_empty(size, torch.uint8)

    def put(self, key: str, t: torch.Tensor) -> None:
        """Write ``t`` as ``key``'s whole content: in place when the file has its size, else re-created."""
        if self.sizes.get(key) == round_up(t.numel() * t.element_size()):
            self.write(key, t)
            return
        self.remove(key)
        self.create(key, t)

    def remove(self, key: str) -> None:
        n = self.sizes.pop(key, None)
        if n is not None:
            with self._fds_lock:
                fd = self._fds.pop(key, None)
            if fd is not None:
                os.close(fd)
            self.tier.release(n)

    def read_async(self, key: str, into: torch.Tensor) -> Future:
        return self.pool.submit(self.read, key, into)

    def close(self) -> None:
        for n in self.sizes.values():
            self.tier.release(n)
        self.sizes.clear()
        self._finalizer()
