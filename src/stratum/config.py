"""Typed run configuration: TOML file + ``--set section.key=value`` overrides, validated once at the edge.

Every field is a keyword-only dataclass field with a docstring (``stratum config`` prints them all). Values
derived from several fields (tokens per step, global batch) are computed in :class:`Config` only, and printed
at start. Validation turns every mistake into a :class:`~stratum.errors.StratumError` that names the key.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import os
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stratum.errors import StratumError
from stratum.extras import require
from stratum.ir.plan import Local, Offload, Plan, parse_plan
from stratum.model.presets import PRESETS
from stratum.schedule.generators import KINDS, is_kind
from stratum.units import parse_budget, parse_bytes

SOURCES = ("gpt", "sequential", "hf")
TOKENIZERS = ("byte", "bpe")
PRECISIONS = ("fp32", "bf16", "fp16")
ENGINES = ("plain", "pipeline", "offload")
OFFLOAD_OPTIMIZER_TIERS = ("auto", "device", "host", "disk")
OFFLOAD_ACTIVATIONS = ("auto", "keep", "offload", "recompute")
OFFLOAD_GRAD_HANDOFFS = ("auto", "chunk", "tensor")
PIPELINE_PARTITIONS = ("even", "balanced")
PIPELINE_BACKENDS = ("auto", "gloo", "nccl")
PRIORITIES = ("normal", "foreground", "background")
MAX_PREFETCH_DEPTH = 64
"""Chunk accesses prefetched ahead at most: each is scanned every access, and deeper ones only hold memory."""
SEED_MAX = 2**63 - 1
"""The largest seed torch's generators take (a signed 64-bit integer)."""


@dataclass(kw_only=True)
class ModelConfig:
    source: str = "gpt"
    """Where the model comes from: gpt (Stratum's own), sequential (an nn.Sequential factory), hf (transformers)."""
    preset: str = "mini"
    """GPT preset (source = gpt): tiny, mini, small, gpt2-124m, gpt2-355m, gpt2-774m, gpt2-1.5b, gpt-2.7b, gpt-6.7b."""
    vocab_size: int = 0
    """Vocabulary size; 0 takes the preset's (GPT-2 family: 50257) or else the tokenizer's."""
    dropout: float = 0.0
    """Dropout probability in [0, 1) (gpt and hf sources; replaces a transformers config's own rates)."""
    factory: str = "stratum.model.sequential:example_lm"
    """source = sequential: 'package.module:function' called as f(vocab_size=V, seq_len=T) -> an nn.Sequential,
    or a list of zero-argument block constructors (built block by block: the offload engine's form for a model
    larger than RAM; e.g. 'stratum.model.sequential:example_lm_blocks')."""
    hf_path: str = ""
    """source = hf: a local config.json or model directory (weights loaded if present, else random init)."""


