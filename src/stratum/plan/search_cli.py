"""``stratum plan --parallel`` and ``parallel.plan = "auto"``: the auto plan search on a config's model.

Runbook::

    stratum plan --parallel --devices 4                       # this machine, measured (cached), 4 devices
    stratum plan --parallel --devices 8 --hardware hw.toml    # a spec from `stratum hardware probe` or by hand
    stratum train --set parallel.plan=auto --set parallel.devices=2     # trains with the best tree
    stratum train --set parallel.plan=auto --set parallel.devices=2 --dry-run   # prints the choice and why

The block costs are the offload planner's (measured on a small batch, scaled, cached per architecture:
:func:`stratum.offload.plan_inputs.planning_profile`), or ``--profile``. Without a hardware spec the machine is measured
by :func:`stratum.plan.hardware_cli.probe` once and the spec cached under the cache directory (delete it to
measure again). The step's micro-batches are ``train.grad_accum`` — the one-process step — so every tree trains
the same global batch: a tree with r replicas runs ``grad_accum / r`` micro-batches on each (the choice's
``train.grad_accum``). Predictions are SIMULATED; a run of the chosen tree writes them into its out_dir
(:mod:`stratum.plan.fidelity`), and its ``summary.json`` holds them beside the measured step time and peak memory.
"""

from __future__ import annotations

import argparse
import functools
import logging
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from stratum.atomic import atomic_write_text
from stratum.config import Config, load_config
from stratum.data.corpus import resolve_corpus
from stratum.data.prepare import make_tokenizer
from stratum.dist.launch import check_local_count
from stratum.errors import StratumError
from stratum.ir.costs import StepCosts
from stratum.ir.hardware import Hardware, dump_hardware, load_hardware
from stratum.ir.prices import allreduce_s
from stratum.model.blockseq import BlockSeq
from stratum.model.build import build_model
from stratum.offload.plan_inputs import planning_profile, profile_for
from stratum.offload.planner import make_placement
from stratum.offload.setup import placement_inputs
from stratum.parallel.split import check_split, split_blocks
from stratum.parallel.split_offload import shard_shapes
from stratum.plan.fidelity import recorded, write_prediction
from stratum.plan.hardware_cli import PROBE_TIMEOUT_S, probe
from stratum.plan.predict import SPLIT_REDUCTIONS, LeafAsk, Prediction, Workload
from stratum.plan.rank_probe import (
    PROBE_BUDGET_S,
    SPLIT_PROBE,
    RankProbe,
    as_ranks_run,
    probe_ranks,
    probe_seconds,
    split_block_s,
)
from stratum.plan.search import SearchResult, check_device_count, search
from stratum.plan.step_probe import measure_step_costs, probe_batches
from stratum.procs import usable_cores
from stratum.profile import Profile
from stratum.profile.fast import cache_key, cache_path
from stratum.runtime.device import device_memory_bytes, resolve_device, synchronize
from stratum.runtime.engine import OptimSpec
from stratum.runtime.optim import make_adamw, optim_spec
from stratum.train.checkpoint import latest_checkpoint
from stratum.train.threads import threads_among
from stratum.units import fmt_bytes

logger = logging.getLogger(__name__)
SHOWN = 20


def run_search(args: argparse.Namespace) -> int:
    """``stratum plan --parallel``: print the ranked table for ``--devices`` devices."""
    if args.sweep is not None or args.estimate or args.json_out:
        raise StratumError("--parallel ranks Plan trees; --sweep, --estimate and --json are the offload plan's")
    cfg = load_config(args.config, args.overrides)
    hw = load_hardware(args.hardware) if args.hardware else None
    n = args.devices if args.devices is not None else (hw.num_devices if hw else _default_devices())
    res, work = plan_search(cfg, n, hw, args.profile)
    print(res.table(SHOWN, label=lambda p: _label(p, work)))
    return 0


def plan_search(cfg: Config, n: int, hw: Hardware | None,
                profile_path: str | None = None) -> tuple[SearchResult, Workload]:
    """Search the trees of ``cfg``'s model for ``n`` devices of ``hw`` (None: this machine, measured)."""
    if n < 1:
        raise StratumError(f"--devices must be >= 1, got {n}")
    if hw is not None:  # (before anything is measured)
        check_device_count(n, hw)
    elif resolve_device(cfg.train.device).type == "cpu":
        check_local_count(n)
    model = _meta_model(cfg)
    work = workload(cfg, model, profile_path)
    if hw is None:
        hw, work = machine_ranks(cfg, n, work)
    logger.info(f"model {model.info.name}: {len(model)} blocks, {cfg.train.grad_accum} micro-batch(es) of "
                f"{cfg.train.micro_batch_size} × {cfg.data.seq_len} tokens per step; hardware: {hw.num_devices} "
                f"devices")
    return search(work, hw, n), work


