"""Device choice and memory readings that work the same with and without a GPU."""

from __future__ import annotations

import contextlib
import resource
import sys
import time

import torch

from stratum.errors import StratumError


def resolve_device(spec: str) -> torch.device:
    """``auto`` → cuda if present else cpu; an unavailable cuda is an error, not a silent fallback."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise StratumError(f"train.device = {spec!r} but this machine has no usable CUDA GPU; "
                               "use train.device = 'cpu' or 'auto'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise StratumError(f"train.device = {spec!r} but only {torch.cuda.device_count()} GPU(s) exist")
    return canonical(dev)


def canonical(device: torch.device) -> torch.device:
    """``cuda`` → ``cuda:N`` (the current GPU). Tensors report an indexed device and ``torch.device("cuda")``
    compares unequal to it, so code comparing a tensor's device with the engine's needs the indexed form."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""train.precision → the 16-bit dtype its autocast computes in (fp16 with dynamic loss scaling: loss_scale.py)."""


def autocast(device: torch.device, precision: str):
    """bf16 or fp16 autocast on the device when asked; a no-op context for fp32."""
    if precision in HALF_DTYPES:
        return torch.autocast(device_type=device.type, dtype=HALF_DTYPES[precision])
    return contextlib.nullcontext()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of the training device: CUDA allocator peak on a GPU, peak process RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_rss_bytes()


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock timings mean something on a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    n = torch.get_num_threads()
    return f"cpu ({n} thread{'s' if n != 1 else ''})"


def compute_rate(device: torch.device, seconds: float = 0.3, n: int = 256, dtype: torch.dtype = torch.float32) -> float:
    """This process's rate of ``n``×``n`` matrix products in ``dtype`` on ``device`` in GFLOP/s, measured now for
    about ``seconds`` (with whatever else shares the machine running): how fast a rank is, for hardware-aware
    balance, and a device's peak where no datasheet gives it (runtime/peak.py). Draws no random numbers, so
    training's RNG streams stay as they are."""
    a = torch.ones(n, n, device=device, dtype=dtype)
    b = torch.full((n, n), 1.0 / n, device=device, dtype=dtype)
    a @ b  # warm-up: the first call pays for kernel selection
    synchronize(device)
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            a = a @ b
        synchronize(device)
        done += 8
    return done * 2 * n**3 / (time.perf_counter() - t0) / 1e9


def device_memory_bytes(device: torch.device) -> int | None:
    """Memory a run could take on ``device`` now: free GPU memory, or on a CPU the RAM Linux reports available
    (MemAvailable); ``None`` where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
