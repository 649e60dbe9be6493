"""``stratum plan``: the offload engine's plan for a config, without training.

    stratum plan --set model.preset=gpt2-774m --set offload.device_budget=1GB --set offload.host_budget=1GB
    stratum plan --set model.preset=gpt2-774m --sweep 10%,25%,50%,2GB   # one row per device budget
    stratum plan --parallel --devices 4 [--hardware hw.toml]   # Plan trees ranked (stratum.plan.search_cli)

Builds the model on the meta device (no memory), profiles it one block at a time (or reads ``--profile``),
measures the bandwidths, searches the placements and prints the chosen one: chunk size, device-resident chunks,
optimizer placement, prefetch depth, per-tier predicted peak bytes and traffic per step, predicted step time.
An infeasible budget is a one-line error naming the smallest budget that works. ``--sweep`` plans several device
budgets (sizes, or percentages of the training state) from one profile and prints one row each — placement,
predicted peaks, traffic and step time — to choose a budget by; a budget that cannot fit gets a row saying so.
"""

from __future__ import annotations

import argparse

from stratum.atomic import atomic_write_json
from stratum.config import Config, load_config
from stratum.errors import StratumError
from stratum.ir.plan import Local, Offload
from stratum.offload.cli_args import DEFAULT_SWEEP
from stratum.offload.plan_inputs import estimated_profile, planning_inputs, planning_profile, profile_from
from stratum.offload.planner import make_placement
from stratum.offload.setup import ram_note
from stratum.offload.tiers import DEVICE
from stratum.parallel.pipeline_offload import leaf_config
from stratum.plan.search_cli import run_search
from stratum.runtime.device import resolve_device
from stratum.units import Size, fmt_bytes, parse_bytes, parse_percent


def sweep_budgets(text: str, state_bytes: int) -> list[tuple[str, int]]:
    """``"10%,2GB"`` → [(label, device budget bytes)]: a percentage is of ``state_bytes`` (the training state)."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if item.endswith("%"):
            out.append((item, int(state_bytes * parse_percent(item, "--sweep") / 100)))
        else:
            out.append((item, Size(parse_bytes(item, "--sweep"), item)))  # answered in the units typed
    if not out:
        raise StratumError(f"--sweep needs at least one budget, e.g. {DEFAULT_SWEEP}")
    return out


def print_sweep(model, inputs: dict, budgets: list[tuple[str, int]], timed: bool = True) -> None:
    """Plan each device budget with the same profile and bandwidths (``inputs``: ``planning_inputs``); print a row
    per budget (``timed`` False: without the step time, which an estimate does not predict)."""
    head = (f"{'device budget':>18} {'params':>6} {'optim':>6} {'slots':>5} {'activations':>11} {'peak device':>12} "
            f"{'peak host':>11} {'disk':>10} {'h2d/step':>10} {'d2h/step':>10} {'disk r+w':>10} {'step (s)':>9}")
    print(head)
    for label, b in budgets:
        name = f"{label} ({fmt_bytes(b)})" if label != fmt_bytes(b) else label
        try:
            p = make_placement(model, **{**inputs, "device_budget": b})
        except StratumError as e:
            print(f"{name:>18} does not fit: {str(e).split('; ')[-1]}")
            continue
        tr, pk = p.predicted_traffic, p.predicted_peak
        slots = "all" if p.param_tier == DEVICE else str(p.resident_chunks)
        print(f"{name:>18} {p.param_tier:>6} {p.optimizer_tier:>6} {slots:>5} {p.activations:>11} "
              f"{fmt_bytes(pk['device']):>12} {fmt_bytes(pk['host']):>11} {fmt_bytes(pk['disk']):>10} "
              f"{fmt_bytes(tr['h2d']):>10} {fmt_bytes(tr['d2h']):>10} "
              f"{fmt_bytes(tr['disk_read'] + tr['disk_write']):>10} "
              + (f"{p.predicted_step_s:>9.3f}" if timed else f"{'-':>9}"))


def untimed(plan) -> str:
    """The plan's description with its step-time line replaced by what an estimate knows: activation bytes."""
    lines = [line for line in plan.describe().splitlines() if not line.startswith("  predicted step time")]
    lines.append(f"  activations {fmt_bytes(plan.act_bytes)} per micro-batch (from the shapes); step time not "
                 "predicted: --estimate runs nothing (leave it out to measure the blocks)")
    return "\n".join(lines)


def _one_engine(cfg: Config) -> Config:
    """``cfg`` as the one offload engine this command plans: a parallel.plan of the offload leaf alone lends it
    the leaf's budgets; a plan over several processes is refused (each rank plans its own part)."""
    plan = cfg.plan
    if isinstance(plan.root, Offload):
        return leaf_config(cfg, plan.root)
    if not isinstance(plan.root, Local):
        given = f"parallel.plan = {cfg.parallel.plan!r}" if cfg.parallel.plan.strip() else \
            f"train.engine = {cfg.train.engine!r} (plan {plan})"
        raise StratumError(f"stratum plan plans one offload engine; {given} runs several processes: "
                           "`stratum train --dry-run` prints each rank's placement, and "
                           "`stratum plan --parallel` ranks plan trees")
    return cfg


def run(args: argparse.Namespace) -> int:
    if args.parallel:
        return run_search(args)
    if args.devices is not None or args.hardware:
        raise StratumError("--devices and --hardware go with --parallel (the plan search)")
    cfg = _one_engine(load_config(args.config, args.overrides))
    if args.estimate and args.profile:
        raise StratumError("--estimate plans from the model's shapes and --profile from measured costs; give one")
    if args.sweep is not None:
        if args.json_out:
            raise StratumError("--json writes one plan; leave it out with --sweep")
        sweep_budgets(args.sweep, 1)  # bad input is refused before the model is profiled
    source = estimated_profile if args.estimate else profile_from(args.profile) if args.profile else planning_profile
    inputs, model = planning_inputs(cfg, source)
    if args.estimate:
        inputs["bandwidths"] = None  # bytes only: placements are compared by the bytes they move
    n = model.num_params()
    print(f"model {model.info.name}: {n:,} parameters; training state (params + grads + AdamW) "
          f"{fmt_bytes(16 * n)}; micro-batch {cfg.train.micro_batch_size} × {cfg.data.seq_len} tokens, "
          f"{cfg.train.grad_accum} per step")
    if args.sweep is not None:
        budgets = sweep_budgets(args.sweep, 16 * n)
        print(f"host budget {fmt_bytes(inputs['host_budget'])} in every row (offload.host_budget)")
        print_sweep(model, inputs, budgets, timed=not args.estimate)
        return 0
    plan = make_placement(model, **inputs)
    print((untimed(plan) if args.estimate else plan.describe()) + ram_note(plan, resolve_device(cfg.train.device)))
    if args.json_out:
        atomic_write_json(args.json_out, plan.to_dict())
        print(f"wrote {args.json_out}")
    return 0