def _meta_model(cfg: Config) -> BlockSeq:
    return _model(cfg, torch.device("meta"))


def _model(cfg: Config, device: torch.device) -> BlockSeq:
    return _builder(cfg, device)()


def _builder(cfg: Config, device: torch.device) -> Callable[[], BlockSeq]:
    """A picklable call that builds ``cfg``'s model on ``device`` (what a probe's processes each run)."""
    tok = make_tokenizer(cfg, resolve_corpus(cfg.data.corpus))
    return functools.partial(build_model, cfg.model, tokenizer_vocab=tok.vocab_size, seq_len=cfg.data.seq_len,
                             seed=cfg.train.seed, device=device)


STALE_SCALE = 3.0
"""A block profile (cached, or measured a moment ago) whose blocks the step probe now times this many times
faster or slower was taken under other load: it is measured once more (the scale corrects a uniform error, not
blocks measured at different moments of the load)."""


def workload(cfg: Config, model: BlockSeq, profile_path: str | None) -> Workload:
    """The search's view of ``cfg``'s step: costs (``profile_path`` or measured and cached), the blocks split
    shards and the split sizes the layers divide into, the weights the balanced cut uses."""
    device = resolve_device(cfg.train.device)
    splittable = tuple(split_blocks(model))
    sizes = tuple(s for s in range(2, 65) if splittable and _splits(model, s))
    update = update_seconds_per_param(device)
    if profile_path:
        prof = profile_for(cfg, model, profile_path)
        step = step_costs(cfg, prof, device, update, split=bool(sizes))
    else:
        t = cfg.train
        cached = cache_path(cfg.cache_dir, model, cache_key(model, micro_batch=t.micro_batch_size,
                                                             seq_len=cfg.data.seq_len, device=device,
                                                             precision=t.precision))
        prof = planning_profile(cfg, model, device)
        step = step_costs(cfg, prof, device, update, split=bool(sizes))
        if not 1 / STALE_SCALE <= step.block_scale <= STALE_SCALE:
            logger.info(f"the block profile times the blocks at {1 / step.block_scale:.3g}× what they take now "
                        f"(measured under other load): measuring them again")
            cached.unlink(missing_ok=True)
            prof = planning_profile(cfg, model, device)
            step = step_costs(cfg, prof, device, update, split=bool(sizes))
        profile_path = str(cached) if cached.is_file() else ""  # the profiled cut needs the file the ranks read
    weights = tuple(float(sum(q.numel() for q in b.parameters())) or 1.0 for b in model.blocks)
    return Workload(profile=prof, microbatches=cfg.train.grad_accum, splittable=splittable, split_sizes=sizes,
                    param_counts=weights, profile_path=profile_path or "", offload=_offload_pricer(cfg, model, prof),
                    update_s_per_param=update, step=step)


def step_costs(cfg: Config, prof: Profile, device: torch.device, update_s_per_param: float, *,
               split: bool) -> StepCosts:
    """The plain engine's step costs outside its blocks (:mod:`stratum.plan.step_probe`; with ``split``, a second
    copy's layers under DTensor too), measured on the real model where its copies' training state and two
    micro-batches' activations fit the device; none elsewhere (the memory engine's planner prices its own
    steps)."""
    too_big = _copies_do_not_fit(prof, 2 if split else 1, device)
    if too_big:
        logger.info(f"the step's costs outside its blocks are not measured: {too_big}")
        return StepCosts()
    t = cfg.train
    model = _model(cfg, device)
    if not model.info.vocab_size:  # the probe feeds token ids
        return StepCosts()
    return measure_step_costs(model, split_copy=_model(cfg, device) if split else None, profile=prof,
                              vocab=model.info.vocab_size, micro_batch=t.micro_batch_size, seq_len=cfg.data.seq_len,
                              optim=optim_spec(cfg), device=device,
                              update_s=update_s_per_param * sum(b.n_params for b in prof.blocks))


