"""Imported by the forkserver alone, first of its preload: Ctrl-C at the terminal reaches the server too, and while
it imports its preload (torch: seconds) the stdlib has not yet set it to ignore SIGINT — the interrupt would end it
with a traceback beside its client's own one-line stop. Ignored here until :mod:`stratum.dist.server_exit`, the
last module of the preload, puts the default back: the server's loop then saves the default for the children it
forks and ignores SIGINT itself."""

from __future__ import annotations

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
