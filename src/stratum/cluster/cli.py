"""``stratum cluster``: replay a job trace on a hardware spec under allocation policies (SIMULATED), or generate
a trace.

Runbook
-------
::

    stratum cluster trace --hardware hw.toml --out jobs.csv --jobs 200 --seed 0      # Philly-like, seeded
    stratum cluster simulate --hardware hw.toml --jobs jobs.csv --policy all \\
        --png util.png --json sim.json                                              # every policy, one table

The trace format and the policies are in docs/cluster.md. A trace's models are measured once on this machine's
CPU (a few minutes for gpt2-1.5b) and cached; later runs are instant. Bad hardware specs and traces are one-line
errors (exit 2).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

from stratum.atomic import check_writable
from stratum.cluster.cluster import pick
from stratum.cluster.generate import TraceSpec, generate
from stratum.cluster.models import ModelCosts, known_models, preset_costs
from stratum.cluster.replay import PolicyConfig, parse_policies, replay, trace_costs
from stratum.cluster.report import table, write_json, write_png
from stratum.cluster.scaling import check_fits, dp_step, holders
from stratum.cluster.trace import Job, load_trace, write_trace
from stratum.config import Config
from stratum.errors import StratumError
from stratum.ir.hardware import load_hardware


def _cache_dir(args) -> Path:
    return Path(args.cache_dir).expanduser() if args.cache_dir else Config().cache_dir


def run(args: argparse.Namespace) -> int:
    if not args.hardware:
        raise StratumError(f"stratum cluster {args.action} needs --hardware FILE.toml (see docs/cluster.md)")
    if args.action == "trace":
        return _trace(args, load_hardware(args.hardware))
    return _simulate(args, load_hardware(args.hardware))


def _simulate(args, hw) -> int:
    if not args.jobs:
        raise StratumError("stratum cluster simulate needs --jobs TRACE.csv")
    if given := [f for f, v in (("--out", args.out), ("--seed", args.seed), ("--load", args.load),
                                ("--models", args.models), ("--seq-len", args.seq_len)) if v is not None]:
        raise StratumError(f"{', '.join(given)}: options of a generated trace (stratum cluster trace); simulate "
                           "reads its trace from --jobs")
    if args.png is not None:
        check_writable(args.png, "--png", ".png")
    if args.json is not None:
        check_writable(args.json, "--json")
    until = math.inf if args.until is None else args.until
    if not until > 0:
        raise StratumError(f"--until must be > 0 seconds, got {until}")
    policies = parse_policies(args.policy or "all")
    knobs = {k: v for k, v in (("amplification", args.amplification), ("interference", args.interference),
                               ("startup_s", args.restart_startup)) if v is not None}
    config = replace(PolicyConfig(), **knobs)
    jobs = load_trace(args.jobs, models=known_models(), devices=hw.num_devices)
    results = replay(hw, jobs, trace_costs(jobs, _cache_dir(args)), policies, config=config, until_s=until)
    print(table(results))
    if args.json is not None:
        write_json(args.json, results)
        print(f"wrote {args.json}")
    if args.png is not None:
        write_png(args.png, results, title=f"{Path(args.jobs).name} on {hw.num_devices} devices")
        print(f"wrote {args.png}")
    return 0


def _trace(args, hw) -> int:
    if not args.out:
        raise StratumError("stratum cluster trace needs --out FILE.csv")
    if given := [f for f, v in (("--policy", args.policy), ("--png", args.png), ("--json", args.json),
                                ("--until", args.until), ("--amplification", args.amplification),
                                ("--restart-startup", args.restart_startup), ("--interference", args.interference))
                 if v is not None]:
        raise StratumError(f"{', '.join(given)}: options of stratum cluster simulate; trace only writes the jobs "
                           "(simulate them with simulate --jobs FILE.csv)")
    try:
        n = int(args.jobs or "")
    except ValueError:
        raise StratumError(f"stratum cluster trace: --jobs must be a number of jobs, got {args.jobs!r}") from None
    spec = TraceSpec(jobs=n, seed=args.seed or 0, devices=hw.num_devices,
                     load=1.0 if args.load is None else args.load)
    if args.models:
        spec = replace(spec, models=tuple(m.strip() for m in args.models.split(",") if m.strip()))
    if args.seq_len is not None:
        spec = replace(spec, seq_len=args.seq_len)
    costs: dict[tuple[str, int], ModelCosts] = {}

    def model_costs(job: Job) -> ModelCosts:
        key = (job.model, job.seq_len)
        if key not in costs:
            try:
                costs[key] = preset_costs(job.model, seq_len=job.seq_len, cache_dir=_cache_dir(args))
            except StratumError as e:
                raise StratumError(f"model {job.model} at {job.seq_len} tokens: {e}; choose others with --models "
                                   "or --seq-len") from None
            try:
                check_fits(costs[key], hw.devices, f"model {job.model}")
            except StratumError as e:
                raise StratumError(f"{e} (stratum cluster trace --models chooses the models)") from None
        return costs[key]

    def holding(model: str) -> int:
        probe = Job(id=model, arrival_s=0, model=model, batch=1, steps=1, devices=1, seq_len=spec.seq_len)
        return len(holders(model_costs(probe), hw.devices))

    def step_s(job: Job) -> float:
        mc = model_costs(job)
        ranks = pick(hw, holders(mc, hw.devices), job.devices)
        return dp_step(mc, batch=job.batch, ranks=ranks, hw=hw).step_s

    jobs = generate(spec, step_s, holding)
    write_trace(args.out, jobs)
    print(f"wrote {args.out}: {len(jobs)} jobs over {jobs[-1].arrival_s / 3600:.1f} h (seed {spec.seed}, "
          f"load {spec.load:g})")
    return 0
