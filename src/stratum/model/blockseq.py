"""``BlockSeq``: the model IR every engine runs.

A model is an ordered list of blocks; block ``i`` takes exactly one tensor (the output of block ``i-1``, or the
token ids for block 0) and returns one tensor. A loss function turns the last block's output and the targets
into a scalar. Parameters that are one tensor in several blocks (an embedding tied to the output head) are
listed in ``tied`` so that engines which place blocks on different devices or chunks can place them once and
sum their gradients. Keeping the IR this narrow is what lets the offload engine stream blocks, the pipeline
engine cut them into stages and the profiler measure them one at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stratum.model.streams import block_stream

LossFn = Callable[[Tensor, Tensor], Tensor]

ADAMW_STATE_BYTES_PER_PARAM = 8
"""AdamW's two moments, fp32, per trainable parameter."""


def lm_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy of ``logits`` (B, T, V) against ``targets`` (B, T); fp32 for stability."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def block_seed(seed: int, i: int) -> int:
    """The seed block ``i`` of a model seeded ``seed`` is initialised from, whatever the other blocks: what lets
    a lazy build draw blocks one at a time, in any order, with the values of an eager build."""
    return seed * 1_000_003 + i


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device and keep real buffers (rotary tables and
    the like, which cannot be recomputed generically): only one parameter ever exists in memory at a time. Lazy
    builds use it to get a model's structure without its memory."""
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)
    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@dataclass(frozen=True)
class TiedGroup:
    """One tensor that appears under several names; ``names[0]`` is its canonical (owning) name."""

    names: tuple[str, ...]

    @property
    def owner(self) -> str:
        return self.names[0]


@dataclass(kw_only=True)
class ModelInfo:
    """Architecture facts engines and metrics need without inspecting modules."""

    name: str
    """Model name (preset, HF model type, or a description)."""
    vocab_size: int = 0
    """Size of the token vocabulary; 0 when the model does not consume token ids."""
    max_seq_len: int = 0
    """Longest sequence the model accepts; 0 for no limit."""
    n_layer: int = 0
    d_model: int = 0
    extra: dict = field(default_factory=dict)
    """Source-specific facts that identify the architecture (used in checkpoint fingerprints)."""


class BlockSeq(nn.Module):
    """An ordered sequence of single-tensor blocks plus a loss; tied parameters explicit.

    Parameter names are ``blocks.<i>.<name in block>``. A parameter object that appears in several blocks is
    detected by identity and recorded as a :class:`TiedGroup` (first occurrence owns it).
    """

    def __init__(self, blocks: list[nn.Module], loss_fn: LossFn, info: ModelInfo,
                 block_names: list[str] | None = None):
        super().__init__()
        if not blocks:
            raise ValueError("a BlockSeq needs at least one block")
        self.blocks = nn.ModuleList(blocks)
        self.loss_fn = loss_fn
        self.info = info
        self.block_names = list(block_names) if block_names else [f"block.{i}" for i in range(len(blocks))]
        if len(self.block_names) != len(blocks):
            raise ValueError("block_names must name every block")
        self.tied = self._find_tied()
        self.block_init: Callable[[BlockSeq, int], None] | None = None
        """Set by a lazy build (parameters on the meta device): ``block_init(seq, i)`` gives block i's parameters
        their values once an engine has given them storage — how a model larger than RAM is built one block at a
        time. It takes the BlockSeq as an argument so that a deep copy initialises itself, not the original."""

    # ---- structure ----------------------------------------------------------------------------------------
    def _find_tied(self) -> list[TiedGroup]:
        seen: dict[int, list[str]] = {}
        for i, block in enumerate(self.blocks):
            for name, p in block.named_parameters(remove_duplicate=False):
                seen.setdefault(id(p), []).append(f"blocks.{i}.{name}")
        return [TiedGroup(tuple(names)) for names in seen.values() if len(names) > 1]

    def allocate(self, i: int, device: torch.device | str = "cpu") -> None:
        """Give block ``i``'s meta parameters real, uninitialised storage on ``device`` (tied ones once)."""
        for _, p in self.blocks[i].named_parameters():
            if p.is_meta:
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                         requires_grad=p.requires_grad))

    def materialize(self, i: int) -> None:
        """Initialise block ``i``'s (allocated, uninitialised) parameters; see ``block_init``."""
        if self.block_init is None:
            raise RuntimeError("this BlockSeq was not built lazily: it has no block initialiser")
        self.block_init(self, i)

    def part(self, mine: list[int]) -> BlockSeq:
        """Blocks ``mine`` (indices into this sequence, in order) as a BlockSeq of their own (a pipeline rank's):
        ``blocks.<k>`` there is block ``mine[k]`` here, the same modules; a tensor tied to a block outside
        ``mine`` is an ordinary parameter there."""
        return BlockSeq([self.blocks[g] for g in mine], self.loss_fn, self.info,
                        block_names=[self.block_names[g] for g in mine])

    def __len__(self) -> int:
        return len(self.blocks)

    def block_param_names(self, i: int) -> list[str]:
        """Canonical names of the parameters block ``i`` uses (tied ones under their owner's name)."""
        alias = {n: g.owner for g in self.tied for n in g.names}
        out = []
        for name, _ in self.blocks[i].named_parameters(remove_duplicate=False):
            full = f"blocks.{i}.{name}"
            out.append(alias.get(full, full))
        return out

    def owned_parameters(self, i: int) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters whose canonical (owning) name lies in block ``i``: each tensor counted exactly once."""
        non_owner = {n for g in self.tied for n in g.names[1:]}
        for name, p in self.blocks[i].named_parameters(remove_duplicate=False):
            full = f"blocks.{i}.{name}"
            if full not in non_owner:
                yield full, p

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def owned_numel(self, i: int) -> int:
        """Elements of the parameters block ``i`` owns (:meth:`owned_parameters`)."""
        return sum(p.numel() for _, p in self.owned_parameters(i))

    def train_state_bytes(self) -> int:
        """Parameters, gradients and AdamW moments (fp32) of the whole model; works on ``meta``."""
        param_bytes = sum(p.numel() * p.element_size() for p in self.parameters())
        return 2 * param_bytes + self.num_params() * ADAMW_STATE_BYTES_PER_PARAM

    # ---- compute -------------------------------------------------------------------------------------------
    def forward(self, x: Tensor, stream: int | None = None) -> Tensor:
        """The blocks in order; with a dropout ``stream`` (training) each block draws from its own
        (stream, block) generator, as every engine's blocks do (:mod:`stratum.model.streams`)."""
        for i, block in enumerate(self.blocks):
            with block_stream(stream, i, x.device):
                x = block(x)
        return x

    def loss(self, x: Tensor, y: Tensor, stream: int | None = None) -> Tensor:
        """Scalar mean loss of inputs ``x`` against targets ``y``."""
        return self.loss_fn(self(x, stream), y)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6·N plus attention where the source knows it."""
        attn = 0.0
        if self.info.n_layer and self.info.d_model:
            # causal self-attention: QK^T and AV, 2 matmuls × 2 FLOPs × T × d per token, ×3 for fwd+bwd
            attn = 12.0 * self.info.n_layer * self.info.d_model * seq_len
        return 6.0 * self.num_params() + attn

    def fingerprint(self) -> dict:
        """What identifies this architecture: info plus every canonical parameter's name and shape."""
        return {
            "name": self.info.name,
            "vocab_size": self.info.vocab_size,
            "extra": self.info.extra,
            "params": {n: list(p.shape) for n, p in self.named_parameters()},
        }
