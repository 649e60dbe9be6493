"""``stratum hardware``: measure this machine into a hardware spec, or show a spec as tables.

Runbook::

    stratum hardware probe --out hw.toml            # GPUs (or the CPU split into --devices processes), host, disk
    stratum hardware probe --devices 4 --out hw4.toml   # a CPU machine run as 4 gloo processes
    stratum hardware show hw.toml                   # devices, tiers and links as tables
    stratum plan --parallel --devices 4 --hardware hw4.toml   # rank Plan trees on it

What ``probe`` measures, and how:

- **devices**: every CUDA GPU (its memory, its matrix-multiply rate relative to GPU 0); without CUDA, the CPU as
  ``--devices`` processes (default: one per usable core), each with an equal share of the available RAM and the
  threads a run gives it (:mod:`stratum.train.threads`). Their speeds are measured with all of them running at
  once (:mod:`stratum.plan.process_probe`), relative to this process alone — the conditions of a profile taken
  here — so processes sharing cores, with each other or with the machine's other load, come out slower.
- **host link**: the offload engine's own copy probe (:func:`stratum.offload.tiers.measure_bandwidths`, host →
  device and back; the slower direction), with a 4 KiB copy's time as the latency.
- **disk**: the same probe's sustained write and read through the disk store's I/O path under ``--disk-dir``
  (the slower direction), a 4 KiB synced write as the latency, and the free bytes there.
- **intra-node link**: a gloo all-reduce over those processes (at least two; with CUDA, two CPU processes): an
  8 MiB and a 4-byte buffer, read through the ring all-reduce's price (:func:`stratum.ir.prices.ring_link`). The
  inter-node link cannot be measured from one machine: the spec repeats the intra-node figures and its header says
  so — edit them for a cluster.

The spec is written atomically; the header comments record the measured figures behind the relative speeds.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from stratum.atomic import atomic_write_text
from stratum.errors import StratumError
from stratum.ir.hardware import Device, Hardware, Link, dump_hardware, load_hardware
from stratum.ir.prices import ring_link
from stratum.offload.tiers import disk_free_bytes, measure_bandwidths
from stratum.plan.process_probe import probe_processes
from stratum.procs import usable_cores
from stratum.runtime.device import compute_rate, device_memory_bytes
from stratum.train.threads import threads_among
from stratum.units import fmt_bytes

PROBE_TIMEOUT_S = 120.0
BIG, SMALL = 8 << 20, 4


def run(args: argparse.Namespace) -> int:
    if args.hardware_command == "show":
        print(table(load_hardware(args.file)))
        return 0
    hw, notes = probe(devices=args.devices, disk_dir=args.disk_dir or tempfile.gettempdir())
    header = "".join(f"# {line}\n" for line in notes)
    atomic_write_text(args.out, header + dump_hardware(hw))
    print(table(hw))
    print("\n".join(notes))
    print(f"wrote {args.out}")
    return 0


def table(hw: Hardware) -> str:
    """Devices (one row per rank), then tiers and links."""
    lines = [f"{'rank':>4}  {'device':<24} {'memory':>12} {'speed':>7} {'node':>5}"]
    for r, d in enumerate(hw.devices):
        lines.append(f"{r:>4}  {d.name:<24} {fmt_bytes(d.memory_bytes):>12} {d.speed:>7.3g} {d.node:>5}")
    lines += ["", f"{'tier / link':<12} {'bytes':>12} {'bandwidth':>14} {'latency':>10}",
              f"{'host':<12} {fmt_bytes(hw.host_bytes):>12} {_bw(hw.host_link):>14} {_lat(hw.host_link):>10}",
              f"{'disk':<12} {fmt_bytes(hw.disk_bytes):>12} {_bw(hw.disk_link):>14} {_lat(hw.disk_link):>10}",
              f"{'intra_node':<12} {'':>12} {_bw(hw.intra_node):>14} {_lat(hw.intra_node):>10}",
              f"{'inter_node':<12} {'':>12} {_bw(hw.inter_node):>14} {_lat(hw.inter_node):>10}"]
    return "\n".join(lines)


def _bw(link: Link) -> str:
    return "unlimited" if link.bandwidth == float("inf") else f"{link.bandwidth / 1e9:.3g} GB/s"


def _lat(link: Link) -> str:
    return f"{link.latency * 1e6:.3g} us"


# ---- measuring ----------------------------------------------------------------------------------------------
def probe(*, devices: int | None, disk_dir: str) -> tuple[Hardware, list[str]]:
    """This machine's spec and the notes (measured figures) that go in its header."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    notes = [f"measured by `stratum hardware probe` on {socket.gethostname()} at {stamp}"]
    if devices is not None and devices < 1:
        raise StratumError(f"--devices must be >= 1, got {devices}")
    if not Path(disk_dir).is_dir():
        raise StratumError(f"--disk-dir {disk_dir!r} is not a directory")
    try:  # the disk probe writes its files there
        fd, path = tempfile.mkstemp(prefix=".stratum-probe-", dir=disk_dir)
        os.close(fd)
        os.unlink(path)
    except OSError as e:
        raise StratumError(f"--disk-dir {disk_dir!r} cannot take the disk probe's files ({e.strerror}); give a "
                           "writable directory") from None
    if torch.cuda.is_available():  # the processes are forked before this one touches CUDA
        procs = probe_processes(2, threads=1, sizes=(BIG, SMALL), timeout_s=PROBE_TIMEOUT_S)
        devs, dev0 = _gpus(notes), torch.device("cuda", 0)
    else:
        n = devices or usable_cores()
        threads = threads_among(n)  # as stratum.train.threads gives them
        procs = probe_processes(max(2, n), threads=threads, sizes=(BIG, SMALL), timeout_s=PROBE_TIMEOUT_S)
        devs, dev0 = _cpus(n, threads, procs.rates, notes), torch.device("cpu")
    bw = measure_bandwidths(dev0, disk_dir)
    host = Link(bandwidth=min(bw.h2d, bw.d2h), latency=_copy_latency(dev0))
    disk = Link(bandwidth=max(min(bw.disk_read, bw.disk_write), 1.0), latency=_disk_latency(disk_dir))
    big_s, small_s = procs.allreduce_s
    intra = ring_link(len(procs.rates), BIG - SMALL, big_s, small_s, fallback_bandwidth=math.inf)
    notes += [f"host link: h2d {bw.h2d / 1e9:.3g} GB/s, d2h {bw.d2h / 1e9:.3g} GB/s; disk: read "
              f"{bw.disk_read / 1e9:.3g} GB/s, write {bw.disk_write / 1e9:.3g} GB/s under {disk_dir}",
              f"intra_node: gloo all-reduce over {len(procs.rates)} local processes: {intra.bandwidth / 1e9:.3g} "
              f"GB/s, {intra.latency * 1e6:.3g} us",
              "inter_node: not measured (one node): a copy of intra_node; edit it for a cluster"]
    hw = Hardware(devices=tuple(devs), host_bytes=device_memory_bytes(torch.device("cpu")) or 0,
                  disk_bytes=disk_free_bytes(Path(disk_dir)), host_link=host, disk_link=disk, intra_node=intra,
                  inter_node=intra,
                  shared_cores=0 if torch.cuda.is_available() else usable_cores())
    return hw, notes


