"""Memory tiers (device → host → disk): byte budgets, exact accounting, bandwidths measured at start-up.

On a CUDA machine the device tier is GPU memory and the host tier pinned RAM; on a CPU-only machine the device
tier is RAM under the device budget and the host tier RAM under the host budget. The disk tier is files under a
private directory (removed at exit) read and written by a thread pool; a full disk is a :class:`StratumError`.
Bandwidths are measured by timing real copies (never hard-coded) and cached per process.
"""

from __future__ import annotations

import atexit
import errno
import functools
import os
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from stratum.errors import StratumError
from stratum.offload.units import fmt_bytes

DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)


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
    """Parameters per second of torch's fused AdamW on the CPU."""
    async_copies: bool = False
    """Host↔device copies run beside compute (a GPU's side stream); on a CPU they are memcpys on the cores."""

    def to_dict(self) -> dict:
        return dict(h2d=self.h2d, d2h=self.d2h, disk_read=self.disk_read, disk_write=self.disk_write,
                    adam_params_per_s=self.adam_params_per_s, async_copies=self.async_copies)


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


@functools.lru_cache(maxsize=4)
def _measure_disk(dirname: str, nbytes: int) -> tuple[float, float]:
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    path = Path(dirname) / f".bw-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(buf.numpy().data)
            f.flush()
            os.fsync(f.fileno())
        write = nbytes / max(time.perf_counter() - t0, 1e-9)
        # The page cache answers a read-back of what was just written; that is also what the engine sees for
        # recently spilled chunks, but to bound from below we drop this file's pages first where we can.
        try:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        except (AttributeError, OSError):
            pass
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(buf.numpy()).cast("B"))
        read = nbytes / max(time.perf_counter() - t0, 1e-9)
    finally:
        path.unlink(missing_ok=True)
    return read, write


@functools.lru_cache(maxsize=2)
def _measure_adam(n: int) -> float:
    from stratum.offload.cpu_adam import adamw_flat
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    step = torch.zeros(())

    def run():
        adamw_flat(p, g, m, v, step, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    run()
    return _best_rate(run, n, repeats=9)  # one call is ~1 ms: a single preemption would spoil a short series


def measure_bandwidths(device: torch.device, disk_dir: str | None, probe_bytes: int = 32 << 20) -> Bandwidths:
    """Time real copies host↔device, a disk write+read under ``disk_dir`` and CPU AdamW (cached per process)."""
    h2d, d2h = _measure_copy(str(device), probe_bytes)
    read, write = (_measure_disk(str(disk_dir), probe_bytes) if disk_dir else (0.0, 0.0))
    return Bandwidths(h2d=h2d, d2h=d2h, disk_read=read, disk_write=write,
                      adam_params_per_s=_measure_adam(1 << 22), async_copies=device.type == "cuda")


def resolve_disk_dir(disk_dir: str) -> Path:
    """The configured directory (``""`` = the system temp dir), created and proven writable."""
    base = Path(disk_dir).expanduser() if disk_dir else Path(tempfile.gettempdir())
    try:
        base.mkdir(parents=True, exist_ok=True)
        probe = base / f".stratum-write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise StratumError(f"offload.disk_dir {str(base)!r} is not writable ({e.strerror}); "
                           "choose a directory you can write to") from None
    return base


def disk_free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


class DiskStore:
    """Flat fp32 tensors as files in a private directory, read/written by a thread pool; removed at close/exit."""

    def __init__(self, base: Path, tier: Tier, workers: int = 2):
        self.dir = Path(tempfile.mkdtemp(prefix=f"stratum-offload-{os.getpid()}-", dir=base))
        self.tier = tier
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stratum-disk")
        self.sizes: dict[str, int] = {}
        self._finalizer = weakref.finalize(self, DiskStore._cleanup, self.dir, self.pool)
        atexit.register(self._finalizer)

    @staticmethod
    def _cleanup(d: Path, pool: ThreadPoolExecutor) -> None:
        pool.shutdown(wait=True)
        shutil.rmtree(d, ignore_errors=True)

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.bin"

    def create(self, key: str, t: torch.Tensor) -> None:
        """Create a file for ``key`` holding ``t`` (charged to the disk tier), synchronously."""
        nbytes = t.numel() * t.element_size()
        self.tier.charge(nbytes, f"file {key}")
        self.sizes[key] = nbytes
        self._write(key, t, "wb")

    def _write_error(self, key: str, e: OSError) -> StratumError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return StratumError(f"the disk under offload.disk_dir ({self.dir.parent}) is full; free space or "
                                "point offload.disk_dir at a larger disk")
        return StratumError(f"cannot write offload file {self._path(key)} ({e.strerror})")

    def write(self, key: str, t: torch.Tensor) -> None:
        """Overwrite ``key``'s file in place: never truncated, so its size (the tier's charge) stays exact while
        a background write is in flight."""
        self._write(key, t, "r+b")

    def _write(self, key: str, t: torch.Tensor, mode: str) -> None:
        data = t.detach().contiguous().cpu()
        try:
            with open(self._path(key), mode, buffering=0) as f:
                f.write(memoryview(data.numpy()).cast("B"))
        except OSError as e:
            raise self._write_error(key, e) from None

    def read(self, key: str, into: torch.Tensor) -> torch.Tensor:
        """Fill the CPU tensor ``into`` from ``key``'s file."""
        with open(self._path(key), "rb", buffering=0) as f:
            n = f.readinto(memoryview(into.numpy()).cast("B"))
        if n != into.numel() * into.element_size():
            raise StratumError(f"offload file {self._path(key)} is truncated ({n} bytes); the disk run is corrupt")
        return into

    def read_range(self, key: str, offset: int, into: torch.Tensor) -> torch.Tensor:
        """Fill ``into`` from ``key``'s file starting at element ``offset`` (fp32)."""
        with open(self._path(key), "rb", buffering=0) as f:
            f.seek(offset * 4)
            n = f.readinto(memoryview(into.numpy()).cast("B"))
        if n != into.numel() * 4:
            raise StratumError(f"offload file {self._path(key)} is truncated; the disk run is corrupt")
        return into

    def write_range(self, key: str, offset: int, src: torch.Tensor) -> None:
        data = src.detach().contiguous().cpu()
        try:
            with open(self._path(key), "r+b", buffering=0) as f:
                f.seek(offset * 4)
                f.write(memoryview(data.numpy()).cast("B"))
        except OSError as e:
            raise self._write_error(key, e) from None

    def write_async(self, key: str, t: torch.Tensor) -> Future:
        return self.pool.submit(self.write, key, t)

    def read_async(self, key: str, into: torch.Tensor) -> Future:
        return self.pool.submit(self.read, key, into)

    def close(self) -> None:
        for n in self.sizes.values():
            self.tier.release(n)
        self.sizes.clear()
        self._finalizer()
