"""``stratum plan``'s arguments (:mod:`stratum.offload.cli` runs it): argparse only, so the command line's
grammar and ``--help`` answer without importing torch."""

from __future__ import annotations

import argparse

DEFAULT_SWEEP = "10%,25%,50%,100%"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="print the offload engine's plan (tiers, chunks, predicted bytes and time)")
    p.add_argument("--config", metavar="FILE.toml", help="TOML config file (defaults apply to what it omits)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config field (repeatable), e.g. --set offload.device_budget=2GB")
    p.add_argument("--profile", metavar="FILE.json", help="use this `stratum profile` output instead of profiling")
    p.add_argument("--estimate", action="store_true",
                   help="bytes per tier from the model's shapes alone, in seconds: no block is run or timed, so no "
                        "step time is predicted")
    p.add_argument("--json", dest="json_out", metavar="FILE.json", help="also write the plan as JSON")
    p.add_argument("--sweep", nargs="?", const=DEFAULT_SWEEP, metavar="BUDGETS",
                   help="plan these device budgets instead (comma-separated sizes or percentages of the training "
                        f"state; default {_escape_percent(DEFAULT_SWEEP)}) and print one row each")
    p.add_argument("--parallel", action="store_true", help="rank Plan trees (replicate x pipeline x split) for "
                   "--devices devices instead: predicted step time and peak memory, best first")
    p.add_argument("--devices", type=int, metavar="N", help="with --parallel: devices to plan for (default: the "
                   "hardware spec's)")
    p.add_argument("--hardware", metavar="FILE.toml", help="with --parallel: hardware spec (default: this machine, "
                   "measured once and cached)")
    return p


def _escape_percent(text: str) -> str:
    """argparse %-formats help strings: a literal ``%`` must be doubled."""
    return text.replace("%", "%%")