def _gpus(notes: list[str]) -> list[Device]:
    rates = [compute_rate(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    notes.append("matmul GFLOP/s per GPU: " + ", ".join(f"{x:.0f}" for x in rates))
    return [Device(name=torch.cuda.get_device_name(i), memory_bytes=torch.cuda.get_device_properties(i).total_memory,
                   speed=rates[i] / rates[0]) for i in range(len(rates))]


def _cpus(n: int, threads: int, rates: tuple[float, ...], notes: list[str]) -> list[Device]:
    """``n`` processes of ``threads`` threads; each one's speed is its rate measured while the others ran over this
    process's rate alone (what a profile taken here sees) — one process alone runs as the profile did."""
    here = compute_rate(torch.device("cpu"))
    speeds = [1.0] if n == 1 else [r / here for r in rates[:n]]
    notes.append(f"cpu: {usable_cores()} usable cores as {n} process(es) of {threads} thread(s); matmul GFLOP/s "
                 f"alone in this process ({torch.get_num_threads()} thread(s)): {here:.1f}; per process, measured "
                 f"together: {', '.join(f'{r:.1f}' for r in rates[:n])}")
    ram = device_memory_bytes(torch.device("cpu")) or 0
    return [Device(name="cpu", memory_bytes=max(1, ram // n), speed=x) for x in speeds]


def _best_s(fn, repeats: int = 20) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _copy_latency(device: torch.device) -> float:
    h = torch.ones(1024)
    d = torch.empty(1024, device=device)

    def copy():
        d.copy_(h)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    copy()
    return _best_s(copy)


def _disk_latency(disk_dir: str) -> float:
    fd, path = tempfile.mkstemp(prefix=".stratum-probe-", dir=disk_dir)
    try:
        def write() -> None:
            os.pwrite(fd, b"\0" * 4096, 0)
            os.fsync(fd)
        return _best_s(write, repeats=5)
    finally:
        os.close(fd)
        os.unlink(path)
