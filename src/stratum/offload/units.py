"""Byte sizes in human units: ``"2GB"``, ``"512MiB"``, ``"1.5 G"`` → bytes, and back."""

from __future__ import annotations

import re

from stratum.errors import StratumError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
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


def parse_budget(text: str, key: str) -> int | None:
    """A budget: ``""`` (or ``"auto"``) means unlimited (``None``); otherwise a positive size."""
    if text.strip().lower() in ("", "auto"):
        return None
    n = parse_bytes(text, key)
    if n <= 0:
        raise StratumError(f"{key} = {text!r} must be a positive size, or \"\" for no limit")
    return n


def fmt_bytes(n: float | None) -> str:
    """Bytes as a short human string with binary units (``1.50 GiB``); ``None`` → ``unlimited``."""
    if n is None:
        return "unlimited"
    n = float(n)
    for unit, div in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"
