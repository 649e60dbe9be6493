"""``stratum``: the command line.

Runbook
-------
One process, the built-in default (a small GPT on this Python's standard-library sources)::

    stratum train                                   # prints progress, ends with a summary
    stratum train --config configs/gpt2-124m.toml --set train.steps=500 --set optim.lr=6e-4
    stratum train --dry-run                         # resolved config, derived values, model size; no training
    stratum profile --set model.preset=gpt2-124m --out profile.json
    stratum config                                  # every config key, its default and what it does
    stratum plan --set offload.device_budget=1GB    # the offload engine's placement plan, per tier; no training
    stratum schedule show --kind wave --ranks 4 --microbatches 8   # pipeline schedules as tables

A run writes ``<out_dir>/metrics.jsonl`` (a JSON object per step), ``summary.json``, ``config.toml`` and
``checkpoints/``; running the same command again resumes from the last checkpoint (bit-exact).

N processes and clusters: ``--set parallel.plan='replicate(2, pipeline(2))'`` spawns the plan's 4 local processes
itself (only rank 0 prints and writes); the same command works under ``torchrun`` and its rendezvous
(``torchrun --nnodes M --nproc_per_node N -m stratum train ...`` with a plan of M·N processes). See
docs/parallel.md and docs/pipeline.md.

Bad input (unknown key, wrong type, missing corpus, unwritable out_dir, incompatible checkpoint) prints
``stratum: error: ...`` and exits with code 2.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import NoReturn

from stratum.atomic import check_writable
from stratum.dist.roles import HF_PRELOAD, is_worker, warm_up
from stratum.errors import INTERRUPTED, PeerError, StratumError
from stratum.log import console

MAX_PROFILE_RUNS = 1000
WORKERS_LOG = "workers.log"
"""In a multi-process run's out_dir: what the ranks wrote to stderr besides Stratum's own lines (tracebacks,
torch's and gloo's messages), each line marked with its rank."""


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as Stratum's one line (``stratum: error: …``, exit code 2) instead of a
    usage block; subcommands' parsers are of this class too (argparse makes them with the parent's class)."""

    def error(self, message: str) -> NoReturn:
        where = f"{self.prog.removeprefix('stratum ')}: " if self.prog != "stratum" else ""
        sys.stderr.write(f"stratum: error: {where}{message}; see {self.prog} --help\n")
        sys.exit(2)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE.toml", help="TOML config file (defaults apply to what it omits)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config field (repeatable), e.g. --set train.steps=100")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="stratum", description="Train large models, and many of them, on the "
                                     "devices you have.", formatter_class=argparse.RawDescriptionHelpFormatter)
    from stratum import __version__
    parser.add_argument("--version", action="version", version=f"stratum {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("train", help="train a model (default: a small GPT on the standard library's sources)")
    _add_config_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and model, then exit")
    p.add_argument("--stop-at", type=int, metavar="STEP",
                   help="stop after this many completed steps (with a checkpoint); resume later")

    p = sub.add_parser("profile", help="measure each block's time and bytes; write a Profile JSON")
    _add_config_args(p)
    p.add_argument("--out", default="profile.json", help="where to write the profile (default: profile.json)")
    p.add_argument("--runs", type=int, default=5, help="timed runs per block; the median is kept (default: 5)")

    sub.add_parser("config", help="list every config key with its default and description")

    p = sub.add_parser("run", help="run your own script (stratum.parallelize) as N local processes")
    p.add_argument("--nproc", type=int, required=True, metavar="N", help="processes: the plan's process count")
    p.add_argument("--timeout-s", type=float, default=30.0, help="grace for the others after one fails")
    p.add_argument("script", help="a Python script that calls stratum.parallelize")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")

    try:
        from stratum.schedule.cli import add_parser as add_schedule
    except ImportError:
        pass
    else:
        add_schedule(sub)
    from stratum.offload.cli_args import add_parser as add_plan
    add_plan(sub)
    from stratum.sweep.cli import add_parser as add_sweep
    add_sweep(sub)
    from stratum.cluster.cli_args import add_parser as add_cluster
    add_cluster(sub)
    from stratum.train.sample_cli import add_parser as add_sample
    add_sample(sub)
    from stratum.train.export_cli import add_parser as add_export
    add_export(sub)
    from stratum.plan.hardware_args import add_parser as add_hardware
    add_hardware(sub)
    return parser


def _run(args: argparse.Namespace) -> int:
    from stratum.config import describe, load_config

    if args.command == "config":
        print(describe())
        return 0
    if args.command == "schedule":
        from stratum.schedule.cli import run as run_schedule
        return run_schedule(args)
    if args.command == "plan":
        from stratum.data.prepare import make_tokenizer
        from stratum.offload.cli import run as run_plan
        from stratum.train.fit import check_blocks
        cfg = load_config(args.config, args.overrides)
        check_blocks(cfg, tokenizer_vocab=make_tokenizer(cfg).vocab_size)  # the plan profiles block by block
        _measure_at_run_threads(cfg)
        return run_plan(args)
    if args.command == "run":
        return _run_script(args)
    if args.command == "sweep":
        from stratum.sweep.cli import run as run_sweep
        return run_sweep(args)
    if args.command == "cluster":
        from stratum.cluster.cli import run as run_cluster
        return run_cluster(args)
    if args.command == "sample":
        from stratum.train.sample_cli import run as run_sample
        return run_sample(args)
    if args.command == "export":
        from stratum.train.export_cli import run as run_export
        return run_export(args)
    if args.command == "hardware":
        from stratum.plan.hardware_cli import run as run_hardware
        return run_hardware(args)

    cfg = load_config(args.config, args.overrides)
    if args.command == "train" and cfg.parallel.auto:  # the ranks get the chosen tree
        from stratum.plan.search_cli import choose_plan
        choice = choose_plan(cfg, args.config, args.overrides)
        cfg = choice.config
        if not args.dry_run:
            choice.record()
    if args.command == "train":
        if args.stop_at is not None and args.stop_at < 1:
            raise StratumError("--stop-at must be ≥ 1")
        if args.dry_run:
            from stratum.train.dryrun import dry_run
            _measure_at_run_threads(cfg)
            problems = dry_run(cfg)["problems"]
            if problems:  # (a script asking whether a config would run reads the exit code)
                print(f"stratum: error: this run would not start: {problems[0]}", file=sys.stderr)
                return 2
            return 0
        if cfg.plan.world_size() > 1 and not is_worker():
            return _spawn_workers(cfg, args)
        from stratum.train.trainer import train
        train(cfg, stop_at=args.stop_at)
        return 0
    if args.command == "profile":
        if not 1 <= args.runs <= MAX_PROFILE_RUNS:
            raise StratumError(f"--runs must be in [1, {MAX_PROFILE_RUNS}] (the median of a few is stable)")
        from stratum.train.fit import check_batches
        check_batches(cfg)
        check_writable(args.out, "the profile")  # before the measuring, which can take long
        from stratum.profile.profiler import profile_from_config
        _measure_at_run_threads(cfg)
        prof = profile_from_config(cfg, runs=args.runs)
        prof.save(args.out)
        print(prof.table())
        print(f"wrote {args.out}")
        return 0
    raise AssertionError(args.command)


def _measure_at_run_threads(cfg) -> None:
    """What a command measures for a run (a profile, a plan, a dry run) is measured at the threads each of the
    run's processes will train with: ``train.threads``, or this machine's cores shared among the plan's local
    processes (one process for ``auto``, whose search measures as one)."""
    from stratum.train.threads import apply_threads, threads_among
    apply_threads(cfg.train.threads or threads_among(1 if cfg.parallel.auto else cfg.plan.world_size()))


def _spawn_workers(cfg, args: argparse.Namespace) -> int:
    """Check the plan and prepare the data here, then run the same command in as many local worker processes as
    the plan needs (each joins the process groups from its environment)."""
    # the ranks' forkserver imports torch, the trainer (and the model's library) while this process prepares
    warm_up(HF_PRELOAD if cfg.model.source == "hf" else ())
    from pathlib import Path

    from stratum.atomic import missing_dirs, remove_empty_dirs
    from stratum.data.prepare import prepare_data
    from stratum.dist.launch import PEER_GRACE_S, spawn_local
    from stratum.parallel.compose import check_plan
    from stratum.train.lock import hold_out_dir, inherited_lock_env
    from stratum.train.trainer import prepare_out_dir

    data = prepare_data(cfg)  # corpus errors surface here, and the workers find the caches ready
    # nesting / sizes / stages / backend / a partition's profile: one-line errors before any rank starts
    check_plan(cfg, tokenizer_vocab=data.tokenizer.vocab_size)
    out_dir = Path(cfg.train.out_dir).expanduser()
    made = missing_dirs(out_dir)
    prepare_out_dir(out_dir)
    argv = ["-m", "stratum", "train"] + (["--config", args.config] if args.config else [])
    for o in args.overrides:
        argv += ["--set", o]
    if args.stop_at is not None:
        argv += ["--stop-at", str(args.stop_at)]
    with hold_out_dir(out_dir):  # for the ranks: rank 0 finds it held by its launcher (inherited_lock_env)
        code = spawn_local(argv, cfg.plan.world_size(), grace_s=cfg.parallel.timeout_s + 5,
                           env=inherited_lock_env(out_dir), log=out_dir / WORKERS_LOG, fail_grace_s=PEER_GRACE_S)
    if code != 0:  # refused by the workers (bad input found there): no empty out_dir left behind
        remove_empty_dirs(made)
    return code


def _run_script(args: argparse.Namespace) -> int:
    """``stratum run``: the user's script in ``--nproc`` local worker processes, as torchrun would start them."""
    from pathlib import Path

    from stratum.dist.launch import spawn_local
    if args.nproc < 1:
        raise StratumError("--nproc must be ≥ 1")
    if not 0 <= args.timeout_s < float("inf"):  # (NaN fails the comparison too)
        raise StratumError(f"--timeout-s must be a finite number of seconds ≥ 0, got {args.timeout_s}")
    script = Path(args.script)
    if not script.is_file():
        raise StratumError(f"script {args.script!r} " + ("is a directory; give the Python file to run"
                                                         if script.is_dir() else "does not exist"))
    return spawn_local([args.script, *args.script_args], args.nproc, grace_s=args.timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["train", *(argv if argv is not None else sys.argv[1:])])
    try:
        with console():  # library messages (the stratum logger) shown as the command's output
            return _run(args)
    except StratumError as e:
        sys.stderr.write(f"stratum: error: {e}\n")  # one write: lines of several ranks do not interleave
        sys.stderr.flush()
        if isinstance(e, PeerError) and is_worker():
            # a peer is gone: leave now rather than let process-group teardown wait on it
            sys.stdout.flush()
            os._exit(e.exit_code)
        return e.exit_code
    except KeyboardInterrupt as e:
        if not getattr(e, "shown", False):  # (a launcher's Stopped, whose ranks said it already)
            # (a script of the user's keeps checkpoints of its own, if any: nothing to promise about them)
            print("stratum: interrupted" if args.command == "run" else INTERRUPTED, file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): nothing more is wanted, and nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the exit's flush cannot fail again)
        return 0
    except OSError as e:
        if e.errno != errno.ENAMETOOLONG:
            raise
        # (pathlib's exists/is_file/is_dir raise it, wherever a path given on the command line or in a config
        # is first looked at: one place answers for all of them)
        name = str(e.filename or "")
        shown = name if len(name) <= 80 else f"{name[:40]}…{name[-30:]} ({len(name):,} characters)"
        sys.stderr.write(f"stratum: error: the path {shown} is too long for the filesystem (a name over 255 bytes "
                         "or a path over 4096); give a shorter one\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
