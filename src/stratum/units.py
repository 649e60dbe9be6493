"""Byte sizes in human units: ``"2GB"``, ``"512MiB"``, ``"1.5 G"`` → bytes, and back (read by the config, the
offload planner, hardware specs and sweeps, so it sits at the bottom of the imports).

A budget the user typed keeps its text (:class:`Size`), and sizes compared with it are written in the same family
of units: a budget typed as ``"1GB"`` is answered in GB, not GiB, so the number in a message can be typed back.
"""

from __future__ import annotations

import math
import re

from stratum.errors import StratumError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_DECIMAL = (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("kB", 1000))
_BINARY = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))
_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, key: str = "size") -> int:
    """``"2GB"`` → 2_000_000_000, ``"512MiB"`` → 536_870_912; decimal (kB, MB, GB, TB) and binary (KiB …) units.

    Raises a one-line :class:`StratumError` naming ``key`` on anything else.
    """
    m = _RE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise StratumError(f"{key} = {text!r} is not a size; write e.g. \"2GB\", \"512MiB\" or \"1500000\" (bytes)")
    value = float(m.group(1)) * _UNITS[unit]
    return int(round(value))


class Size(int):
    """A byte count as typed by the user (``text``): it prints as typed, and sizes compared with it are written in
    its units (:func:`fmt_like`)."""

    text: str

    def __new__(cls, n: int, text: str) -> Size:
        obj = super().__new__(cls, n)
        obj.text = text.strip()
        return obj

    def __getnewargs__(self) -> tuple[int, str]:  # type: ignore[override]  # copies and pickles keep the text
        return int(self), self.text

    @property
    def binary(self) -> bool:
        """Typed in binary units (KiB, MiB, GiB, TiB)."""
        m = _RE.match(self.text)
        return m is not None and m.group(2).lower().endswith("ib")


def parse_budget(text: str, key: str, state_bytes: int | None = None) -> Size | None:
    """A budget: ``""`` (or ``"auto"``) means unlimited (``None``); otherwise a positive size that keeps its text,
    or a percentage of ``state_bytes`` (the training state: parameters, gradients and AdamW moments in fp32) —
    only checked for its range where the state is not known yet (``None``)."""
    if text.strip().lower() in ("", "auto"):
        return None
    if text.strip().endswith("%"):
        pct = parse_percent(text, key)
        return Size(max(1, int(state_bytes * pct / 100)) if state_bytes is not None else 1, text)
    n = parse_bytes(text, key)
    if n <= 0:
        raise StratumError(f"{key} = {text!r} must be a positive size, or \"\" for no limit")
    return Size(n, text)


def parse_percent(text: str, key: str) -> float:
    """``"25%"`` → 25.0: a percentage of the training state in (0, 1000]."""
    try:
        pct = float(text.strip()[:-1])
    except ValueError:
        pct = -1.0
    if not 0 < pct <= 1000:
        raise StratumError(f"{key} = {text!r} is not a percentage of the training state in (0, 1000]; "
                           "write e.g. \"25%\" or a size such as \"2GB\"")
    return pct


def fmt_bytes(n: float | None) -> str:
    """Bytes as a short human string with binary units (``1.50 GiB``); ``None`` → ``unlimited``; a :class:`Size`
    as the user typed it."""
    if n is None:
        return "unlimited"
    if isinstance(n, Size):
        return n.text
    n = float(n)
    for unit, div in _BINARY[1:]:
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def fmt_at_least(n: int, like: int | None) -> str:
    """``n`` bytes in the units ``like`` was typed in (decimal unless it is a :class:`Size` typed in binary
    units), rounded up to three significant digits: typed back as a budget, the number covers ``n``."""
    binary = isinstance(like, Size) and like.binary
    for unit, div in (_BINARY if binary else _DECIMAL):
        if n >= div:
            return f"{_ceil3(n / div):g} {unit}"
    return f"{n} B"


def _ceil3(x: float) -> float:
    """``x`` rounded up to three significant digits (1.4421 → 1.45, 123.01 → 124)."""
    digits = max(0, 2 - math.floor(math.log10(x)))
    scale = 10**digits
    return math.ceil(round(x * scale, 6)) / scale
