"""``stratum schedule show|validate|simulate``: print, validate and simulate pipeline schedules.

The main CLI calls :func:`add_parser` on its subparsers and :func:`run` with the parsed namespace; bad input
raises :class:`StratumError` (printed as a one-line error, exit code 2).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from stratum.atomic import check_writable
from stratum.errors import StratumError
from stratum.plan.partition import even_partition, inflight_from_schedule, partition, stage_costs
from stratum.profile.profile import Profile
from stratum.schedule.generators import KINDS, SEARCHED, TORCH_PREFIX, generate, is_kind, size_knob
from stratum.schedule.ir import Schedule
from stratum.schedule.textio import load, save
from stratum.schedule.validate import validate
from stratum.sim.pipeline import Costs, simulate
from stratum.sim.trace import write_chrome_trace, write_png

MAX_GENERATED = 100_000
"""Largest ranks × micro-batches (× virtual or waves, for the kinds that read them) generated: a schedule of this
size is generated and checked in about ten seconds."""
MAX_SEARCHED = 20_000
"""The same for the kinds whose generator searches several orders (generators.SEARCHED), which take as long at
a fifth of the size."""
VALID = "valid: every action present once, dependencies hold, no deadlock"


def _kind(text: str) -> str:
    """argparse type of ``--kind``: a generator name or ``torch:NAME``."""
    if not is_kind(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(KINDS)} or {TORCH_PREFIX}NAME")
    return text


GENERATOR_DEFAULTS = {"kind": "1f1b", "ranks": 4, "microbatches": 8, "virtual": 2, "waves": 1}
"""The generator flags' values where they are not given; a ``--file`` takes none of them."""


