"""``stratum train --dry-run``: everything a run would decide, nothing it would compute."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from stratum.config import Config, to_toml
from stratum.data.corpus import resolve_corpus
from stratum.data.prepare import make_tokenizer
from stratum.errors import StratumError
from stratum.ir.plan import Local, Offload
from stratum.model.blockseq import BlockSeq
from stratum.model.build import build_model
from stratum.offload.placement import Placement
from stratum.offload.plan_inputs import planning_profile
from stratum.offload.setup import placement_for, ram_excess, ram_note
from stratum.offload.tiers import disk_base, disk_free_bytes
from stratum.parallel.compose import check_plan
from stratum.parallel.pipeline_offload import leaf_config, rank_placement
from stratum.runtime.device import describe, device_memory_bytes, resolve_device
from stratum.runtime.pipeline import PipelinePlan
from stratum.units import fmt_bytes


def plain_fit(state_bytes: int, available: int | None, device: torch.device, disk_dir: str) -> str:
    """Whether the plain engine can hold the training state on ``device`` (activations come on top), and what to
    do when it cannot: the offload engine under byte budgets, with the rest on the disk under ``disk_dir`` (the
    offload engine's; "" = the temp directory) — or, where that disk is too small for it, freeing space there."""
    if available is None:
        return f"fit: unknown (the memory of {device.type} cannot be read)"
    where = "GPU memory free" if device.type == "cuda" else "RAM available"
    if state_bytes < available:
        return (f"fit: the training state ({fmt_bytes(state_bytes)}) fits in the {fmt_bytes(available)} of "
                f"{where} (activations come on top)")
    dev_gb, host_gb = max(1, available // 2 // 10**9), max(1, available // 4 // 10**9)
    advice = (f"fit: the training state alone ({fmt_bytes(state_bytes)}) cannot fit in the {fmt_bytes(available)} "
              f"of {where} on this device; train it with the offload engine under byte budgets (what fits in "
              f"neither goes to disk), e.g. --set train.engine=offload --set offload.device_budget={dev_gb}GB --set "
              f"offload.host_budget={host_gb}GB; `stratum plan` with the same settings checks them")
    where_disk = disk_base(disk_dir)
    try:
        free = disk_free_bytes(where_disk)
    except OSError:
        return advice
    on_disk = state_bytes - (dev_gb + host_gb) * 10**9
    if on_disk > free:
        advice += (f" — but the {fmt_bytes(on_disk)} left for the disk is more than the {fmt_bytes(free)} free under "
                   f"{where_disk}: free space there or set offload.disk_dir to a larger disk")
    return advice


def dry_run(cfg: Config) -> dict:
    """Print the resolved config, derived values and the model's blocks (built on the meta device: no memory)."""
    device = resolve_device(cfg.train.device)
    corpus = resolve_corpus(cfg.data.corpus)
    tok = make_tokenizer(cfg, corpus)
    model = build_model(cfg.model, tokenizer_vocab=tok.vocab_size, seq_len=cfg.data.seq_len,
                        seed=cfg.train.seed, device="meta")
    n, state = model.num_params(), model.train_state_bytes()
    print(to_toml(cfg))
    print(cfg.derived_summary())
    print(f"device {describe(device)}; plan {cfg.plan}; corpus {corpus.files_text}, "
          f"{corpus.total_bytes:,} bytes; tokenizer {tok.name} (vocab {tok.vocab_size})")
    print(f"model {model.info.name}: {n:,} parameters in {len(model)} blocks; training state (params + grads + "
          f"AdamW) {fmt_bytes(state)}; {model.flops_per_token(cfg.data.seq_len) / 1e9:.3f} GFLOP per token")
    for i, name in enumerate(model.block_names):
        owned = model.owned_numel(i)
        print(f"  {i:>3} {name:<16} {type(model.blocks[i]).__name__:<16} {owned:>14,} params")
    for g in model.tied:
        print(f"  tied: {' = '.join(g.names)}")
    plan = cfg.plan
    stages = check_plan(cfg, tokenizer_vocab=tok.vocab_size)
    print(f"processes: {plan.world_size()} (replicas × pipeline ranks × splits = "
          f"{' × '.join(map(str, plan.mesh_shape))})")
    print(plan.table(stages.blocks_of if stages else lambda _: list(range(len(model)))))
    # a model too big for the plain engine is advice (the fit line names the budgets to use); a plan whose offload
    # leaf cannot be placed under the budgets given is bad input, as the run would say: the exit code tells a script
    problems: list[str] = []
    if isinstance(plan.root, Local):
        print(plain_fit(state, device_memory_bytes(device), device, cfg.offload.disk_dir))
    if isinstance(plan.leaf, Offload):
        problems += _print_placements(leaf_config(cfg, plan.leaf), model, device, stages,
                                      split=plan.split is not None)
    return {"params": n, "train_state_bytes": state, "problems": problems}


def _print_placements(cfg: Config, model: BlockSeq, device: torch.device, stages: PipelinePlan | None, *,
                      split: bool) -> list[str]:
    """The offload leaf's placement under its own budgets: the model's, or each pipeline rank's for its blocks
    (as that rank plans it at start-up). Returns why the run would stop there (none: it would start)."""
    prof = planning_profile(cfg, model, device)
    if split:
        print("offload under split: each split rank plans its 1/n of every block's split weights at start-up; "
              "the placement below is the unsplit model's, an upper bound on a rank's")
    if stages is None:
        return _print_placement(lambda: placement_for(cfg, model, device, profile=prof), device)
    problems = []
    for rank in range(stages.schedule.num_ranks):
        mine = stages.blocks_of(rank)
        print(f"pipeline rank {rank} (blocks {mine[0]}–{mine[-1]}):")
        problems += [f"pipeline rank {rank}: {p}" for p in _print_placement(
            functools.partial(rank_placement, cfg, model, stages, mine, device, prof), device)]
    return problems


def _print_placement(make: Callable[[], Placement], device: torch.device) -> list[str]:
    """Print the placement ``make()`` plans on ``device``, or why none fits; returns why the run would stop there
    (the planner's refusal, or a plan larger than the RAM)."""
    try:
        placement = make()
    except StratumError as e:
        print(f"does not fit — {e}")
        return [str(e)]
    print(placement.describe() + ram_note(placement, device))
    return ["the offload plan holds more than the RAM available (the note above)"] \
        if ram_excess(placement, device) else []