def _copies_do_not_fit(prof: Profile, copies: int, device: torch.device) -> str:
    """Why ``copies`` of the model's training state and two micro-batches' activations do not fit ``device``
    ("" where they do, or where the device's free memory is unknown)."""
    need = copies * (prof.param_bytes + sum(b.grad_bytes + b.optim_bytes + 2 * b.act_saved_bytes
                                            for b in prof.blocks))
    free = device_memory_bytes(device)
    if free is not None and need > free:
        return f"{copies} cop{'y' if copies == 1 else 'ies'} of the model need {fmt_bytes(need)} of the device's " \
               f"{fmt_bytes(free)}"
    return ""


def update_seconds_per_param(device: torch.device, n: int = 1 << 20, repeats: int = 5) -> float:
    """Seconds per parameter of the AdamW update the engines run (:func:`stratum.runtime.optim.make_adamw`: fused
    torch AdamW), the best of ``repeats`` steps over ``n`` parameters on ``device``; draws no random numbers."""
    p = torch.nn.Parameter(torch.zeros(n, device=device))
    p.grad = torch.full_like(p, 1e-3)
    opt = make_adamw([("w", p)], OptimSpec(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=0.0), device)
    for g in opt.param_groups:
        g["lr"] = 1e-3
    opt.step()  # allocates the moments
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        opt.step()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best / n


def _offload_pricer(cfg: Config, model: BlockSeq, prof: Profile) -> Callable[[LeafAsk], tuple[float, int]]:
    """The offload planner as the search's price of the offload leaf on one rank: the whole model, or under
    split(s) its shards' shapes (:func:`~stratum.parallel.split_offload.shard_shapes`), or under a pipeline the
    rank's blocks with their in-flight micro-batches' activations kept, checkpointed or spilled (as
    :mod:`stratum.parallel.pipeline_offload` plans them), with the costs the search gives; the bandwidths are
    measured on first use."""
    inputs: dict = {}
    shards: dict[int, BlockSeq] = {1: model}

    def price(ask: LeafAsk) -> tuple[float, int]:
        if not inputs:
            inputs.update(placement_inputs(cfg, model, resolve_device(cfg.train.device), profile=prof))
        if ask.splits not in shards:
            shards[ask.splits] = _meta_model(cfg)
            shard_shapes(shards[ask.splits], ask.splits)
        seq, costs = shards[ask.splits], ask.profile
        if ask.blocks:
            seq = seq.part(list(ask.blocks))
            costs = replace(costs, tied=[list(t.names) for t in seq.tied])
        p = make_placement(seq, **{**inputs, "profile": costs, "n_micro": ask.microbatches, "inflight": ask.inflight,
                                   "device_budget": ask.device_budget, "host_budget": ask.host_budget,
                                   **({"grad_handoff": "tensor"} if ask.tensor_grads else {})})
        return p.predicted_step_s, int(p.predicted_peak.get("device", 0))
    return price


def _splits(model: BlockSeq, s: int) -> bool:
    try:
        check_split(model, s)
    except StratumError:
        return False
    return True


def _default_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else usable_cores()


def machine_hardware(cfg: Config, n: int) -> Hardware:
    """This machine's spec for ``n`` devices: measured once (``stratum hardware probe``) and cached."""
    kind = "cuda" if torch.cuda.is_available() else f"cpu{n}"
    path = cfg.cache_dir / "hardware" / f"{socket.gethostname()}-{kind}.toml"
    if path.is_file():
        logger.info(f"hardware spec from the cached probe {path} (delete it to measure again)")
        return load_hardware(path)
    logger.info("measuring this machine (devices, host and disk tiers, a gloo all-reduce); cached for next time")
    path.parent.mkdir(parents=True, exist_ok=True)  # the disk probe measures the disk the cache is on
    hw, notes = probe(devices=None if torch.cuda.is_available() else n, disk_dir=str(path.parent))
    try:
        atomic_write_text(path, "".join(f"# {x}\n" for x in notes) + dump_hardware(hw))
    except StratumError as e:
        logger.warning(f"cannot cache the hardware spec ({e}); the next search measures again")
    return hw


