"""The hardware spec: devices (memory, relative speed, node), the host and disk tiers, and the links between them —
what the one cost model (:mod:`stratum.ir.prices`) prices blocks, collectives and transfers on.

A spec is a ``[hardware]`` TOML table (``stratum hardware probe`` writes one for this machine)::

    [hardware]
    host_bytes = "64GB"
    disk_bytes = "500GB"
    host_link = { bandwidth = "16GB/s", latency = "10us" }    # device <-> host
    disk_link = { bandwidth = "2GB/s", latency = "100us" }    # host <-> disk
    intra_node = { bandwidth = "300GB/s", latency = "2us" }   # device <-> device on one node
    inter_node = { bandwidth = "25GB/s", latency = "5us" }    # device <-> device across nodes
    sharded_scale = 1.0   # optional: a reduce-scatter + all-gather over a ring all-reduce of the same bytes
    shared_cores = 0      # optional: CPU cores the devices (processes of one machine) share; 0 = their own

    [[hardware.devices]]
    name = "a100"
    memory_bytes = "40GB"
    speed = 1.0       # relative to the device the profile was taken on
    node = 0
    count = 4         # four such devices (optional, default 1)
    peak_flops = 150e12   # optional: price blocks by kernels and FLOPs (stratum.ir.work), launch_s, half_flops

Sizes take the repo's byte units ("40GB", "512MiB", or a number of bytes), bandwidths the same with "/s" (or a
number of bytes per second), latencies seconds as a number or with a unit ("5us", "1ms").
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratum.errors import StratumError
from stratum.units import parse_bytes


@dataclass(frozen=True, kw_only=True)
class Link:
    """A point-to-point link; a message of b bytes takes ``latency + b / bandwidth`` seconds."""

    bandwidth: float
    """Bytes per second (> 0; ``inf`` for a link that costs nothing, such as a device to itself)."""
    latency: float
    """Seconds per message (>= 0)."""

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise StratumError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if not self.latency >= 0 or math.isinf(self.latency):
            raise StratumError(f"link latency must be >= 0 seconds, got {self.latency}")


FREE = Link(bandwidth=math.inf, latency=0.0)
"""The link of a device to itself: nothing to move."""


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator (or a CPU standing in for one)."""

    name: str
    """What it is ("a100", "cpu"); need not be unique."""
    memory_bytes: int
    """Bytes of device memory a job may use (> 0)."""
    speed: float = 1.0
    """Compute speed relative to the device the profile was taken on: a block's profiled time / speed (> 0)."""
    node: int = 0
    """The node (machine) it sits in: devices on one node talk over ``intra_node``, others over ``inter_node``."""
    peak_flops: float = 0.0
    """FLOP/s the device sustains on large kernels; 0: not given, blocks take their profiled time over ``speed``
    (where given, :mod:`stratum.ir.work` prices blocks from their kernel counts and FLOPs instead)."""
    launch_s: float = 5e-6
    """Seconds per kernel that no kernel beats: the launch latency (CUDA's is about 5 µs)."""
    half_flops: float = 0.0
    """FLOPs per kernel at which the device reaches half its ``peak_flops`` (Hockney's n½); 0: ``peak_flops ×
    launch_s`` (n½ = r∞ · t0, the start-up time t0 taken as the launch latency)."""

    def __post_init__(self) -> None:
        for key in ("peak_flops", "launch_s", "half_flops"):
            if not 0 <= getattr(self, key) < math.inf:
                raise StratumError(f"device {self.name!r}: {key} must be a number >= 0, got {getattr(self, key)}")
        if not self.name:
            raise StratumError("a device needs a name")
        if not self.memory_bytes > 0:
            raise StratumError(f"device {self.name!r}: memory_bytes must be > 0, got {self.memory_bytes}")
        if not self.speed > 0 or math.isinf(self.speed):
            raise StratumError(f"device {self.name!r}: speed must be a positive number, got {self.speed}")
        if self.node < 0:
            raise StratumError(f"device {self.name!r}: node must be >= 0, got {self.node}")


