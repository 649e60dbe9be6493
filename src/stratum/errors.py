"""The one exception type that reaches the user as a one-line message.

Anything raised as :class:`StratumError` is bad input (config, flag, corpus, checkpoint, budget): the CLI prints
``stratum: error: <message>`` and exits with code 2, without a traceback. Every other exception is a bug and
keeps its traceback.
"""

from __future__ import annotations


class StratumError(Exception):
    """Bad input the user can fix; the message says what is wrong and what to do."""

    exit_code = 2


class PeerError(StratumError):
    """Another rank died, hung or failed; this rank stops. Exit code 3 (2 stays 'bad input')."""

    exit_code = 3


INTERRUPTED = "stratum: interrupted; the last checkpoint (if any) is intact — run the same command to resume"
"""What a run stopped by Ctrl-C or SIGTERM says (a launcher and its ranks: once)."""
