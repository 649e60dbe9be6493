"""Seeds derived from several integers, the same on every process: the one rule for independent streams."""

from __future__ import annotations

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: consecutive inputs land far apart


def mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 over their sequence): equal inputs, equal seed, anywhere."""
    h = 0
    for v in values:
        h = (h + _MIX + (v & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h >> 1