@dataclass(kw_only=True)
class DataConfig:
    corpus: str = "stdlib"
    """A text file, a directory of text files, or 'stdlib' (this Python's standard-library sources)."""
    tokenizer: str = "byte"
    """byte (256 tokens, nothing to train) or bpe (byte-level BPE trained locally on the corpus)."""
    bpe_vocab_size: int = 4096
    """Vocabulary size of the BPE tokenizer (tokenizer = bpe)."""
    seq_len: int = 128
    """Tokens per training sequence."""
    val_fraction: float = 0.05
    """Share of the corpus (its end) held out for the eval loss, in [0, 0.5]."""
    cache_dir: str = ""
    """Where token caches and trained tokenizers live; empty = ~/.cache/stratum (or $XDG_CACHE_HOME/stratum)."""


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 2e-3
    """Peak learning rate (after warm-up)."""
    min_lr: float = 2e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = -1
    """Steps of linear warm-up from 0 to lr; -1 = optim.warmup_fraction of train.steps (the value used is printed
    at start)."""
    warmup_fraction: float = 0.1
    """With optim.warmup_steps = -1: the share of train.steps spent warming up, in [0, 1) (rounded to whole steps,
    at least one unless 0), so a short run is not all warm-up."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only (not biases, norms)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 100
    """Optimizer steps of the whole run (the cosine schedule ends here)."""
    micro_batch_size: int = 16
    """Sequences per micro-batch (one forward/backward)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    seed: int = 1337
    """Seeds weights, data order and dropout."""
    precision: str = "fp32"
    """fp32, bf16 (autocast; weights and optimizer state stay fp32), or fp16 (autocast with dynamic loss scaling,
    for GPUs without bf16 such as T4 and V100: a step whose gradients overflow is skipped and the scale halved;
    the plain and offload engines only)."""
    loss_scale: float = 65536.0
    """train.precision = fp16: the initial loss scale (torch GradScaler's default, 2**16)."""
    loss_scale_growth_interval: int = 2000
    """train.precision = fp16: steps in a row without an overflow after which the loss scale doubles."""
    device: str = "auto"
    """auto (cuda if present, else cpu), cpu, cuda, or cuda:N."""
    threads: int = 0
    """torch's intra-op threads per process; 0 = auto: the cores this process may use (its CPU affinity) shared
    among the plan's processes on this machine."""
    priority: str = "normal"
    """The run's priority beside other jobs on its devices — DeepPool's multiplexing (docs/burst.md): normal;
    foreground (on a GPU its kernels go on a CUDA stream of the highest priority, ahead of other streams' in its
    process, and of other processes' under MPS; normal OS priority); or background (Linux SCHED_IDLE, else nice 19:
    the run takes only CPU time other jobs leave idle; on a GPU its kernels keep the default, lowest priority)."""
    engine: str = "plain"
    """Execution engine: plain (the single-process reference), pipeline (stages over processes, see [pipeline]),
    offload (training state in chunks over device, host and disk under byte budgets, see [offload])."""
    eval_interval: int = 50
    """Compute the eval loss every this many steps (and at the end); 0 = only at the end. Without a validation
    split (data.val_fraction = 0) there is no eval loss, and this must be 0."""
    eval_batches: int = 4
    """Micro-batches per eval (the same ones every time)."""
    log_interval: int = 10
    """Print a progress line every this many steps when not on a terminal (metrics.jsonl gets every step)."""
    ckpt_interval: int = 0
    """Save a checkpoint every this many steps; 0 = by time only (train.ckpt_minutes) and at the end. SIGINT
    (Ctrl-C) or SIGTERM also saves one after the step in progress, then stops: the run resumes from there."""
    ckpt_minutes: float = 10.0
    """Also save a checkpoint once this many minutes have passed since the last one (or the start), so a run
    killed without warning loses at most that much; 0 = never by time."""
    keep_checkpoints: int = 2
    """How many most recent checkpoints to keep (at least 1)."""
    out_dir: str = "runs/default"
    """Where metrics.jsonl, summary.json and checkpoints/ go."""
    resume: bool = True
    """Continue from the latest checkpoint in out_dir if there is one."""
    tensorboard: bool = False
    """Also write every step's metrics as TensorBoard scalars under <out_dir>/tensorboard (needs the tensorboard
    extra: pip install 'stratum[tensorboard]')."""
    wandb_project: str = ""
    """Also log every step's metrics to this Weights & Biases project; "" = off (needs the wandb extra; set
    WANDB_MODE=offline to log without a network)."""


@dataclass(kw_only=True)
class PipelineConfig:
    schedule: str = "1f1b"
    """Schedule kind (gpipe, 1f1b, interleaved, wave, zb-1f1b, zb-wave) or a schedule text file (stratum schedule
    show --save); a step's train.grad_accum micro-batches are the pipeline's micro-batches."""
    ranks: int = 2
    """Pipeline processes (spawned locally by `stratum train`, or the WORLD_SIZE under torchrun)."""
    virtual: int = 2
    """Stages per rank of the interleaved schedule."""
    waves: int = 1
    """Waves W of the wave schedules (2·W·ranks stages)."""
    partition: str = "even"
    """How blocks are cut into stages: even (equal block counts), balanced (by parameter count), or a Profile
    JSON from `stratum profile` (profiled time balanced per rank by the DP partitioner of stratum.plan)."""


