"""``stratum hardware``'s arguments (:mod:`stratum.plan.hardware_cli` runs it): argparse only, so the command
line's grammar and ``--help`` answer without importing torch."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("hardware", help="measure this machine into a hardware spec, or show a spec")
    sub = p.add_subparsers(dest="hardware_command", metavar="probe|show", required=True)
    q = sub.add_parser("probe", help="measure devices, host and disk tiers and links; write a [hardware] TOML")
    q.add_argument("--out", default="hardware.toml", help="where to write the spec (default: hardware.toml)")
    q.add_argument("--devices", type=int, metavar="N",
                   help="on a CPU machine, the processes it is run as (default: one per core); ignored with CUDA")
    q.add_argument("--disk-dir", default="", metavar="DIR", help="directory whose disk to measure (default: the "
                   "system temp dir)")
    s = sub.add_parser("show", help="print a hardware spec as tables")
    s.add_argument("file", help="a TOML file with a [hardware] table")
    return p
