"""Per-block cost measurement (``stratum profile``) and the ``Profile`` IR."""

from stratum.profile.profile import BlockProfile, Profile

__all__ = ["BlockProfile", "Profile"]