@dataclass(kw_only=True)
class OffloadConfig:
    device_budget: str = ""
    """train.engine = offload: bytes the device tier may hold (GPU memory; RAM on a CPU-only machine), e.g.
    "2GB", "512MiB", or "25%" of the training state (parameters, gradients and AdamW moments in fp32);
    "" = no limit."""
    host_budget: str = ""
    """Bytes of (pinned, with a GPU) host RAM the offload engine may use below the device (a size or a percentage
    of the training state, as device_budget); "" = no limit; what
    fits in neither budget goes to files under offload.disk_dir."""
    disk_dir: str = ""
    """Directory for the disk tier's files (nameless: freed when the process ends, however it ends); "" = the
    system temp directory."""
    chunk_size: str = ""
    """Expert override: bytes per parameter chunk (at least the largest parameter); "" = the planner's choice."""
    resident_chunks: int = 0
    """Expert override: device chunk slots for streamed chunks; 0 = the planner's choice."""
    optimizer_tier: str = "auto"
    """Expert override: where AdamW's state lives and its update runs: auto (planner), device, host or disk."""
    prefetch_depth: int = -1
    """Expert override: chunk accesses fetched ahead of use (0 = on demand); -1 = the planner's choice."""
    activations: str = "auto"
    """Expert override: a block's saved activations between its forward and backward: auto (planner), keep (on
    the device), offload (copied to the host tier and back; what the host budget cannot hold goes to disk or is
    recomputed, whichever the planner predicts faster) or recompute (the block's forward is re-run)."""
    grad_handoff: str = "auto"
    """With 16-bit chunks (train.precision = bf16 or fp16, optimizer state on the host): how gradients reach the
    host — chunk (summed on the device in a flat 16-bit buffer per chunk, one asynchronous copy per chunk and
    micro-batch), tensor (one copy per gradient as autograd makes it) or auto (chunk on a GPU, tensor on a CPU,
    where the chunk path only adds copies)."""
    delayed_update: bool = False
    """With bf16 chunks (train.precision = "bf16", optimizer state on the host): run the host's AdamW over each
    step's gradients beside the next step, whose forward and backward then use parameters one update behind
    (ZeRO-Offload's delayed parameter update). Changes the losses (docs/offload.md gives how much); false = every
    step computes with all updates so far, as the plain engine."""


@dataclass(kw_only=True)
class ParallelConfig:
    plan: str = ""
    """How the job runs over processes, as a plan expression (docs/parallel.md): local; replicate(n,
    reduce=mean|adasum, shard=false|true); pipeline(ranks, schedule=…, partition=…); split(n);
    offload(device_budget=…, host_budget=…); nested replicate → pipeline → split → offload/local, e.g.
    "replicate(2, pipeline(2))"; or burst(n, widths=4:2:1…) alone (docs/burst.md). Settings a pipeline node omits
    come from [pipeline]. "" = the train.engine
    shorthand: plain = local, pipeline = pipeline(pipeline.ranks), offload = offload(). "auto" = the tree the plan
    search (stratum plan --parallel) predicts fastest on parallel.devices, chosen when the run starts."""
    devices: int = 0
    """With plan = "auto": the devices (processes) to plan for; 0 = every device of the hardware spec."""
    hardware: str = ""
    """With plan = "auto": a hardware spec TOML ([hardware], from stratum hardware probe); "" = this machine,
    measured once and cached."""
    backend: str = "auto"
    """torch.distributed backend of multi-process plans: auto (nccl with CUDA, else gloo), gloo, or nccl."""
    timeout_s: float = 30.0
    """Longest wait for a peer (messages, collectives, start-up) before the run stops with an error."""
    speeds: str = ""
    """Hardware-aware balance (Whale): each process's relative speed — "" = all equal, "auto" = measured (a
    matrix-multiply rate per process at start-up, then each replica's own compute time per micro-batch every
    step), or one number per process rank, e.g. "1,1,0.5,0.5". Replicas take micro-batches in proportion to
    their speed (a replica runs at its slowest process's); pipeline cuts weigh each stage by its rank's speed."""

    @property
    def auto(self) -> bool:
        """plan = "auto", in any case (as the plan's node names are read)."""
        return self.plan.strip().lower() == "auto"


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig,
                             "pipeline": PipelineConfig, "offload": OffloadConfig,
                             "parallel": ParallelConfig}
# Keys that moved to another section: old configs keep working.
MOVED = {"pipeline.backend": "parallel.backend", "pipeline.timeout_s": "parallel.timeout_s"}