# Typical figures of a current GPU node, for simulations and tests that do not give their own: NVLink inside a
# node, a 200 Gb/s fabric between nodes, PCIe 4 x16 to the host, an NVMe disk.
NOMINAL_INTRA = Link(bandwidth=300e9, latency=2e-6)
NOMINAL_INTER = Link(bandwidth=25e9, latency=5e-6)
NOMINAL_HOST = Link(bandwidth=25e9, latency=10e-6)
NOMINAL_DISK = Link(bandwidth=2e9, latency=100e-6)


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Devices, the host and disk tiers below them, and the links; ranks index ``devices``."""

    devices: tuple[Device, ...]
    """The devices, in rank order."""
    host_bytes: int
    """Bytes of host RAM the job may use (>= 0)."""
    disk_bytes: int
    """Bytes of local disk the job may use (>= 0)."""
    host_link: Link
    """Device <-> host memory."""
    disk_link: Link
    """Host memory <-> disk."""
    intra_node: Link
    """Device <-> device on one node."""
    inter_node: Link
    """Device <-> device on different nodes."""
    sharded_scale: float = 1.0
    """Seconds of a reduce-scatter and an all-gather of a buffer (``replicate(shard=true)``'s pair) over those of a
    ring all-reduce of it, on this machine's collective library: 1 where the pair is the all-reduce's two halves
    (NCCL's rings); gloo's pair takes longer than its all-reduce (the plan search's rank probe measures it)."""

    shared_cores: int = 0
    """CPU cores the devices share, where they are processes of one machine (``stratum hardware probe`` without
    GPUs writes it); 0 = each device computes on its own. Their speeds are measured with every process busy: where
    there are more processes than cores, a process that waits gives its share to the busy ones."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        if not self.devices:
            raise StratumError("hardware: no devices; list at least one under [[hardware.devices]]")
        if not 0 < self.sharded_scale < math.inf:
            raise StratumError(f"hardware: sharded_scale must be a positive number, got {self.sharded_scale}")
        if isinstance(self.shared_cores, bool) or not isinstance(self.shared_cores, int) or self.shared_cores < 0:
            raise StratumError(f"hardware: shared_cores must be a whole number >= 0, got {self.shared_cores!r}")
        for key in ("host_bytes", "disk_bytes"):
            if getattr(self, key) < 0:
                raise StratumError(f"hardware: {key} must be >= 0, got {getattr(self, key)}")

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def link(self, a: int, b: int) -> Link:
        """The link between ranks ``a`` and ``b`` (:data:`FREE` when they are the same rank)."""
        da, db = self._device(a), self._device(b)
        if a == b:
            return FREE
        return self.intra_node if da.node == db.node else self.inter_node

    def group_link(self, ranks: Iterable[int]) -> Link:
        """The slowest link inside a group of ranks (the one a ring collective over them is bound by)."""
        ranks = list(dict.fromkeys(ranks))
        links = [self.link(a, b) for i, a in enumerate(ranks) for b in ranks[i + 1:]]
        if not links:
            return FREE
        return Link(bandwidth=min(x.bandwidth for x in links), latency=max(x.latency for x in links))

    def _device(self, rank: int) -> Device:
        if not 0 <= rank < len(self.devices):
            raise StratumError(f"rank {rank} is outside the hardware's {len(self.devices)} devices")
        return self.devices[rank]

    @classmethod
    def uniform(cls, n: int, *, memory_bytes: int, speed: float = 1.0, per_node: int | None = None,
                intra: Link = NOMINAL_INTRA, inter: Link = NOMINAL_INTER, host_bytes: int = 10**12,
                disk_bytes: int = 10**13, host_link: Link = NOMINAL_HOST, disk_link: Link = NOMINAL_DISK,
                name: str = "device") -> Hardware:
        """``n`` identical devices, ``per_node`` to a node (all on one node by default)."""
        per_node = n if per_node is None else per_node
        if n < 1 or per_node < 1:
            raise StratumError(f"hardware: need n >= 1 devices and per_node >= 1, got n={n}, per_node={per_node}")
        devs = tuple(Device(name=name, memory_bytes=memory_bytes, speed=speed, node=r // per_node) for r in range(n))
        return cls(devices=devs, host_bytes=host_bytes, disk_bytes=disk_bytes, host_link=host_link,
                   disk_link=disk_link, intra_node=intra, inter_node=inter)


# ---- TOML -------------------------------------------------------------------------------------------------------
_LINK_KEYS = ("host_link", "disk_link", "intra_node", "inter_node")
_PER_SECOND = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}
_TIME_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|\.[0-9]+)\s*([a-zµ]*)\s*$")


_BITS = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kKmMgGtT])b\s*$")
"""A rate in bits: a decimal prefix and a lower-case b (Gb, Mb …), as network links are quoted."""


def _as_bytes(m: re.Match) -> str:
    return f"{float(m.group(1)) / 8:g}{m.group(2).upper() if m.group(2) != 'k' else 'k'}B"


def parse_bandwidth(value: Any, key: str) -> float:
    """``"16GB/s"`` → 16e9 bytes/s; a number is bytes/s. Refuses anything else and non-positive values."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        bw = float(value)
    elif isinstance(value, str) and value.strip().lower().endswith("/s"):
        rate = value.strip()[:-2]
        if _BITS.match(rate):  # links are quoted in bits (200 Gb/s); read as bytes it would be 8x too fast
            raise StratumError(f"{key} = {value!r} is in bits; write bytes: {_BITS.sub(_as_bytes, rate)}/s")
        if rate.lstrip().startswith("-"):
            raise StratumError(f"{key} = {value!r} must be a positive bandwidth")
        bw = float(parse_bytes(rate, key))
    else:
        raise StratumError(f"{key} = {value!r} is not a bandwidth; write e.g. \"16GB/s\" or a number of bytes/s")
    if not bw > 0:
        raise StratumError(f"{key} = {value!r} must be a positive bandwidth")
    return bw


def parse_seconds(value: Any, key: str) -> float:
    """``"5us"`` → 5e-6; ``"1ms"``, ``"0.5s"`` or a number of seconds. Refuses negative values."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        s = float(value)
    else:
        m = _TIME_RE.match(str(value))
        if not m or m.group(2) not in _PER_SECOND:
            raise StratumError(f"{key} = {value!r} is not a time; write e.g. \"5us\", \"1ms\" or a number of seconds")
        s = float(m.group(1)) / _PER_SECOND[m.group(2)]
    if not s >= 0 or math.isinf(s):
        raise StratumError(f"{key} = {value!r} must be a time >= 0 seconds")
    return s


def _size(value: Any, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        return parse_bytes(value, key)
    raise StratumError(f"{key} = {value!r} is not a size; write e.g. \"40GB\" or a number of bytes")


def _known(table: dict, allowed: Iterable[str], where: str) -> None:
    allowed = tuple(allowed)
    extra = [k for k in table if k not in allowed]
    if extra:
        raise StratumError(f"{where}: unknown key {extra[0]!r}; it takes: {', '.join(allowed)}")


def _link(table: Any, where: str) -> Link:
    if not isinstance(table, dict):
        raise StratumError(f"{where} must be a table such as {{ bandwidth = \"16GB/s\", latency = \"10us\" }}")
    _known(table, ("bandwidth", "latency"), where)
    if "bandwidth" not in table:
        raise StratumError(f"{where} needs a bandwidth, e.g. bandwidth = \"16GB/s\"")
    return Link(bandwidth=parse_bandwidth(table["bandwidth"], f"{where}.bandwidth"),
                latency=parse_seconds(table.get("latency", 0.0), f"{where}.latency"))


MAX_DEVICE_COUNT = 1_000_000
"""The most devices one [[hardware.devices]] entry may stand for: more than any cluster has, so a larger count is a
typo, and its list of devices would only fill memory."""


MAX_SPEED = 1e9
"""The largest relative speed a device may have: a GPU is thousands of times one profiled CPU thread; a billion
is a typo, and would take every block's time to zero."""
MAX_DEVICE_BYTES = 10**18
"""The most memory one device may have (an exabyte): a larger figure is a unit typo."""


def _devices(entry: Any, i: int) -> list[Device]:
    where = f"hardware.devices[{i}]"
    if not isinstance(entry, dict):
        raise StratumError(f"{where} must be a table with name and memory_bytes")
    _known(entry, ("name", "memory_bytes", "speed", "node", "count", *_KERNEL_KEYS), where)
    for key in ("name", "memory_bytes"):
        if key not in entry:
            raise StratumError(f"{where} needs {key}")
    count, node, speed = entry.get("count", 1), entry.get("node", 0), entry.get("speed", 1.0)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_DEVICE_COUNT:
        raise StratumError(f"{where}.count = {count!r} must be a whole number in [1, {MAX_DEVICE_COUNT:,}]")
    if not isinstance(node, int) or isinstance(node, bool):
        raise StratumError(f"{where}.node = {node!r} must be a whole number")
    if not isinstance(speed, (int, float)) or isinstance(speed, bool) or not 0 < speed <= MAX_SPEED:
        raise StratumError(f"{where}.speed = {speed!r} must be a number in (0, {MAX_SPEED:g}] (1.0 = the profiled "
                           "device)")
    if not isinstance(entry["name"], str):
        raise StratumError(f"{where}.name = {entry['name']!r} must be a string, e.g. \"a100\"")
    memory = _size(entry["memory_bytes"], f"{where}.memory_bytes")
    if memory > MAX_DEVICE_BYTES:
        raise StratumError(f"{where}.memory_bytes = {entry['memory_bytes']!r} is more than a device has (at most "
                           f"{MAX_DEVICE_BYTES:.0e} bytes); check its unit")
    kernel = _kernel_fields(entry, where)  # (its errors name their keys in full)
    try:
        dev = Device(name=entry["name"], memory_bytes=memory, speed=float(speed), node=node, **kernel)
    except StratumError as e:
        raise StratumError(f"{where}: {e}") from None
    return [dev] * count


_KERNEL_KEYS = ("peak_flops", "launch_s", "half_flops")


def _kernel_fields(entry: dict, where: str) -> dict[str, float]:
    """A device entry's kernel-model keys: FLOP counts and FLOP/s as numbers, ``launch_s`` as a time."""
    out = {}
    for key in _KERNEL_KEYS:
        if key not in entry:
            continue
        value = entry[key]
        if key == "launch_s":
            out[key] = parse_seconds(value, f"{where}.{key}")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
        else:
            raise StratumError(f"{where}.{key} = {value!r} must be a number")
    return out


def hardware_from_table(table: Any, where: str = "[hardware]") -> Hardware:
    """A :class:`Hardware` from a parsed ``[hardware]`` table (see the module for its keys)."""
    if not isinstance(table, dict):
        raise StratumError(f"{where} must be a table")
    _known(table, ("devices", "host_bytes", "disk_bytes", "sharded_scale", "shared_cores", *_LINK_KEYS), where)
    devs = table.get("devices", [])
    if not isinstance(devs, list):
        raise StratumError(f"{where}: devices must be a list of tables ([[hardware.devices]])")
    for key in ("host_bytes", "disk_bytes", *_LINK_KEYS):
        if key not in table:
            raise StratumError(f"{where} needs {key}")
    links = {k: _link(table[k], f"hardware.{k}") for k in _LINK_KEYS}
    scale = table.get("sharded_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise StratumError(f"{where}: sharded_scale must be a number, got {scale!r}")
    try:
        return Hardware(devices=tuple(d for i, e in enumerate(devs) for d in _devices(e, i)),
                        host_bytes=_size(table["host_bytes"], "hardware.host_bytes"),
                        disk_bytes=_size(table["disk_bytes"], "hardware.disk_bytes"), sharded_scale=float(scale),
                        shared_cores=table.get("shared_cores", 0), **links)
    except StratumError as e:
        raise StratumError(str(e) if str(e).startswith("hardware") else f"hardware: {e}") from None


def load_hardware(path: str | Path) -> Hardware:
    """Read the ``[hardware]`` table of a TOML file; any problem is a one-line :class:`StratumError`."""
    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise StratumError(f"hardware spec {str(p)!r} does not exist; write one with `stratum hardware probe`") \
            from None
    except (OSError, UnicodeDecodeError) as e:
        raise StratumError(f"cannot read hardware spec {str(p)!r}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise StratumError(f"hardware spec {str(p)!r} is not valid TOML: {e}") from None
    except RecursionError:
        raise StratumError(f"hardware spec {str(p)!r} nests arrays or tables too deeply to read") from None
    if "hardware" not in doc:
        raise StratumError(f"hardware spec {str(p)!r} has no [hardware] table")
    try:
        return hardware_from_table(doc["hardware"])
    except StratumError as e:
        raise StratumError(f"{p}: {e}") from None


def _num(x: float) -> str:
    if math.isinf(x):
        return "inf"
    return repr(float(x)) if isinstance(x, float) else str(x)


def dump_hardware(hw: Hardware) -> str:
    """``hw`` as a ``[hardware]`` TOML table that :func:`load_hardware` reads back to an equal spec; runs of
    identical devices are written once with a ``count``."""
    lines = ["[hardware]", f"host_bytes = {hw.host_bytes}", f"disk_bytes = {hw.disk_bytes}"]
    for key in _LINK_KEYS:
        link: Link = getattr(hw, key)
        lines.append(f"{key} = {{ bandwidth = {_num(link.bandwidth)}, latency = {_num(link.latency)} }}")
    if hw.sharded_scale != 1.0:
        lines.append(f"sharded_scale = {_num(hw.sharded_scale)}")
    if hw.shared_cores:
        lines.append(f"shared_cores = {hw.shared_cores}")
    runs: list[list] = []
    for d in hw.devices:
        if runs and runs[-1][0] == d:
            runs[-1][1] += 1
        else:
            runs.append([d, 1])
    for d, count in runs:
        lines += ["", "[[hardware.devices]]", f"name = {_quote(d.name)}", f"memory_bytes = {d.memory_bytes}",
                  f"speed = {_num(float(d.speed))}", f"node = {d.node}", f"peak_flops = {_num(d.peak_flops)}",
                  f"launch_s = {_num(d.launch_s)}", f"half_flops = {_num(d.half_flops)}"]
        if count > 1:
            lines.append(f"count = {count}")
    return "\n".join(lines) + "\n"


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'

