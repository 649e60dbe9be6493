"""From a Config to a Placement and an OffloadEngine: budgets parsed, bandwidths measured, the model profiled."""

from __future__ import annotations

from collections.abc import Callable

import torch

from stratum.config import Config
from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq
from stratum.model.neutral import neutral
from stratum.offload.engine import OffloadEngine
from stratum.offload.host_alloc import tune_allocator
from stratum.offload.placement import Placement
from stratum.offload.planner import make_placement
from stratum.offload.tiers import DEVICE, HOST, disk_free_bytes, host_probe_bytes, measure_bandwidths, resolve_disk_dir
from stratum.profile.fast import per_block
from stratum.profile.profile import Profile
from stratum.profile.profiler import _measure_block
from stratum.runtime.device import describe, device_memory_bytes
from stratum.runtime.loss_scale import loss_scale_spec
from stratum.runtime.optim import optim_spec
from stratum.units import fmt_bytes, parse_budget, parse_bytes


def overrides(cfg: Config) -> dict:
    """The expert overrides of ``[offload]`` as make_placement keyword arguments (``None`` = planner's choice)."""
    o = cfg.offload
    chunk = None
    if o.chunk_size.strip():
        n = parse_bytes(o.chunk_size, "offload.chunk_size")
        if n < 4:
            raise StratumError(f"offload.chunk_size = {o.chunk_size!r} must be at least 4 bytes")
        chunk = n // 4
    return dict(chunk_elems=chunk, resident_chunks=o.resident_chunks or None,
                optimizer_tier=None if o.optimizer_tier == "auto" else o.optimizer_tier,
                prefetch_depth=None if o.prefetch_depth < 0 else o.prefetch_depth,
                activations=None if o.activations == "auto" else o.activations)


def _measure_first(model: BlockSeq, x: torch.Tensor, y: torch.Tensor, device: torch.device, precision: str):
    """Block 0 measured on token ids; a model that takes other inputs refuses them, in one line."""
    try:
        return _measure_block(model, 0, x, y, device, precision, 3)
    except (RuntimeError, TypeError, IndexError) as e:
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise StratumError(f"an offload leaf or a burst plan plans from the model's blocks run on token ids "
                           f"({tuple(x.shape)} int64, a language model's input), and block 0 "
                           f"({model.block_names[0]}) refused them ({reason}); a model of other inputs runs on "
                           "plans without either (a burst plan with its widths given)") from None


def quick_profile(model: BlockSeq, *, micro_batch: int, seq_len: int, device: torch.device,
                  precision: str = "fp32", seed: int = 0) -> Profile:
    """A Profile measuring each *distinct* block once (:func:`stratum.profile.fast.per_block`: same structure and
    input, same costs).

    A 36-layer GPT is measured as embedding + one layer + head: the planner gets per-block activation bytes
    and times at a small fraction of a full ``stratum profile`` (which it accepts too, via ``--profile``).
    """
    with neutral(devices=[device]):  # the blocks' own measurements are neutral too (_measure_block)
        gen = torch.Generator().manual_seed(seed)
        vocab = max(model.info.vocab_size, 1)
        x = torch.randint(0, vocab, (micro_batch, seq_len), generator=gen).to(device)
        y = torch.randint(0, vocab, (micro_batch, seq_len), generator=gen).to(device)
        # the median of 3 runs: a single run is at the mercy of whatever else shares the cores
        blocks = per_block(model, x, lambda i, xi: _measure_first(model, xi, y, device, precision) if i == 0 else
                           _measure_block(model, i, xi, y, device, precision, 3), None)
        for p in model.parameters():
            p.grad = None
    dtype = next(iter(model.parameters())).dtype
    return Profile(model=model.info.name, device=describe(device), dtype=str(dtype).removeprefix("torch."),
                   precision=precision, micro_batch=micro_batch, seq_len=seq_len, runs=3, blocks=blocks,
                   tied=[list(g.names) for g in model.tied], torch_version=torch.__version__)


def placement_for(cfg: Config, model: BlockSeq, device: torch.device, *, profile: Profile | None = None,
                  always_profile: bool = False, inflight: tuple[int, ...] = ()) -> Placement:
    """The plan for ``model`` under ``cfg.offload``; profiles the model (one block at a time) if not given.
    ``inflight``: on a pipeline rank, its blocks' micro-batches in flight (Placement.inflight)."""
    return make_placement(model, **placement_inputs(cfg, model, device, profile=profile, always_profile=always_profile),
                          inflight=inflight)


