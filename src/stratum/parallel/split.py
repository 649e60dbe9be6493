"""``split(n)``: tensor parallelism inside blocks, on torch's DTensor (``parallelize_module``).

Each transformer layer block listed is cut Megatron-style over a 1-D DeviceMesh of ``n`` processes: attention by
heads (q, k, v column-parallel, the output projection row-parallel) and the MLP column- then row-parallel. A rank
holds 1/n of the layer's matrices as DTensor parameters; norms and the row-parallel biases stay whole
(replicated DTensors or plain tensors). A block's input and output stay ordinary tensors, equal on every rank of
the split group, so the pipeline runtime, the loss and the embedding and head blocks around it do not change.
Parameter names stay the BlockSeq's own, so checkpoints keep their canonical names.

Two layouts need more than torch's ``ColwiseParallel`` / ``RowwiseParallel``:

- a fused q|k|v projection (Stratum's GPT ``qkv``, GPT-2's ``c_attn``) is sharded
  ``_StridedShard(split_factor=3)``: each rank gets whole heads of q, of k and of v, and ``full_tensor()``
  still gives the unsplit layout;
- transformers' ``Conv1D`` stores its weight (in, out), the transpose of ``nn.Linear``'s, so its shard dims swap.

Known block kinds: Stratum's GPT ``Layer``, transformers ``GPT2Block`` and ``LlamaDecoderLayer`` (as wrapped by
:mod:`stratum.model.hf`); embedding and head blocks stay replicated; any other block kind is refused by name.

Around the forward: :func:`grad_sq_norm` and :func:`scale_grads_` for clipping, :func:`adamw_for` for the
optimizer, :func:`full_tensor`, :func:`load_full_` and :func:`shard_state` for placement-independent checkpoints.
Functions marked *collective* must be called by every rank of the split group, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, \
    distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, \
    RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from stratum.errors import StratumError
from stratum.model import gpt, hf
from stratum.model.blockseq import BlockSeq

if TYPE_CHECKING:
    from stratum.runtime.engine import OptimSpec

REPLICATED_KINDS = (gpt.Embed, gpt.Head, hf.GPT2Embed, hf.TokenEmbed, hf.Head)
"""Embedding and head blocks: split leaves them whole on every rank of the group."""


# ---- parallel styles for layouts torch's own styles do not take ---------------------------------------------
def _local_output(mod: nn.Module, out: DTensor, mesh: DeviceMesh) -> Tensor:
    # The weight's shards are whole heads (or whole MLP columns), so this rank's part of the output is exactly
    # the columns its next operator needs; a redistribution to Shard(-1) would reorder a fused q|k|v output.
    return out.to_local()


class _Sharded(ParallelStyle):
    """Column- or row-parallel for a linear-like module whose parameters shard as ``placements`` says (by
    parameter name): torch's ColwiseParallel / RowwiseParallel input and output handling, for modules those
    refuse (transformers' Conv1D) or shard the wrong way (a fused q|k|v weight, which Shard(0) cuts through k).
    It reuses those styles' input/output functions and ``_StridedShard``, torch internals (torch is pinned)."""

    def __init__(self, placements: dict[str, Placement], *, colwise: bool):
        super().__init__()
        self.placements = placements
        self.colwise = colwise

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            dp = distribute_tensor(p, mesh, [self.placements[pname]], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dp, requires_grad=p.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.colwise:  # replicated input in, this rank's output columns out
            prepare_in = partial(ColwiseParallel._prepare_input_fn, (Replicate(),), (Replicate(),))
            prepare_out = _local_output
        else:  # this rank's input columns in, the all-reduced output out
            prepare_in = partial(RowwiseParallel._prepare_input_fn, (Shard(-1),), (Shard(-1),))
            prepare_out = partial(RowwiseParallel._prepare_output_fn, (Replicate(),), True)
        return distribute_module(module, device_mesh, self._partition, prepare_in, prepare_out)


def _fused_qkv_linear() -> ParallelStyle:
    """nn.Linear with weight (3·d, d) = rows of q, k, v: each rank takes its heads' rows of each of the three."""
    heads = _StridedShard(0, split_factor=3)
    return _Sharded({"weight": heads, "bias": heads}, colwise=True)


def _conv1d_colwise(fused: int = 1) -> ParallelStyle:
    """Conv1D (weight (in, out)): output columns are weight dim 1; ``fused`` q|k|v parts keep whole heads."""
    if fused == 1:
        return _Sharded({"weight": Shard(1), "bias": Shard(0)}, colwise=True)
    return _Sharded({"weight": _StridedShard(1, split_factor=fused), "bias": _StridedShard(0, split_factor=fused)},
                    colwise=True)


def _conv1d_rowwise() -> ParallelStyle:
    """Conv1D (weight (in, out)): input rows are weight dim 0; the bias stays whole and counts once in the
    all-reduced output."""
    return _Sharded({"weight": Shard(0), "bias": Replicate()}, colwise=False)


# ---- block kinds ---------------------------------------------------------------------------------------------
class SplitGptLayer(gpt.Layer):
    """Stratum's GPT layer with this rank's heads: ``n_head`` is the local count and the q|k|v width comes from
    the (sharded) projection's output, not from the input's width as in :class:`gpt.Layer`."""

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=2)
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, -1)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))


