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

The engines treat the DTensor parameters like any other through :mod:`stratum.runtime.tensors` (norms, clip
scaling, whole copies for checkpoints) and :func:`stratum.runtime.optim.make_adamw`. Functions marked
*collective* must be called by every rank of the split group, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from stratum.errors import StratumError
from stratum.model import gpt, hf
from stratum.model.blockseq import BlockSeq
from stratum.model.streams import dropout_site

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
        # torch annotates output_fn as returning None; it returns the module's output, as torch's own styles do
        return distribute_module(module, device_mesh, self._partition, prepare_in,
                                 prepare_out)  # type: ignore[arg-type]


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
def _gpt_sizes(block: gpt.Layer) -> dict[str, int]:
    return {"attention heads": block.n_head, "MLP width": block.fc.out_features}


def _gpt_styles(block: gpt.Layer) -> dict[str, ParallelStyle]:
    return {"qkv": _fused_qkv_linear(), "proj": RowwiseParallel(), "fc": ColwiseParallel(),
            "fc_out": RowwiseParallel()}


def _gpt_localize(block: gpt.Layer, n: int) -> None:
    block.n_head //= n  # gpt.Layer takes its widths from the (sharded) projections


def _gpt2_sizes(block: hf.GPT2Layer) -> dict[str, int]:
    layer: Any = block.layer  # a transformers GPT2Block
    return {"attention heads": layer.attn.num_heads, "MLP width": layer.mlp.c_fc.nf}


def _gpt2_styles(block: hf.GPT2Layer) -> dict[str, ParallelStyle]:
    return {"layer.attn.c_attn": _conv1d_colwise(fused=3), "layer.attn.c_proj": _conv1d_rowwise(),
            "layer.mlp.c_fc": _conv1d_colwise(), "layer.mlp.c_proj": _conv1d_rowwise()}


def _gpt2_localize(block: hf.GPT2Layer, n: int) -> None:
    # GPT2Attention splits c_attn's output into q, k, v by ``split_size`` and infers the head count from the
    # width (``view(..., -1, head_dim)``); ``num_heads`` and ``embed_dim`` are set so nothing reads a global size.
    attn: Any = block.layer.attn
    attn.num_heads //= n
    attn.split_size //= n
    attn.embed_dim //= n


def _llama_sizes(block: hf.LlamaStyleLayer) -> dict[str, int]:
    layer: Any = block.layer  # a transformers decoder layer (Llama, Mistral, Qwen2 ...)
    attn = layer.self_attn
    return {"attention heads": attn.q_proj.out_features // attn.head_dim,
            "KV heads": attn.k_proj.out_features // attn.head_dim,
            "MLP width": layer.mlp.gate_proj.out_features}


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
    # Each takes a block of the kind's own class.
    sizes: Callable[[Any], dict[str, int]]
    """What must divide by n, by the name the error message uses."""
    styles: Callable[[Any], dict[str, ParallelStyle]]
    """parallelize_module's plan: submodule path inside the block → style."""
    localize: Callable[[Any, int], None]
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
    a model on the meta device will do. A model that drops out is refused too: a rank draws attention-dropout
    masks for its heads alone, which are not its share of the masks one process draws for all of them (nor are
    the draws after it), so the losses would leave the plain engine's."""
    if n < 1:
        raise StratumError(f"split({n}): the split size must be at least 1")
    for i, block in enumerate(model.blocks):
        if not isinstance(block, REPLICATED_KINDS):
            _check_block(i, block, n)
    if n > 1 and (site := dropout_site(model)):
        raise StratumError(f"split({n}): {site[0]} drops out (p = {site[1]:g}); each rank would draw masks for its "
                           "own heads, not the plain engine's — set model.dropout = 0, or use a plan without split")


@dataclass(frozen=True)
class ModuleCut:
    """How one submodule of a layer block is cut, read from the block kind's parallel styles (one table serves
    the DTensor split here and the plain-shard split of :mod:`stratum.parallel.split_offload`)."""

    role: str
    """"column" (output columns sharded), "row" (input rows sharded, output summed over the group) or "entry"
    (a module whose column-parallel children read one replicated input)."""
    placements: dict[str, Placement]
    """Parameter name → its placement over the split group."""
    kwargs: tuple[str, ...] = ()
    """An entry's keyword inputs that are taken replicated (none: its first positional input)."""


def _cut_of(style: ParallelStyle) -> ModuleCut:
    if isinstance(style, _Sharded):
        return ModuleCut("column" if style.colwise else "row", dict(style.placements))
    if isinstance(style, ColwiseParallel):  # nn.Linear (out, in): output columns are weight rows
        return ModuleCut("column", {"weight": Shard(0), "bias": Shard(0)})
    if isinstance(style, RowwiseParallel):
        return ModuleCut("row", {"weight": Shard(1), "bias": Replicate()})
    if isinstance(style, PrepareModuleInput):
        return ModuleCut("entry", {}, tuple(style.input_kwarg_layouts))
    raise TypeError(f"split has no cut for the parallel style {type(style).__name__}")


def layer_cuts(block: nn.Module) -> dict[str, ModuleCut]:
    """Submodule path inside the layer block → how split cuts it (a block kind split knows)."""
    kind = _kind(block)
    assert kind is not None  # (check_split refuses a block kind split does not know)
    return {path: _cut_of(style) for path, style in kind.styles(block).items()}


def localize_heads(block: nn.Module, n: int) -> None:
    """After its parameters are cut ``n`` ways: make the block's attention work with this rank's heads."""
    kind = _kind(block)
    assert kind is not None  # (as layer_cuts)
    kind.localize(block, n)


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
        assert kind is not None  # (_check_block refused a block split does not know)
        styles = kind.styles(block)
        for path in styles:  # parallelize_module skips a path that matches nothing; a renamed module must fail
            block.get_submodule(path)
        parallelize_module(block, mesh, styles)
        kind.localize(block, n)
