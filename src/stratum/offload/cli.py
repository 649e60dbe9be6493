"""``stratum plan``: the offload engine's plan for a config, without training.

    stratum plan --set model.preset=gpt2-774m --set offload.device_budget=1GB --set offload.host_budget=1GB

Builds the model on the meta device (no memory), profiles it one block at a time (or reads ``--profile``),
measures the bandwidths, searches the placements and prints the chosen one: chunk size, device-resident chunks,
optimizer placement, prefetch depth, per-tier predicted peak bytes and traffic per step, predicted step time.
An infeasible budget is a one-line error naming the smallest budget that works.
"""

from __future__ import annotations

import argparse

from stratum.errors import StratumError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="print the offload engine's plan (tiers, chunks, predicted bytes and time)")
    p.add_argument("--config", metavar="FILE.toml", help="TOML config file (defaults apply to what it omits)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config field (repeatable), e.g. --set offload.device_budget=2GB")
    p.add_argument("--profile", metavar="FILE.json", help="use this `stratum profile` output instead of profiling")
    p.add_argument("--json", dest="json_out", metavar="FILE.json", help="also write the plan as JSON")
    return p


def plan_from_config(cfg, profile_path: str | None = None):
    from stratum.data.corpus import resolve_corpus
    from stratum.data.prepare import make_tokenizer
    from stratum.model.build import build_model
    from stratum.offload.setup import plan_for
    from stratum.profile import Profile
    from stratum.runtime.device import resolve_device

    device = resolve_device(cfg.train.device)
    tok = make_tokenizer(cfg, resolve_corpus(cfg.data.corpus))
    model = build_model(cfg.model, tokenizer_vocab=tok.vocab_size, seq_len=cfg.data.seq_len, seed=cfg.train.seed,
                        device="meta")
    if profile_path:
        prof = Profile.load(profile_path)
        if len(prof.blocks) != len(model):
            raise StratumError(f"profile {profile_path} has {len(prof.blocks)} blocks but the model has {len(model)}; "
                               "re-run `stratum profile` with this config")
    else:
        prof = None  # measured by plan_for: each distinct block once
    return plan_for(cfg, model, device, profile=prof, always_profile=True), model


def run(args: argparse.Namespace) -> int:
    from stratum.config import load_config
    from stratum.offload.units import fmt_bytes

    cfg = load_config(args.config, args.overrides)
    plan, model = plan_from_config(cfg, args.profile)
    n = model.num_params()
    print(f"model {model.info.name}: {n:,} parameters; training state (params + grads + AdamW) "
          f"{fmt_bytes(16 * n)}; micro-batch {cfg.train.micro_batch_size} × {cfg.data.seq_len} tokens, "
          f"{cfg.train.grad_accum} per step")
    print(plan.describe())
    if args.json_out:
        from stratum.atomic import atomic_write_json
        atomic_write_json(args.json_out, plan.to_dict())
        print(f"wrote {args.json_out}")
    return 0
