"""The ``Profile`` IR: what each block of a ``BlockSeq`` costs on one device.

Every planner and simulator reads this file format, so a prediction and a measurement can be put side by
side. Times are seconds (median of several runs), sizes are bytes, all per micro-batch of
``micro_batch`` sequences of ``seq_len`` tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from stratum.atomic import atomic_write_json
from stratum.errors import StratumError

FORMAT_VERSION = 1


SPILL_ALIGN = 64
"""Byte alignment of each tensor in the offload engine's activation-spill arenas (enough for any dtype)."""


def spill_span(nbytes: int) -> int:
    """Bytes a spilled tensor of ``nbytes`` takes in the spill arenas (rounded up to SPILL_ALIGN)."""
    return -(-nbytes // SPILL_ALIGN) * SPILL_ALIGN


def spill_key(t) -> tuple[tuple, int]:
    """The offload engine's rule for what a saved tensor ``t`` costs its spill: (key, bytes copied, aligned to
    SPILL_ALIGN); saved tensors with equal keys share one copy. A view that covers its whole storage densely,
    in any order of its dimensions, is copied as the storage's bytes, so two such views of one storage (an
    attention output and its transposed reshape) cost one copy, and a memcpy; any other tensor is copied as
    its view, once per distinct view. The profiler predicts spill bytes with this same function."""
    st = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    aligned = spill_span(nbytes)
    if t.storage_offset() == 0 and nbytes == st.nbytes() and nbytes > 0 and _dense(t.shape, t.stride()):
        return ("storage", st.data_ptr()), aligned
    return ("view", st.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype), aligned


def _dense(shape, stride) -> bool:
    """The strides lay the elements out without gaps or overlaps (a contiguous tensor, or a permutation of one)."""
    expected = 1
    for size, step in sorted((d for d in zip(shape, stride) if d[0] != 1), key=lambda d: d[1]):
        if step != expected:
            return False
        expected *= size
    return True


_NUMBERS = {"int": (int,), "float": (int, float)}
"""The number fields of a profile (by their annotation) and the JSON values each takes."""


def _check_numbers(obj: Profile | BlockProfile, where: str) -> None:
    """Every number field of ``obj``, as read from a file, is a finite, non-negative number of its kind (or null
    where it may be) — counts, bytes and seconds all: a hand-edited "fwd_s": "abc" or -1 would otherwise fail deep
    inside a planner or simulator, or steer its cut."""
    for f in dataclasses.fields(obj):
        annotation = str(f.type)
        kinds = _NUMBERS.get(annotation.removesuffix(" | None"))
        value = getattr(obj, f.name)
        if kinds is None or (value is None and annotation.endswith(" | None")):
            continue
        if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < 0:
            raise StratumError(f"not a Stratum profile ({where}{f.name} = {value!r} is not a finite, non-negative "
                               f"{annotation.removesuffix(' | None')}); re-run `stratum profile` to make one")


@dataclass(kw_only=True)
class BlockProfile:
    """Measured costs of one block."""

    index: int
    """Position of the block in the BlockSeq."""
    name: str
    """Human-readable block name, e.g. ``embed``, ``layer.3``, ``head``."""
    kind: str
    """Class name of the block module."""
    n_params: int
    """Parameters owned by the block (a tied parameter counts in its first block only)."""
    param_bytes: int
    """Bytes of the block's parameters in their training dtype."""
    grad_bytes: int
    """Bytes of the gradients of those parameters."""
    optim_bytes: int
    """Bytes of optimizer state (AdamW: two fp32 moments per parameter)."""
    act_saved_bytes: int
    """Bytes the block saves for backward per micro-batch (parameters excluded, shared storages once)."""
    out_bytes: int
    """Bytes of the block's output tensor per micro-batch: what crosses a pipeline stage boundary."""
    fwd_s: float
    """Forward time, seconds (median)."""
    bwd_s: float
    """Full backward time (input and weight gradients), seconds (median)."""
    bwd_input_s: float
    """Backward time for the input gradient alone, seconds (median); 0 for the first block (no input grad)."""
    spill_bytes: int = 0
    """Bytes the offload engine's activation spill copies for this block: each distinct saved view, except
    parameters and the block's own input (kept anyway), rounded up to SPILL_ALIGN. 0 in older profiles."""
    half_act_saved_bytes: int | None = None
    """``act_saved_bytes`` of the block as the offload engine runs it on 16-bit chunks (Placement.half_params,
    train.precision bf16 or fp16): its parameters in the 16-bit dtype — the weights it saves are then the chunks'
    own tensors, not autocast's casts — on its input in that dtype (the residual stream under 16-bit chunks: an
    embedding's output has its weight's dtype); None where not measured (fp32, an estimate from shapes, older
    profiles: the fp32-weight figures stand, an over-estimate)."""
    half_spill_bytes: int | None = None
    """``spill_bytes`` on 16-bit chunks (as ``half_act_saved_bytes``)."""
    half_out_bytes: int | None = None
    """``out_bytes`` on 16-bit chunks (as ``half_act_saved_bytes``)."""
    logits_bytes: int | None = None
    """The last block only: bytes of its output before the loss (a language model's logits), which a pipeline's
    last stage holds outside the block, with its gradient, until the block's backward; None for the other blocks
    and where not measured (older profiles)."""

    @property
    def bwd_weight_s(self) -> float:
        """Weight-gradient share of the backward, seconds (full backward minus input-gradient backward)."""
        return max(self.bwd_s - self.bwd_input_s, 0.0)


@dataclass(kw_only=True)
class Profile:
    """Per-block costs of a model on one device, plus the facts needed to interpret them."""

    model: str
    """Model name (preset or source description)."""
    device: str
    """Device the measurements were taken on, e.g. ``cpu`` or ``cuda:0 (NVIDIA H100)``."""
    dtype: str
    """Parameter dtype, e.g. ``float32``."""
    precision: str
    """Compute precision: ``fp32`` or ``bf16`` (autocast)."""
    micro_batch: int
    """Sequences per micro-batch."""
    seq_len: int
    """Tokens per sequence."""
    runs: int
    """Timed runs per block (after warm-up); times are their medians."""
    blocks: list[BlockProfile]
    """One entry per block, in BlockSeq order."""
    tied: list[list[str]] = field(default_factory=list)
    """Groups of parameter names that are one tensor (e.g. embedding and head)."""
    torch_version: str = ""
    created: str = ""
    format_version: int = FORMAT_VERSION

    # ---- totals -------------------------------------------------------------------------------------------
    @property
    def n_params(self) -> int:
        return sum(b.n_params for b in self.blocks)

    @property
    def param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)

    @property
    def train_state_bytes(self) -> int:
        """Parameters + gradients + optimizer state, bytes."""
        return sum(b.param_bytes + b.grad_bytes + b.optim_bytes for b in self.blocks)

    @property
    def act_saved_bytes(self) -> int:
        return sum(b.act_saved_bytes for b in self.blocks)

    @property
    def step_s(self) -> float:
        """Forward + backward seconds of one micro-batch through all blocks."""
        return sum(b.fwd_s + b.bwd_s for b in self.blocks)

    # ---- (de)serialisation --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        try:
            if d.get("format_version") != FORMAT_VERSION:
                raise StratumError(
                    f"profile format version {d.get('format_version')!r} is not {FORMAT_VERSION}; "
                    "re-run `stratum profile` with this version of Stratum"
                )
            blocks = [BlockProfile(**b) for b in d["blocks"]]
            rest = {k: v for k, v in d.items() if k != "blocks"}
            prof = cls(blocks=blocks, **rest)
        except (KeyError, TypeError) as e:
            raise StratumError(f"not a Stratum profile ({e}); re-run `stratum profile` to make one") from None
        _check_numbers(prof, "")
        for b in prof.blocks:
            _check_numbers(b, f"block {b.index}: ")
        return prof

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON, atomically."""
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        p = Path(path)
        if not p.is_file():
            raise StratumError(f"profile {p} does not exist; make one with `stratum profile --out {p}`")
        try:
            d = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise StratumError(f"profile {p} is not valid JSON ({e}); re-run `stratum profile`") from None
        except RecursionError:
            raise StratumError(f"profile {p} nests arrays or objects too deeply to read; re-run `stratum profile`") \
                from None
        if not isinstance(d, dict):
            raise StratumError(f"profile {p} is not a Stratum profile; re-run `stratum profile`")
        return cls.from_dict(d)

    @classmethod
    def load_for(cls, path: str | os.PathLike, *, block_params: list[int], micro_batch: int, seq_len: int,
                 precision: str) -> Profile:
        """The profile at ``path``, refused unless it was taken of a model whose blocks own ``block_params``
        parameters each, at this micro-batch, sequence length and precision: a planner reading its bytes and
        seconds for another model or batch shape would approve budgets the run then refuses."""
        prof = cls.load(path)
        want = {"blocks": len(block_params), "micro_batch": micro_batch, "seq_len": seq_len, "precision": precision}
        got = {"blocks": len(prof.blocks), "micro_batch": prof.micro_batch, "seq_len": prof.seq_len,
               "precision": prof.precision}
        diff = [f"{k} {got[k]} (the config's: {want[k]})" for k in want if got[k] != want[k]]
        if not diff:
            diff = [f"block {b.index} ({b.name}) of {b.n_params:,} parameters (the config's: {n:,})"
                    for b, n in zip(prof.blocks, block_params) if b.n_params != n][:1]
        if diff:
            raise StratumError(f"profile {path} was taken with {', '.join(diff)}; re-run `stratum profile` with "
                               "this config, or leave --profile out to have it measured")
        return prof

    def table(self) -> str:
        """The profile as a fixed-width text table, one row per block plus a total."""
        head = f"{'#':>3} {'block':<12} {'params':>12} {'param B':>12} {'optim B':>12} {'act B':>12} " \
               f"{'out B':>11} {'fwd ms':>9} {'bwd ms':>9} {'bwdI ms':>9}"
        lines = [
            f"profile of {self.model} on {self.device}: micro_batch={self.micro_batch} seq_len={self.seq_len} "
            f"precision={self.precision} runs={self.runs}",
            head,
            "-" * len(head),
        ]
        for b in self.blocks:
            lines.append(
                f"{b.index:>3} {b.name:<12} {b.n_params:>12,} {b.param_bytes:>12,} {b.optim_bytes:>12,} "
                f"{b.act_saved_bytes:>12,} {b.out_bytes:>11,} {b.fwd_s * 1e3:>9.3f} {b.bwd_s * 1e3:>9.3f} "
                f"{b.bwd_input_s * 1e3:>9.3f}"
            )
        lines.append("-" * len(head))
        lines.append(
            f"{'':>3} {'total':<12} {self.n_params:>12,} {self.param_bytes:>12,} "
            f"{sum(b.optim_bytes for b in self.blocks):>12,} {self.act_saved_bytes:>12,} {'':>11} "
            f"{sum(b.fwd_s for b in self.blocks) * 1e3:>9.3f} {sum(b.bwd_s for b in self.blocks) * 1e3:>9.3f} "
            f"{sum(b.bwd_input_s for b in self.blocks) * 1e3:>9.3f}"
        )
        return "\n".join(lines)