@dataclass(kw_only=True)
class Config:
    """A whole run's configuration; build it with :func:`load_config`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    # ---- derived values: computed here and nowhere else ---------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The parallel plan: parallel.plan, or the tree train.engine stands for."""
        p = self.pipeline
        defaults = {"pipeline": {"schedule": p.schedule, "partition": p.partition, "virtual": p.virtual,
                                 "waves": p.waves}}
        if self.parallel.auto:
            raise StratumError("parallel.plan = 'auto' is chosen by the plan search when `stratum train` starts; "
                               "this command needs a plan expression (stratum plan --parallel ranks them)")
        text = self.parallel.plan.strip() or {"plain": "local", "pipeline": f"pipeline({p.ranks})",
                                              "offload": "offload"}[self.train.engine]
        return parse_plan(text, defaults=defaults)

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches of one optimizer step over all replicas: grad_accum × replicas."""
        return self.train.grad_accum * self.plan.replicas

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: micro_batch_size × grad_accum × replicas."""
        return self.train.micro_batch_size * self.micro_batches_per_step

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.data.seq_len

    @property
    def warmup_steps(self) -> int:
        """Warm-up steps of the learning-rate schedule: optim.warmup_steps, or optim.warmup_fraction of
        train.steps when that is -1."""
        o = self.optim
        if o.warmup_steps >= 0:
            return o.warmup_steps
        if o.warmup_fraction == 0:
            return 0
        return max(1, round(o.warmup_fraction * self.train.steps))

    @property
    def cache_dir(self) -> Path:
        if self.data.cache_dir:
            return Path(self.data.cache_dir).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "stratum"

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def anchored(self) -> Config:
        """This config with the paths its checkpoints are read back by (``model.hf_path``, ``data.corpus``: the
        model, and the corpus a BPE is rebuilt from) made absolute, so that sample, export and resume work from a
        checkpoint alone, from any directory."""
        def absolute(path: str) -> str:
            return str(Path(path).expanduser().absolute()) if path else path
        corpus = self.data.corpus if self.data.corpus == "stdlib" else absolute(self.data.corpus)
        return dataclasses.replace(self, model=dataclasses.replace(self.model, hf_path=absolute(self.model.hf_path)),
                                   data=dataclasses.replace(self.data, corpus=corpus))

    def derived_summary(self) -> str:
        t = self.train
        plan = self.plan
        return (f"plan {plan} on {plan.world_size()} process(es); global batch = {t.micro_batch_size} (micro) × "
                f"{t.grad_accum} (accum) × {plan.replicas} (replicas) = {self.global_batch} "
                f"sequences; tokens/step = {self.global_batch} × {self.data.seq_len} = {self.tokens_per_step:,}; "
                f"total tokens = {self.tokens_per_step * t.steps:,}; warm-up = {self._warmup_text()}")

    def _warmup_text(self) -> str:
        if self.optim.warmup_steps >= 0:
            longer = (f", longer than the run's {self.train.steps}: the learning rate never reaches optim.lr"
                      if self.warmup_steps > self.train.steps else "")
            return f"{self.warmup_steps} steps (optim.warmup_steps{longer})"
        return f"{self.optim.warmup_fraction:g} × {self.train.steps} steps = {self.warmup_steps} steps"

    # ---- validation ---------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Every field against its rule, section by section, then the rules between sections; the first
        failure is a one-line StratumError."""
        self._validate_model()
        self._validate_data()
        self._validate_optim()
        self._validate_train()
        self._validate_pipeline()
        self._validate_auto()
        self._validate_fp16()
        _check("pipeline.schedule", bool(self.pipeline.schedule.strip()),
               "must name a schedule kind or a schedule file")
        self._validate_schedule()
        self._validate_offload()

    def _validate_model(self) -> None:
        m = self.model
        _choice("model.source", m.source, SOURCES)
        if m.source == "gpt":
            _choice("model.preset", m.preset, tuple(PRESETS))
        if m.source == "hf" and not m.hf_path:
            raise StratumError("model.source = 'hf' needs model.hf_path (a config.json or a model directory)")
        _check("model.vocab_size", m.vocab_size >= 0, "must be ≥ 0 (0 = preset's or tokenizer's)")
        _check("model.dropout", 0.0 <= m.dropout < 1.0, "must be in [0, 1)")

    def _validate_data(self) -> None:
        d, t = self.data, self.train
        _choice("data.tokenizer", d.tokenizer, TOKENIZERS)
        _check("data.bpe_vocab_size", 257 <= d.bpe_vocab_size <= 1_000_000, "must be in [257, 1000000]")
        _check("data.seq_len", d.seq_len >= 1, "must be ≥ 1")
        _check("data.val_fraction", 0.0 <= d.val_fraction <= 0.5, "must be in [0, 0.5]")
        if t.eval_interval and d.val_fraction == 0:
            raise StratumError("data.val_fraction = 0 leaves nothing to evaluate; "
                               "set data.val_fraction > 0 or train.eval_interval = 0")

    def _validate_optim(self) -> None:
        o = self.optim
        _check("optim.lr", o.lr > 0, "must be > 0")
        _check("optim.min_lr", 0 <= o.min_lr <= o.lr, "must be in [0, optim.lr]")
        _check("optim.warmup_steps", o.warmup_steps >= -1, "must be ≥ 0, or -1 for optim.warmup_fraction of the steps")
        _check("optim.warmup_fraction", 0 <= o.warmup_fraction < 1, "must be in [0, 1)")
        _check("optim.weight_decay", o.weight_decay >= 0, "must be ≥ 0")
        _check("optim.beta1", 0 <= o.beta1 < 1, "must be in [0, 1)")
        _check("optim.beta2", 0 <= o.beta2 < 1, "must be in [0, 1)")
        _check("optim.eps", o.eps > 0, "must be > 0")
        _check("optim.grad_clip", o.grad_clip >= 0, "must be ≥ 0 (0 disables clipping)")

    def _validate_train(self) -> None:
        m, d, t = self.model, self.data, self.train
        _check("train.steps", t.steps >= 1, "must be ≥ 1")
        _check("train.micro_batch_size", t.micro_batch_size >= 1, "must be ≥ 1")
        _check("train.grad_accum", t.grad_accum >= 1, "must be ≥ 1")
        _check("train.threads", 0 <= t.threads <= 4096, "must be in [0, 4096] (0 = auto)")
        _check("train.seed", 0 <= t.seed <= SEED_MAX, f"must be in [0, 2**63 - 1 = {SEED_MAX}]")
        _choice("train.precision", t.precision, PRECISIONS)
        _check("train.loss_scale", t.loss_scale >= 1, "must be ≥ 1 (a power of two keeps unscaling exact)")
        _check("train.loss_scale_growth_interval", t.loss_scale_growth_interval >= 1, "must be ≥ 1")
        _choice("train.priority", t.priority, PRIORITIES)
        if not (t.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:[0-9]+", t.device)):
            raise StratumError(f"train.device = {_show(t.device)} is not auto, cpu, cuda or cuda:N")
        _choice("train.engine", t.engine, ENGINES)
        for key in ("eval_interval", "ckpt_interval"):
            _check(f"train.{key}", getattr(t, key) >= 0, "must be ≥ 0 (0 = only at the end)")
        _check("train.ckpt_minutes", t.ckpt_minutes >= 0, "must be ≥ 0 (0 = never by time)")
        _check("train.eval_batches", t.eval_batches >= 1, "must be ≥ 1")
        _check("train.log_interval", t.log_interval >= 1, "must be ≥ 1")
        _check("train.keep_checkpoints", t.keep_checkpoints >= 1, "must be ≥ 1")
        _check("train.out_dir", bool(t.out_dir.strip()), "must not be empty")
        for key, value in (("train.out_dir", t.out_dir), ("data.cache_dir", d.cache_dir),
                           ("offload.disk_dir", self.offload.disk_dir), ("data.corpus", d.corpus),
                           ("model.hf_path", m.hf_path), ("pipeline.schedule", self.pipeline.schedule),
                           ("pipeline.partition", self.pipeline.partition)):
            _check_home(key, value)
        if t.tensorboard:
            require("tensorboard", "train.tensorboard")
        if t.wandb_project.strip():
            require("wandb", "train.wandb_project")

    def _validate_pipeline(self) -> None:
        pp = self.pipeline
        _check("pipeline.ranks", pp.ranks >= 1, "must be ≥ 1")
        _check("pipeline.virtual", pp.virtual >= 1, "must be ≥ 1")
        _check("pipeline.waves", pp.waves >= 1, "must be ≥ 1")
        if pp.partition not in PIPELINE_PARTITIONS and not pp.partition.endswith(".json"):
            raise StratumError(f"pipeline.partition = {pp.partition!r} is not one of: "
                               f"{', '.join(PIPELINE_PARTITIONS)}, or a profile .json file")
        _choice("parallel.backend", self.parallel.backend, PIPELINE_BACKENDS)
        _check("parallel.timeout_s", 1.0 <= self.parallel.timeout_s <= 86400.0, "must be in [1, 86400] seconds")
        if not self.parallel.auto:  # "auto" is resolved (and its tree checked) at start-up
            _ = self.plan  # parses and checks the plan expression
            self._validate_speeds()

    def _validate_auto(self) -> None:
        pl = self.parallel
        if pl.plan.strip() and self.train.engine != "plain":  # the plan's leaf is the engine; one name per choice
            raise StratumError(f"train.engine = {self.train.engine!r} and parallel.plan = {pl.plan.strip()!r} both "
                               "choose how to train: put the engine in the plan (its leaf, e.g. replicate(2, "
                               "offload)) and leave train.engine at 'plain'")
        _check("parallel.devices", pl.devices >= 0, "must be ≥ 0 (0 = the hardware spec's devices)")
        if not pl.auto and (pl.devices or pl.hardware.strip()):
            raise StratumError("parallel.devices and parallel.hardware are the plan search's; they go with "
                               "parallel.plan = 'auto'")
        if pl.hardware.strip() and not Path(pl.hardware).expanduser().is_file():
            raise StratumError(f"parallel.hardware = {_show(pl.hardware)} is not a file; write a spec with "
                               "`stratum hardware probe --out FILE`")

    def _validate_fp16(self) -> None:
        """fp16's dynamic loss scaling is built into the plain and the offload engine alone (one process): every
        other plan is refused here rather than run unscaled. The offload engine runs it on 16-bit chunks with the
        fp32 masters and AdamW moments in host RAM or on disk (Placement.half_params)."""
        if self.train.precision != "fp16":
            return
        what = "train.precision = 'fp16' (loss scaling) runs on the plain and offload engines only"
        if self.parallel.auto:
            raise StratumError(f"{what}, and parallel.plan = 'auto' searches multi-process plans: name the plan, or "
                               "use bf16 or fp32")
        if not isinstance(self.plan.root, (Local, Offload)):
            raise StratumError(f"{what}, not under plan {str(self.plan)!r}: use bf16 or fp32 there")
        if isinstance(self.plan.root, Offload) and self.offload.optimizer_tier == "device":
            raise StratumError("train.precision = 'fp16' on the offload engine keeps AdamW off the device: set "
                               "offload.optimizer_tier = 'auto', 'host' or 'disk'")

    def _validate_schedule(self) -> None:
        """pipeline.schedule names a kind or an existing file, checked whether or not a pipeline runs."""
        text = self.pipeline.schedule.strip()
        if not is_kind(text) and not Path(text).expanduser().is_file():
            raise StratumError(f"pipeline.schedule = {_show(text)} is neither a schedule kind ({', '.join(KINDS)}, "
                               "torch:NAME) nor an existing schedule file")

    def _validate_speeds(self) -> None:
        text = self.parallel.speeds.strip()
        if text in ("", "auto"):
            return
        try:
            speeds = [float(v) for v in text.split(",")]
        except ValueError:
            raise StratumError(f"parallel.speeds = {text!r} must be \"\", \"auto\" or numbers separated by "
                               "commas, e.g. \"1,0.5\"") from None
        n = self.plan.world_size()
        if len(speeds) != n or not all(0 < v < math.inf for v in speeds):  # (NaN compares false)
            raise StratumError(f"parallel.speeds = {text!r} must give {n} positive finite numbers, one per process "
                               f"of the plan")

    def _validate_offload(self) -> None:
        o = self.offload
        parse_budget(o.device_budget, "offload.device_budget")
        parse_budget(o.host_budget, "offload.host_budget")
        if self.parallel.plan.strip() and not self.parallel.auto and isinstance(leaf := self.plan.leaf, Offload):
            # the leaf's own budgets, checked here with the rest of the config, before any run state is read
            parse_budget(leaf.device_budget, "parallel.plan's offload(device_budget=…)")
            parse_budget(leaf.host_budget, "parallel.plan's offload(host_budget=…)")
        if o.chunk_size.strip():
            _check("offload.chunk_size", parse_bytes(o.chunk_size, "offload.chunk_size") >= 4,
                   "must be at least 4 bytes (one fp32 element), or \"\" for the planner's choice")
        _check("offload.resident_chunks", o.resident_chunks >= 0, "must be ≥ 0 (0 = the planner's choice)")
        _choice("offload.optimizer_tier", o.optimizer_tier, OFFLOAD_OPTIMIZER_TIERS)
        _choice("offload.activations", o.activations, OFFLOAD_ACTIVATIONS)
        _choice("offload.grad_handoff", o.grad_handoff, OFFLOAD_GRAD_HANDOFFS)
        _check("offload.prefetch_depth", -1 <= o.prefetch_depth <= MAX_PREFETCH_DEPTH,
               f"must be in [0, {MAX_PREFETCH_DEPTH}] (the planner tries up to 4), or -1 for the planner's choice")
        self._validate_delayed()

    def _validate_delayed(self) -> None:
        if self.parallel.auto or isinstance(self.plan.leaf, Offload):
            self.check_delayed_update()
            if self.offload.grad_handoff == "chunk" and self.train.precision == "fp32":
                raise StratumError("offload.grad_handoff = 'chunk' hands 16-bit gradients over per chunk; with "
                                   "train.precision = 'fp32' they stay fp32 and go per tensor: set train.precision "
                                   "= 'bf16' (or 'fp16'), or leave offload.grad_handoff = 'auto'")

    def check_delayed_update(self) -> None:
        """offload.delayed_update runs on bf16 chunks whose fp32 masters and AdamW state are in host RAM (the
        planner places only such chunks when it is set): a run that can have none is refused before it starts —
        and a plan of the memory engine (``stratum plan``, whatever the engine) before it plans."""
        o = self.offload
        if not o.delayed_update:
            return
        if self.train.precision != "bf16":
            raise StratumError(f"offload.delayed_update runs with bf16 chunks, not train.precision = "
                               f"{self.train.precision!r}: set train.precision = 'bf16' or offload.delayed_update "
                               "= false")
        if o.optimizer_tier in ("device", "disk"):
            raise StratumError(f"offload.delayed_update runs the update in host RAM, not with offload.optimizer_tier "
                               f"= {o.optimizer_tier!r}: set it to 'auto' or 'host', or offload.delayed_update = false")


def _check_home(key: str, value: str) -> None:
    """A path starting ``~user`` names a user this system has (expanduser cannot resolve it otherwise)."""
    try:
        Path(value).expanduser()
    except RuntimeError:
        raise StratumError(f"{key} = {value!r} starts with ~ but names no user of this system; "
                           "give the path in full") from None


def _check(key: str, ok: bool, what: str) -> None:
    if not ok:
        raise StratumError(f"{key} {what}")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise StratumError(f"{key} = {_show(value)} is not one of: {', '.join(choices)}")


# ---- building a Config from TOML and --set --------------------------------------------------------------
def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _show(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error message stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _coerce(key: str, value: Any, typ: type) -> Any:
    """Check one value against its field type; ints are accepted for floats."""
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is float and isinstance(value, float) and not math.isfinite(value):
        raise StratumError(f"{key} must be a finite number, got {_show(value)}")
    if typ is str and isinstance(value, str) and not _is_utf8(value):
        raw = value.encode("utf-8", "surrogateescape")
        raise StratumError(f"{key} holds bytes that are not valid UTF-8 ({_show(raw)}); use a name in UTF-8")
    if typ is str and isinstance(value, str) and "\0" in value:
        raise StratumError(f"{key} holds a NUL character, which no path or name may contain")
    if typ is bool and not isinstance(value, bool):
        raise StratumError(f"{key} must be true or false, got {_show(value)}")
    if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise StratumError(f"{key} must be an integer, got {_show(value)}")
    if not isinstance(value, typ):
        raise StratumError(f"{key} must be a {typ.__name__}, got {_show(value)}")
    return value


def _is_utf8(text: str) -> bool:
    """False for text with lone surrogates: bytes that did not decode (a command-line argument, a path)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _field_types(cls: type) -> dict[str, type]:
    hints = {"str": str, "int": int, "float": float, "bool": bool}
    return {f.name: hints[f.type] if isinstance(f.type, str) else f.type for f in dataclasses.fields(cls)}