def check_trainable(model: BlockSeq) -> None:
    """The memory engine trains every parameter: its chunks hold a gradient and AdamW moments for each element,
    and a chunk's update runs when all its gradients are in. A frozen parameter is refused, in one line; so is a
    16-bit one — the chunks hold fp32 masters, and the 16-bit working copies are train.precision's to make."""
    if low := next(((n, p.dtype) for n, p in model.named_parameters() if p.dtype != torch.float32), None):
        raise StratumError(f"the offload leaf keeps fp32 master weights, and {low[0]} is {low[1]}; give it the "
                           "model in fp32 (its 16-bit working copies come from train.precision = 'bf16'), or use a "
                           "plan without offload")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        shown = ", ".join(frozen[:3]) + (f" and {len(frozen) - 3} more" if len(frozen) > 3 else "")
        raise StratumError(f"the offload leaf trains every parameter, and {shown} "
                           f"{'is' if len(frozen) == 1 else 'are'} frozen (requires_grad=False); unfreeze "
                           f"{'it' if len(frozen) == 1 else 'them'}, or use a plan without offload (local, "
                           "replicate, pipeline)")


def placement_inputs(cfg: Config, model: BlockSeq, device: torch.device, *, profile: Profile | None = None,
                     always_profile: bool = False) -> dict:
    """``make_placement``'s keyword arguments for ``cfg``: budgets parsed, overrides, bandwidths measured and the model
    profiled once (one block at a time) if not given — so several budgets can be planned from one measurement."""
    check_trainable(model)
    tune_allocator()  # the profile measures blocks under the allocator policy training runs with
    o = cfg.offload
    n_params = sum(p.numel() for p in model.parameters())
    state = 16 * n_params  # params, grads, exp_avg, exp_avg_sq in fp32
    dev_b = parse_budget(o.device_budget, "offload.device_budget", state)
    host_b = parse_budget(o.host_budget, "offload.host_budget", state)
    kw = overrides(cfg)
    disk = resolve_disk_dir(o.disk_dir)
    # The disk holds state only where the host cannot (a host budget) or where the optimizer is put there; its
    # probe (a 256 MiB synced write and read) is skipped otherwise, and a rate of 0 keeps the planner off it.
    disk_used = host_b is not None or o.optimizer_tier == "disk"
    bw = measure_bandwidths(device, str(disk) if disk_used else None, host_bytes=host_probe_bytes(n_params))
    if profile is None and (always_profile or dev_b is not None or host_b is not None):
        profile = quick_profile(model, micro_batch=cfg.train.micro_batch_size, seq_len=cfg.data.seq_len,
                                device=device, precision=cfg.train.precision, seed=cfg.train.seed)
    return dict(device_budget=dev_b, host_budget=host_b, disk_free=disk_free_bytes(disk), bandwidths=bw,
                profile=profile, n_micro=cfg.train.grad_accum, grad_clip=cfg.optim.grad_clip,
                precision=cfg.train.precision, grad_handoff=cfg.offload.grad_handoff,
                delayed_update=cfg.offload.delayed_update, **kw)


def ram_excess(placement: Placement, device: torch.device) -> tuple[int, int] | None:
    """(bytes held, bytes available) where a CPU plan's device and host tiers — on a CPU both the machine's RAM —
    hold more than the RAM available now; None otherwise (the planner takes an unlimited budget at its word)."""
    if device.type != "cpu":
        return None
    held = placement.predicted_peak.get(DEVICE, 0) + placement.predicted_peak.get(HOST, 0)
    available = device_memory_bytes(device)
    return None if available is None or held <= available else (held, available)


def _ram_advice(held: int, available: int) -> str:
    return (f"on a CPU the device and host tiers are both RAM: this plan holds {fmt_bytes(held)} there, more than "
            f"the {fmt_bytes(available)} available; set offload.device_budget and offload.host_budget to fit "
            f"together (at most {fmt_bytes(int(available * 0.8))} between them; the rest goes to disk)")


def ram_note(placement: Placement, device: torch.device) -> str:
    """A line under a plan :func:`ram_excess` finds too large for the RAM ("" otherwise)."""
    excess = ram_excess(placement, device)
    return "" if excess is None else f"\n  note: {_ram_advice(*excess)}"


def check_ram(placement: Placement, device: torch.device) -> None:
    """Refuse to train a plan :func:`ram_excess` finds too large for the RAM: it would run out of memory
    part-way through its set-up (as the plain engine refuses a state larger than the RAM)."""
    if (excess := ram_excess(placement, device)) is not None:
        raise StratumError(f"the offload plan cannot run here: {_ram_advice(*excess)}")


def offload_engine(cfg: Config, model: BlockSeq, device: torch.device, placement: Placement,
                   owns: Callable[[int], bool] | None = None, title: str = ""):
    """The offload engine of ``cfg`` over ``model`` running ``placement`` (printed, under ``title`` where one
    process of several prints its own); ``owns``: the chunks it updates, where replicas share them out (all by
    default)."""
    print((f"{title}\n" if title else "") + placement.describe(), flush=True)
    check_ram(placement, device)
    return OffloadEngine(model, optim=optim_spec(cfg), device=device, placement=placement,
                         precision=cfg.train.precision,
                         disk_dir=cfg.offload.disk_dir, owns=owns, delayed_update=cfg.offload.delayed_update,
                         loss_scale=loss_scale_spec(cfg))