def _gpt_sizes(block: gpt.Layer) -> dict[str, int]:
    return {"attention heads": block.n_head, "MLP width": block.fc.out_features}


def _gpt_styles(block: gpt.Layer) -> dict[str, ParallelStyle]:
    return {"qkv": _fused_qkv_linear(), "proj": RowwiseParallel(), "fc": ColwiseParallel(),
            "fc_out": RowwiseParallel()}


def _gpt_localize(block: gpt.Layer, n: int) -> None:
    # gpt.Layer.forward reads the model width from its input, which stays whole; the subclass reads it from
    # the sharded projection instead (its forward is the same computation for n = 1).
    block.n_head //= n
    block.__class__ = SplitGptLayer


def _gpt2_sizes(block: hf.GPT2Layer) -> dict[str, int]:
    return {"attention heads": block.layer.attn.num_heads, "MLP width": block.layer.mlp.c_fc.nf}


def _gpt2_styles(block: hf.GPT2Layer) -> dict[str, ParallelStyle]:
    return {"layer.attn.c_attn": _conv1d_colwise(fused=3), "layer.attn.c_proj": _conv1d_rowwise(),
            "layer.mlp.c_fc": _conv1d_colwise(), "layer.mlp.c_proj": _conv1d_rowwise()}


def _gpt2_localize(block: hf.GPT2Layer, n: int) -> None:
    # GPT2Attention splits c_attn's output into q, k, v by ``split_size`` and infers the head count from the
    # width (``view(..., -1, head_dim)``); ``num_heads`` and ``embed_dim`` are set so nothing reads a global size.
    attn = block.layer.attn
    attn.num_heads //= n
    attn.split_size //= n
    attn.embed_dim //= n


def _llama_sizes(block: hf.LlamaStyleLayer) -> dict[str, int]:
    attn = block.layer.self_attn
    return {"attention heads": attn.q_proj.out_features // attn.head_dim,
            "KV heads": attn.k_proj.out_features // attn.head_dim,
            "MLP width": block.layer.mlp.gate_proj.out_features}


def _llama_styles(block: hf.LlamaStyleLayer) -> dict[str, ParallelStyle]:
    # q, k, v (and gate, up) read one input: made a replicated DTensor once at the module's entry, its gradient
    # is all-reduced once in the backward instead of once per projection.
    once = Replicate()
    return {"layer.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": once},
                                                  desired_input_kwarg_layouts={"hidden_states": once}),
            "layer.mlp": PrepareModuleInput(input_layouts=(once,), desired_input_layouts=(once,)),
            "layer.self_attn.q_proj": ColwiseParallel(), "layer.self_attn.k_proj": ColwiseParallel(),
            "layer.self_attn.v_proj": ColwiseParallel(), "layer.self_attn.o_proj": RowwiseParallel(),
            "layer.mlp.gate_proj": ColwiseParallel(), "layer.mlp.up_proj": ColwiseParallel(),
            "layer.mlp.down_proj": RowwiseParallel()}


