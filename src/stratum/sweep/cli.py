"""``stratum sweep``: run (or resume) a sweep file; ``stratum sweep status DIR``: its jobs' table."""

from __future__ import annotations

import argparse
from pathlib import Path

from stratum.errors import StratumError


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="train many configs at once (grid / random search, fifo or planned, asha); "
                                     "`stratum sweep status DIR` shows a sweep's jobs")
    p.add_argument("action", nargs="?", choices=("run", "status"), default="run",
                   help="run (default): run or resume the sweep of --config; status: print DIR's table")
    p.add_argument("dir", nargs="?", help="status: the sweep directory (sweep.out_dir)")
    p.add_argument("--config", metavar="SWEEP.toml", help="the sweep file (see docs/sweep.md)")


def run(args: argparse.Namespace) -> int:
    # imported here, as every subcommand's engine is in stratum/cli.py: the parser and `status` stay free of torch
    if args.action == "status":
        from stratum.sweep.results import table
        from stratum.sweep.state import SweepState

        if not args.dir:
            raise StratumError("stratum sweep status needs the sweep directory, e.g. stratum sweep status runs/sweep")
        if not (Path(args.dir) / "state.db").is_file():
            raise StratumError(f"{args.dir} holds no sweep (no state.db); give the sweep's sweep.out_dir")
        state = SweepState(Path(args.dir))
        print(table(state.jobs()))
        state.close()
        return 0
    if not args.config:
        raise StratumError("stratum sweep needs --config SWEEP.toml (see docs/sweep.md)")
    from stratum.sweep.runner import run_sweep
    sweep = run_sweep(args.config, say=lambda line: print(line, flush=True))
    rows = sweep.state.jobs()
    return 0 if all(r.status in ("done", "stopped") for r in rows) else 1