def _common(p: argparse.ArgumentParser) -> None:
    d = GENERATOR_DEFAULTS
    p.add_argument("--kind", type=_kind, default=None, metavar="KIND",
                   help=f"schedule generator: {', '.join(KINDS)}, or {TORCH_PREFIX}NAME for a "
                   f"torch.distributed.pipelining schedule class, e.g. torch:ZBVZeroBubble (default {d['kind']})")
    p.add_argument("--ranks", type=int, default=None, help=f"pipeline ranks P (default {d['ranks']})")
    p.add_argument("--microbatches", type=int, default=None,
                   help=f"micro-batches m per step (default {d['microbatches']})")
    p.add_argument("--virtual", type=int, default=None, help="stages per rank for --kind interleaved and torch's "
                   f"multi-stage classes (default {d['virtual']})")
    p.add_argument("--waves", type=int, default=None, help=f"waves W for --kind wave/zb-wave (default {d['waves']})")
    p.add_argument("--file", default=None, help="read the schedule from this text file instead of generating "
                   "(the file gives the ranks and micro-batches: no generator flag goes with it)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``schedule`` (with ``show``, ``validate`` and ``simulate``) to an argparse subparsers object."""
    p = subparsers.add_parser("schedule", help="show, validate and simulate pipeline schedules")
    sub = p.add_subparsers(dest="schedule_cmd", metavar="{show,validate,simulate}")
    sub.required = True
    show = sub.add_parser("show", help="print a schedule as a rank x time-slot table (validates it)")
    _common(show)
    show.add_argument("--save", default=None, help="also write the schedule in the text format to this path")
    check = sub.add_parser("validate", help="check a schedule (e.g. a hand-written --file): every action once, "
                           "dependencies hold, no deadlock; exit code 2 with the reason if not")
    _common(check)
    sim = sub.add_parser("simulate", help="simulate a schedule: makespan, bubble, peak activations (SIMULATED)")
    _common(sim)
    sim.add_argument("--profile", default=None, help="Profile JSON (stratum profile); blocks are cut into the "
                     "schedule's stages by --partition. Without it: unit costs F=1 B=2 I=1 W=1 per rank")
    sim.add_argument("--partition", choices=("even", "balanced"), default="even", help="with --profile: 'even' "
                     "cuts equal block counts, 'balanced' balances profiled time per rank (stratum.plan; "
                     "default even)")
    sim.add_argument("--latency", type=float, default=0.0, help="point-to-point latency, seconds (default 0)")
    sim.add_argument("--bandwidth", type=float, default=math.inf, help="point-to-point bandwidth, bytes/s "
                     "(default infinite)")
    sim.add_argument("--trace", default=None, help="write a Chrome trace JSON here")
    sim.add_argument("--png", default=None, help="write a PNG timeline here (needs matplotlib)")
    p.set_defaults(func=run)
    return p


def _schedule(args) -> Schedule:
    given = {name: v for name in GENERATOR_DEFAULTS if (v := getattr(args, name)) is not None}
    for name, value in given.items():
        if name != "kind" and value < 1:  # checked even where the kind does not use it: a typo is never ignored
            raise StratumError(f"--{name} must be ≥ 1, got {value}")
    if args.file:
        if given:  # the file fixes every one of them; a flag beside it would be silently ignored
            flags = ", ".join(f"--{name}" for name in given)
            raise StratumError(f"{flags} and --file both describe the schedule; the file gives its ranks and "
                               "micro-batches, so leave the generator flags out")
        return load(args.file)  # validates
    o = {**GENERATOR_DEFAULTS, **given}
    knob = size_knob(o["kind"])
    size = o["ranks"] * o["microbatches"] * (o[knob] if knob else 1)
    most = MAX_SEARCHED if o["kind"] in SEARCHED else MAX_GENERATED
    if size > most:
        product = "--ranks × --microbatches" + (f" × --{knob}" if knob else "")
        raise StratumError(f"{product} = {size:,} is more than the {most:,} a {o['kind']} schedule is generated "
                           "and checked for in seconds; use fewer ranks or micro-batches")
    s = generate(o["kind"], ranks=o["ranks"], microbatches=o["microbatches"], virtual=o["virtual"],
                 waves=o["waves"])
    validate(s)
    return s


def _check_outputs(args) -> None:
    """The output flags given, refused before any work where they cannot be written as asked."""
    given: dict[str, str] = {flag: path for flag, name in (("--save", "save"), ("--trace", "trace"), ("--png", "png"))
                             if (path := getattr(args, name, None)) is not None}
    for flag, path in given.items():
        check_writable(path, flag, ".png" if flag == "--png" else "")
    paths = [str(Path(p).resolve()) for p in given.values()]
    if len(set(paths)) < len(paths):
        raise StratumError("two output flags name the same file; give each its own")
    save_to, read_from = given.get("--save"), getattr(args, "file", None)
    if save_to and read_from and Path(read_from).resolve() == Path(save_to).resolve():
        raise StratumError("--save would overwrite the --file it reads (and its comments); save to another file")


def run(args) -> int:
    """Execute ``stratum schedule show|simulate``; returns the exit code."""
    _check_outputs(args)
    if getattr(args, "partition", "even") == "balanced" and not args.profile:
        raise StratumError("--partition balanced balances profiled block times: give --profile FILE (from "
                           "`stratum profile`), or leave --partition out for unit costs")
    sched = _schedule(args)
    if args.schedule_cmd == "show":
        print(sched.describe())
        print(sched.table())
        print(VALID)
        if args.save:
            save(sched, args.save)
            print(f"wrote {args.save}")
        return 0
    if args.schedule_cmd == "validate":
        print(sched.describe())
        print(VALID)
        return 0
    if args.schedule_cmd != "simulate":
        raise StratumError(f"unknown schedule command {args.schedule_cmd!r}; use show, validate or simulate")
    if not (0 <= args.latency < math.inf and args.bandwidth > 0):  # NaN fails both comparisons
        raise StratumError("--latency must be a finite number ≥ 0 seconds and --bandwidth a number > 0 bytes/s")
    S = sched.num_stages
    if args.profile:
        prof = Profile.load(args.profile)
        if len(prof.blocks) < S:
            raise StratumError(f"profile has {len(prof.blocks)} blocks, fewer than the schedule's {S} stages")
        if args.partition == "balanced":
            part = partition(prof, sched.stage_to_rank, inflight=inflight_from_schedule(sched))
            print(part.table())
            costs = stage_costs(prof, part, latency=args.latency, bandwidth=args.bandwidth)
        else:
            costs = Costs.from_profile(prof, even_partition(len(prof.blocks), S), latency=args.latency,
                                       bandwidth=args.bandwidth)
    else:
        v = max(1, S // sched.num_ranks)
        costs = Costs.unit(S, stages_per_rank=v, latency=args.latency, bandwidth=args.bandwidth)
    res = simulate(sched, costs)
    print(res.summary())
    if args.trace:
        write_chrome_trace(res, args.trace)
        print(f"wrote {args.trace}")
    if args.png:
        write_png(res, args.png)
        print(f"wrote {args.png}")
    return 0
