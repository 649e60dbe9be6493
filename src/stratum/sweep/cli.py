"""``stratum sweep``: run (or resume) a sweep file; ``stratum sweep status DIR``: its jobs' table."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from stratum.errors import StratumError


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="train many configs at once (grid / random search, fifo or planned, asha); "
                                     "`stratum sweep status DIR` shows a sweep's jobs")
    p.add_argument("action", nargs="?", choices=("run", "status", "simulate"), default="run",
                   help="run (default): run or resume the sweep of --config; status: print DIR's table; "
                        "simulate: every scheduler's SIMULATED makespan for --config, from profiles, nothing run")
    p.add_argument("dir", nargs="?", help="status: the sweep directory (sweep.out_dir)")
    p.add_argument("--config", metavar="SWEEP.toml", help="the sweep file (see docs/sweep.md)")
    p.add_argument("--png", metavar="FILE.png", help="simulate: also write the schedules as a Gantt chart")
    p.add_argument("--hardware", metavar="HW.toml", help="simulate: on the cluster this [hardware] file describes "
                                                         "(fifo, sharded-lrtf, planned over several devices)")
    p.add_argument("--retry-failed", action="store_true",
                   help="run: failed jobs run again (from their checkpoints) with their retries restored")


def run(args: argparse.Namespace) -> int:
    """The exit code: 0 when every job is done (or stopped by ASHA), 1 when one failed or is unfinished."""
    # imported here, as every subcommand's engine is in stratum/cli.py: the parser and `status` stay free of torch
    if args.action == "status":
        from stratum.sweep.dir_lock import held
        from stratum.sweep.live import as_interrupted, with_progress
        from stratum.sweep.results import makespan_line, read_makespan, table
        from stratum.sweep.state import RUNNING, SweepState

        if not args.dir:
            raise StratumError("stratum sweep status needs the sweep directory, e.g. stratum sweep status runs/sweep")
        sweep_dir = Path(args.dir)
        if not (sweep_dir / "state.db").is_file():
            raise StratumError(f"{args.dir} holds no sweep (no state.db); give the sweep's sweep.out_dir")
        state = SweepState.read_only(sweep_dir)
        rows = with_progress(state.jobs(), sweep_dir)  # running jobs: their latest step
        state.close()
        stopped = held(sweep_dir) is False and any(r.status == RUNNING for r in rows)
        print(table(as_interrupted(rows) if stopped else rows))
        if stopped:
            print("the sweep is not running (it was stopped while these jobs ran): run the same `stratum sweep "
                  "--config …` to resume them from their last checkpoints")
        elif (doc := read_makespan(sweep_dir)) is not None:
            print(makespan_line(doc))
        return 0
    if not args.config:
        raise StratumError("stratum sweep needs --config SWEEP.toml (see docs/sweep.md)")
    if args.action == "run" and (args.png or args.hardware):
        flag = "--png" if args.png else "--hardware"
        raise StratumError(f"{flag} is `stratum sweep simulate`'s: a run writes its own losses.png into the sweep "
                           "directory; drop the flag, or run `stratum sweep simulate --config …`")
    if args.action == "simulate":
        from stratum.ir.hardware import load_hardware
        from stratum.sweep.simulate_file import simulate_sweep
        hw = load_hardware(args.hardware) if args.hardware else None
        simulate_sweep(args.config, png=Path(args.png) if args.png else None, hardware=hw)
        return 0
    from stratum.sweep.runner import run_sweep
    from stratum.train.progress import make_console
    console = make_console()
    if not console.is_terminal:
        try:
            sweep = run_sweep(args.config, say=lambda line: print(line, flush=True), retry_failed=args.retry_failed)
        except BrokenPipeError:  # `| head`: the runner stopped the jobs, as on Ctrl-C
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's flush cannot fail again)
            print("stratum: the sweep's output was closed (its reader ended): its running jobs were stopped as on "
                  "Ctrl-C; run the same command to resume", file=sys.stderr)
            return 1
    else:
        from stratum.sweep.live import LiveTable
        live = LiveTable(console)
        try:
            sweep = run_sweep(args.config, say=live.say, tick=lambda sw: live.tick(sw.state.jobs(), sw.dir),
                              retry_failed=args.retry_failed)
        finally:
            live.close()
    rows = sweep.state.jobs()
    return 0 if all(r.status in ("done", "stopped") for r in rows) else 1