def _llama_localize(block: hf.LlamaStyleLayer, n: int) -> None:
    # transformers 5 infers head counts from the projections' widths (``view(..., -1, head_dim)``) and keeps the
    # q-per-kv ratio (``num_key_value_groups``), which a split leaves unchanged; older versions read these.
    attn = block.layer.self_attn
    for name in ("num_heads", "num_key_value_heads", "hidden_size"):
        if isinstance(getattr(attn, name, None), int):
            setattr(attn, name, getattr(attn, name) // n)


@dataclass(frozen=True)
class _Kind:
    sizes: Callable[[nn.Module], dict[str, int]]
    """What must divide by n, by the name the error message uses."""
    styles: Callable[[nn.Module], dict[str, ParallelStyle]]
    """parallelize_module's plan: submodule path inside the block → style."""
    localize: Callable[[nn.Module, int], None]
    """After sharding: make the attention work with this rank's heads."""


_KINDS: dict[str, _Kind] = {
    "Layer": _Kind(_gpt_sizes, _gpt_styles, _gpt_localize),
    "GPT2Block": _Kind(_gpt2_sizes, _gpt2_styles, _gpt2_localize),
    "LlamaDecoderLayer": _Kind(_llama_sizes, _llama_styles, _llama_localize),
}


def _kind_name(block: nn.Module) -> str:
    """The class that names a block: the transformers layer inside stratum.model.hf's wrappers."""
    if isinstance(block, (hf.GPT2Layer, hf.LlamaStyleLayer)):
        return type(block.layer).__name__
    return type(block).__name__


def _kind(block: nn.Module) -> _Kind | None:
    """The split rules of a layer block, or None for a block kind split does not know."""
    if isinstance(block, gpt.Layer):
        return _KINDS["Layer"]
    if isinstance(block, (hf.GPT2Layer, hf.LlamaStyleLayer)):
        return _KINDS.get(_kind_name(block))
    return None


# ---- checking and applying -------------------------------------------------------------------------------------
def split_blocks(model: BlockSeq) -> list[int]:
    """Indices of the blocks ``split`` shards (the transformer layers); every other block stays replicated."""
    return [i for i, b in enumerate(model.blocks) if _kind(b) is not None]


def _check_block(i: int, block: nn.Module, n: int) -> None:
    kind = _kind(block)
    if kind is None:
        raise StratumError(f"split({n}): block {i} ({_kind_name(block)}) is not a block kind split knows "
                           f"(Stratum's GPT layer, transformers GPT2Block or LlamaDecoderLayer); "
                           "use a plan without split for this model")
    for what, size in kind.sizes(block).items():
        if size % n:
            raise StratumError(f"split({n}): block {i} ({_kind_name(block)}) has {size} {what}, not divisible "
                               f"by {n}; use a split size that divides {size}")


def check_split(model: BlockSeq, n: int) -> None:
    """Refuse ``split(n)`` for ``model`` with a one-line StratumError: a block kind split does not know (named
    by its class), or heads, KV heads or MLP width not divisible by ``n``. Reads only shapes and attributes, so
    a model on the meta device will do."""
    if n < 1:
        raise StratumError(f"split({n}): the split size must be at least 1")
    for i, block in enumerate(model.blocks):
        if not isinstance(block, REPLICATED_KINDS):
            _check_block(i, block, n)


def apply_split(model: BlockSeq, block_ids: Iterable[int], mesh: DeviceMesh) -> None:
    """Shard the blocks ``block_ids`` of ``model`` in place over the 1-D ``mesh`` (collective: every rank of the
    mesh calls it with the same blocks; rank 0's values are the ones kept). Parameters become new DTensor
    Parameters, so optimizers must be built afterwards."""
    if mesh.ndim != 1:
        raise ValueError(f"apply_split needs a 1-D DeviceMesh, got {mesh.ndim}-D")
    n = mesh.size()
    ids = list(block_ids)
    for i in ids:
        if isinstance(model.blocks[i], REPLICATED_KINDS):
            raise ValueError(f"block {i} ({_kind_name(model.blocks[i])}) stays replicated under split; "
                             "pass split_blocks(model)")
        if any(isinstance(p, DTensor) for p in model.blocks[i].parameters()):
            raise ValueError(f"block {i} ({_kind_name(model.blocks[i])}) is split already")
        _check_block(i, model.blocks[i], n)
    for i in ids:
        block = model.blocks[i]
        kind = _kind(block)
        styles = kind.styles(block)
        for path in styles:  # parallelize_module skips a path that matches nothing; a renamed module must fail
            block.get_submodule(path)
        parallelize_module(block, mesh, styles)
        kind.localize(block, n)


# ---- gradients -----------------------------------------------------------------------------------------------
def grad_sq_norm(params: list[Tensor]) -> Tensor:
    """Squared global norm (float64 scalar) of ``params``' gradients as the unsplit model has it (collective):
    a sharded gradient counts its shards summed over the split group, a replicated or plain one once."""
    whole: list[Tensor] = []
    shards: dict[tuple, Tensor] = {}
    for p in params:
        if p.grad is None:
            continue
        sq = p.grad.detach().to(torch.float64).square().sum()
        if isinstance(sq, DTensor) and any(pl.is_partial() for pl in sq.placements):
            key = (sq.device_mesh, sq.placements)
            shards[key] = shards.get(key, 0.0) + sq.to_local()
        else:
            whole.append(sq.to_local() if isinstance(sq, DTensor) else sq)
    total = torch.stack(whole).sum() if whole else torch.zeros((), dtype=torch.float64)
    for (mesh, placements), local in shards.items():
        # one reduction for all sharded gradients of a mesh, not one per tensor: DTensor sums the Partial
        total = total.to(local.device) + DTensor.from_local(local, mesh, placements).full_tensor()
    return total


def scale_grads_(grads: list[Tensor], coef: Tensor) -> None:
    """Multiply every gradient by ``coef`` (the clip factor): torch's foreach kernels refuse a list that mixes
    DTensors with plain tensors, so each kind (and device) gets its own call."""
    groups: dict[tuple[bool, torch.device], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((isinstance(g, DTensor), g.device), []).append(g)
    for (_, device), gs in groups.items():
        torch._foreach_mul_(gs, coef.to(device, gs[0].dtype))


def adamw_for(named: list[tuple[str, nn.Parameter]], spec: OptimSpec, device: torch.device) -> torch.optim.AdamW:
    """:func:`stratum.runtime.optim.make_adamw` for a model that may hold DTensor parameters: the same decay rule
    and fused kernels, with DTensor and plain parameters in separate groups, since fused and foreach AdamW
    refuse a group mixing the two (torch 2.13), while each kind alone runs fused on CPU."""
    from stratum.runtime.optim import decays  # here, not at the top: runtime imports engines that import us

    groups = []
    for decay in (True, False):
        for sharded in (True, False):
            ps = [p for n, p in named if decays(n, p) == decay and isinstance(p, DTensor) == sharded]
            if ps:
                groups.append({"params": ps, "weight_decay": spec.weight_decay if decay else 0.0})
    fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(groups, lr=0.0, betas=spec.betas, eps=spec.eps, fused=fused)


# ---- placement-independent state ---------------------------------------------------------------------------
def full_tensor(t: Tensor) -> Tensor:
    """A CPU copy of the whole tensor: a parameter, a gradient or an AdamW state tensor, DTensor or not
    (collective for a DTensor)."""
    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.to("cpu", copy=True)


def shard_like(full: Tensor, like: Tensor) -> Tensor:
    """``full`` laid out as ``like``: this rank's shard as a DTensor with ``like``'s placements when ``like`` is a
    DTensor, else a copy on ``like``'s device. Every rank cuts its piece from its own copy of ``full``, so
    nothing is communicated; the piece is a fresh tensor that does not keep ``full`` alive."""
    if not isinstance(like, DTensor):
        return full.detach().to(like.device, copy=True)
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"a tensor of shape {tuple(full.shape)} cannot take the place of one of "
                         f"{tuple(like.shape)}")
    d = distribute_tensor(full.detach().to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return DTensor.from_local(d.to_local().clone(), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def load_full_(param: Tensor, full: Tensor) -> None:
    """Copy the whole tensor ``full`` into ``param`` (its local shard where ``param`` is a DTensor)."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            param.to_local().copy_(shard_like(full, param).to_local())
        else:
            param.copy_(full)


def shard_state(state: dict[str, Tensor], like: Tensor) -> dict[str, Tensor]:
    """One parameter's AdamW state as saved whole (``exp_avg``, ``exp_avg_sq`` …, CPU) laid out for loading into
    an optimizer over the (possibly DTensor) parameter ``like``: tensors of the parameter's shape become its
    shards; ``step`` stays a plain scalar, as torch's AdamW keeps it for DTensor parameters too."""
    return {k: shard_like(v, like) if k != "step" and tuple(v.shape) == tuple(like.shape)
            else v.to(like.device, copy=True) for k, v in state.items()}
