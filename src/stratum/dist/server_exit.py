"""Imported by the forkserver alone (the last module of its preload): the server leaves without tearing its
interpreter down. The server only forks; tearing down torch's modules costs it about a second, during which it
still holds its client's stdout and stderr open, and a caller that reads them to their end waits that long."""

from __future__ import annotations

import atexit
import os
import signal

_SERVER_PID = os.getpid()


def _leave() -> None:
    if os.getpid() == _SERVER_PID:  # a forked child inherits this handler: it exits as it would anyway
        os._exit(0)


atexit.register(_leave)
signal.signal(signal.SIGINT, signal.default_int_handler)  # (ignored since stratum.dist.server_start)