def machine_ranks(cfg: Config, n: int, work: Workload) -> tuple[Hardware, Workload]:
    """This machine's spec for ``n`` devices (:func:`machine_hardware`) and ``work``; for ``n`` >= 2 CPU processes
    (where ``n`` copies of the training state fit the host), the devices' speeds, the intra-node link and — where
    the layers split 2 ways and ``n`` is even — DTensor's per-layer cost as the model's own ranks run them
    (:mod:`stratum.plan.rank_probe`)."""
    hw = machine_hardware(cfg, n)
    device = resolve_device(cfg.train.device)
    too_big = _copies_do_not_fit(work.profile, n, device)
    if device.type != "cpu" or n < 2 or too_big:
        if too_big:
            logger.info(f"the ranks are not probed ({too_big}): the spec's matrix-multiply speeds stand")
        return hw, work
    t, m = cfg.train, max(1, cfg.train.grad_accum // n)
    step_s = m * (work.profile.step_s * work.step.block_scale + work.step.per_microbatch_s) + work.step.fixed_s
    if probe_seconds(step_s, n, usable_cores()) > PROBE_BUDGET_S:
        logger.info(f"the ranks are not probed (a step of {m} micro-batch(es) takes about {step_s:.2g} s alone: the "
                    f"probe would take over {PROBE_BUDGET_S:g} s): the spec's matrix-multiply speeds stand")
        return hw, work
    build = _builder(cfg, torch.device("cpu"))
    model = build()
    if not model.info.vocab_size:  # the probe feeds token ids
        return hw, work
    batches = probe_batches(model.info.vocab_size, t.micro_batch_size, cfg.data.seq_len, m,
                            torch.Generator().manual_seed(0))
    split_ids = work.splittable if SPLIT_PROBE in work.split_sizes and n % SPLIT_PROBE == 0 else ()
    probe = probe_ranks(build, n, batches=batches, optim=optim_spec(cfg), threads=t.threads or threads_among(n),
                        timeout_s=PROBE_TIMEOUT_S, split_ids=tuple(split_ids))
    # (a spec written without shared_cores: the ranks share this machine's cores)
    ranks = replace(as_ranks_run(hw, probe), shared_cores=hw.shared_cores or usable_cores())
    logger.info(f"{n} ranks of this model, probed: {probe.alone_s * 1e3:.2f} ms a micro-batch alone, "
                f"{', '.join(f'{x * 1e3:.2f}' for x in probe.rank_s)} ms together → speeds "
                f"{', '.join(f'{d.speed:.2f}' for d in ranks.devices[:n])} (matrix multiply: "
                f"{', '.join(f'{d.speed:.2f}' for d in hw.devices[:n])}); gradient all-reduce of "
                f"{fmt_bytes(probe.grad_bytes)} in {probe.allreduce_s * 1e3:.2f} ms, of a scalar in "
                f"{probe.scalar_s * 1e3:.3f} ms → intra-node {ranks.intra_node.bandwidth / 1e9:.3g} GB/s, "
                f"{ranks.intra_node.latency * 1e6:.3g} us (probe: {hw.intra_node.bandwidth / 1e9:.3g} GB/s, "
                f"{hw.intra_node.latency * 1e6:.3g} us); "
                f"reduce-scatter + all-gather in {probe.sharded_s * 1e3:.2f} ms → sharded_scale "
                f"{ranks.sharded_scale:.2f}")
    return ranks, _with_split_measured(work, probe, ranks, split_ids)


def _with_split_measured(work: Workload, probe: RankProbe, hw: Hardware, split_ids: tuple[int, ...]) -> Workload:
    """``work`` with DTensor's per-layer cost from the probe's split steps over its ranks (as it stands where they
    were not measured)."""
    if not split_ids or probe.split_step_s[1] <= 0:
        return work
    blocks, scale = work.profile.blocks, work.step.block_scale
    split_s = sum((blocks[i].fwd_s + blocks[i].bwd_s) * scale for i in split_ids)
    comm = 2 * SPLIT_REDUCTIONS * statistics.mean(allreduce_s(blocks[i].out_bytes, SPLIT_PROBE, hw.intra_node)
                                                  for i in split_ids)
    speed = min(d.speed for d in hw.devices[:len(probe.rank_s)])  # the pace predict runs a split group at
    dispatch = split_block_s(probe, split_blocks_s=split_s, blocks=len(split_ids), comm_s=comm, speed=speed)
    logger.info(f"split({SPLIT_PROBE}) over pairs of the ranks: steps of 1 and 2 micro-batches "
                f"{probe.split_step_s[0]:.4f} s, {probe.split_step_s[1]:.4f} s → DTensor {dispatch * 1e3:.2f} ms a "
                f"split layer and micro-batch (one process's mesh: {work.step.split_block_s * 1e3:.2f} ms)")
    return replace(work, step=replace(work.step, split_block_s=dispatch))


def _label(plan, work: Workload) -> str:
    text = str(plan)
    return text.replace(f"partition={work.profile_path}", "partition=profiled") if work.profile_path else text


# ---- parallel.plan = "auto" ----------------------------------------------------------------------------------
_SEARCHED = ("parallel.devices=0", "parallel.hardware=''")
"""The search's own settings, cleared once its tree is chosen (they do nothing beside a tree)."""


@dataclass(frozen=True, kw_only=True)
class AutoChoice:
    """What ``parallel.plan = "auto"`` resolved to."""

    config: Config
    """The config with the chosen tree and its per-replica ``train.grad_accum``."""
    prediction: Prediction | None
    """The search's prediction for it (None when a resumed run keeps its earlier tree)."""

    def record(self) -> None:
        """Keep the prediction in out_dir for the run's summary.json; an out_dir the run will refuse (another run's
        checkpoints, without train.resume) is left as it is."""
        out = Path(self.config.train.out_dir).expanduser()
        if self.prediction is not None and (self.config.train.resume or latest_checkpoint(out) is None):
            write_prediction(out, self.prediction, self.config.train.grad_accum)


def choose_plan(cfg: Config, config_path: str | None, overrides: list[str]) -> AutoChoice:
    """Replace ``parallel.plan = "auto"`` by the search's best tree and ``train.grad_accum`` by its per-replica
    share; ``overrides`` gets both (the ranks re-read the config from them and must not search again). Prints
    the ranked head of the table and why the choice won. A resumed run keeps the tree its checkpoints were
    trained with."""
    out = Path(cfg.train.out_dir).expanduser()
    prior = recorded(out)
    if prior is not None and cfg.train.resume and latest_checkpoint(out) is not None:
        logger.info(f"parallel.plan = auto: resuming with the tree this run chose before, {prior['plan']}")
        tree = [f"parallel.plan={prior['plan']!r}", *_SEARCHED]
        # the share of this command's train.grad_accum (a changed global batch is the resume check's to refuse)
        replicas = load_config(config_path, overrides + tree).plan.replicas
        if cfg.train.grad_accum % replicas:
            raise StratumError(f"train.grad_accum = {cfg.train.grad_accum} does not divide among the {replicas} "
                               f"replicas of the tree this run chose before ({prior['plan']}); give a multiple of "
                               f"{replicas}, or a new train.out_dir to search again")
        overrides += [*tree, f"train.grad_accum={cfg.train.grad_accum // replicas}"]
        return AutoChoice(config=load_config(config_path, overrides), prediction=None)
    hw = load_hardware(Path(cfg.parallel.hardware).expanduser()) if cfg.parallel.hardware.strip() else None
    n = cfg.parallel.devices or (hw.num_devices if hw else _default_devices())
    res, work = plan_search(cfg, n, hw)
    best = res.best
    logger.info(res.table(5, label=lambda p: _label(p, work)))
    logger.info(f"parallel.plan = auto: chose {_label(best.plan, work)} — {_why(best, res, work)}")
    overrides += [f"parallel.plan={str(best.plan)!r}", f"train.grad_accum={cfg.train.grad_accum // best.plan.replicas}",
                  *_SEARCHED]
    return AutoChoice(config=load_config(config_path, overrides), prediction=best)


def _why(best: Prediction, res: SearchResult, work: Workload) -> str:
    nxt = res.ranked[1] if len(res.ranked) > 1 else None
    if nxt is None or best.step_s <= 0:
        lead = "the only tree that fits"
    elif nxt.step_s <= best.step_s * 1.0005:
        lead = f"as fast as the next, {_label(nxt.plan, work)}, with no more memory per device"
    else:
        lead = f"{(nxt.step_s / best.step_s - 1) * 100:.1f} % faster than the next, {_label(nxt.plan, work)}"
    return (f"the fastest predicted step that fits: {best.step_s:.4f} s (compute {best.compute_s:.4f} s, gradient "
            f"reduction {best.reduce_s:.4f} s), peak {max(best.peak_bytes):,} bytes per device; {lead} "
            f"(SIMULATED, {res.examined} trees priced)")