def _apply(cfg: Config, section: str, key: str, value: Any, where: str) -> None:
    section, _, key = MOVED.get(f"{section}.{key}", f"{section}.{key}").partition(".")
    if section not in SECTIONS:
        raise StratumError(f"{where}: unknown section [{section}]{_suggest(section, SECTIONS)}; "
                           f"sections are: {', '.join(SECTIONS)}")
    types = _field_types(SECTIONS[section])
    if key not in types:
        raise StratumError(f"{where}: unknown key {section}.{key}{_suggest(key, types)}; "
                           f"run `stratum config` to list every key")
    setattr(getattr(cfg, section), key, _coerce(f"{section}.{key}", value, types[key]))


def parse_set(item: str) -> tuple[str, str, Any]:
    """``section.key=value`` → (section, key, value); the value is read as TOML, else as a bare string."""
    lhs, sep, raw = item.partition("=")
    section, dot, key = lhs.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise StratumError(f"--set {item!r} must look like section.key=value, e.g. train.steps=100")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        value = raw.strip()
    return section, key, value


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults ← TOML file ← ``--set`` overrides, then validation. Raises StratumError on any mistake."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise StratumError(f"config file {p} is a directory; give a .toml file (e.g. configs/default.toml)")
        if not p.is_file():
            raise StratumError(f"config file {p} does not exist")
        try:
            doc = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise StratumError(f"config file {p} is not valid TOML: {e}") from None
        except RecursionError:
            raise StratumError(f"config file {p} nests arrays or tables too deeply to read; a Stratum config "
                               "has one level of [section] tables") from None
        except OSError as e:
            raise StratumError(f"config file {p} cannot be read ({e.strerror})") from None
        for section, table in doc.items():
            if not isinstance(table, dict):
                raise StratumError(f"{p}: top-level key {section!r} must be a [section]; "
                                   f"sections are: {', '.join(SECTIONS)}")
            for key, value in table.items():
                _apply(cfg, section, key, value, str(p))
    for item in overrides:
        section, key, value = parse_set(item)
        if section in SECTIONS and _field_types(SECTIONS[section]).get(key) is str and not isinstance(value, str):
            value = item.partition("=")[2].strip()  # --set data.corpus=123 means the string "123"
        _apply(cfg, section, key, value, "--set")
    cfg.validate()
    return cfg


def config_from_dict(d: dict[str, dict[str, Any]]) -> Config:
    """Rebuild a Config saved with ``to_dict`` (checkpoints); unknown keys are errors."""
    cfg = Config()
    for section, table in d.items():
        for key, value in table.items():
            _apply(cfg, section, key, value, "checkpoint config")
    return cfg


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass (read from the source)."""
    tree = ast.parse(inspect.getsource(cls))
    cls_def = tree.body[0]
    assert isinstance(cls_def, ast.ClassDef)
    body = cls_def.body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def describe() -> str:
    """Every key with its type, default and docstring, as TOML comments and values."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = f.default
            lines.append(f"# {docs.get(f.name, '')}")
            lines.append(f"{f.name} = {_toml_value(default)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


LOCAL_SETTINGS = ("train.out_dir", "data.cache_dir", "data.corpus", "offload.disk_dir", "model.hf_path",
                  "parallel.hardware", "train.device", "train.threads")
"""Settings each machine may give its own value (its paths, its devices and cores); every other one must be the
same on every rank of a run."""


def shared_settings(cfg: Config) -> dict[str, str]:
    """Every setting of ``cfg`` but :data:`LOCAL_SETTINGS` (``section.key`` → its value as text): what every rank
    of one run must agree on."""
    return {f"{section}.{key}": repr(value) for section, fields in cfg.to_dict().items()
            for key, value in fields.items() if f"{section}.{key}" not in LOCAL_SETTINGS}


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (written to out_dir/config.toml so a run can be repeated)."""
    out = []
    for section, values in cfg.to_dict().items():
        out.append(f"[{section}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        out.append("")
    return "\n".join(out)
