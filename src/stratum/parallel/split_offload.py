"""``split(n, offload(…))``: tensor parallelism whose shards are ordinary tensors, so the memory engine chunks them.

The memory engine packs parameters into flat chunks and, when a block saves a weight for its backward, saves the
weight's place in its chunk (the chunk may be evicted and come back elsewhere). A DTensor parameter, as
:mod:`stratum.parallel.split` makes them, is a wrapper without storage of its own: the engine could neither pack
it nor find it among its chunks. So under the offload leaf each split rank's layer blocks hold only their own
shards as plain Parameters, laid out as Megatron-LM lays them out and cut as ``split`` cuts its DTensors (the
same table, :func:`~stratum.parallel.split.layer_cuts`): whole heads of q|k|v and columns of the first MLP
matrix, rows of the two output projections; norms, row-parallel biases, the embedding and the head whole. The
split group's communication is two autograd functions: *to split* before column-parallel modules (identity
forward; the input's gradient summed over the group in the backward) and *from split* after a row-parallel
product (summed over the group in the forward, its bias added once after the sum; identity backward). A block's
input and output stay equal on every rank of the group, and so do the gradients of everything kept whole; each
rank's memory engine chunks 1/n of every layer's matrices.

Every rank of a split group runs the same offload placement (split rank 0's): a recomputed block re-runs its
collectives, which must meet. The global gradient norm sums the sharded gradients' squares over the group and
counts the whole ones once. Checkpoints hold whole tensors under canonical names (gathered on save, cut on
load), so a run moves between this plan and any other.

Functions and methods marked *collective* must be called by every rank of the split group, in the same order.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor

from stratum.dist.world import World
from stratum.model.blockseq import BlockSeq
from stratum.model.placement import drop_to_meta
from stratum.offload.engine import OffloadEngine
from stratum.parallel.pipeline_offload import OffloadPipelineEngine
from stratum.parallel.split import ModuleCut, check_split, layer_cuts, localize_heads, split_blocks
from stratum.runtime.engine import AroundChild, Engine, Mapped, TrainState, merge_states


class SplitComm:
    """The split group's sum, with the world's timeout; blocks hold it as an attribute."""

    def __init__(self, world: World):
        self.world = world
        self.group = world.group("split")

    def __deepcopy__(self, memo: dict) -> SplitComm:
        return self  # a block's working copy (the profiler's) talks over the same group

    def sum_(self, t: Tensor, what: str) -> Tensor:
        self.world.wait(dist.all_reduce(t, group=self.group, async_op=True), what)
        return t


# torch.distributed.nn's all_reduce differentiates the sum as a sum of every rank's loss; here every rank computes
# the same loss once, so these are Megatron-LM's pair (f, g) instead.
class _ToSplit(torch.autograd.Function):
    """Identity forward; the gradient summed over the split group in the backward."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: SplitComm) -> Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.comm.sum_(grad.contiguous().clone(), "the split input gradient's all-reduce"), None


class _FromSplit(torch.autograd.Function):
    """Summed over the split group in the forward; identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: SplitComm) -> Tensor:
        return comm.sum_(x.contiguous().clone(), "the split output's all-reduce")

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


# The modules carry the split's attributes (set by _cut_module), so a block's copy works alike: typed as Any.
def _to_split_hook(module: Any, args: tuple) -> tuple:
    return (_ToSplit.apply(args[0], module.split_comm), *args[1:])


def _entry_hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    comm = module.split_comm
    names = module.split_kwargs
    if not names:
        return (_ToSplit.apply(args[0], comm), *args[1:]), kwargs
    return args, {k: _ToSplit.apply(v, comm) if k in names else v for k, v in kwargs.items()}


def _row_forward(self: Any, x: Tensor) -> Tensor:
    """A row-parallel product: this rank's input columns times its weight rows, summed over the group, then the
    (whole) bias once."""
    w: Tensor = self.weight
    if isinstance(self, nn.Linear):
        y = F.linear(x, w)
    else:  # transformers' Conv1D: weight (in, out)
        y = (x.reshape(-1, x.size(-1)) @ w).view(*x.shape[:-1], w.shape[1])
    y = _FromSplit.apply(y, self.split_comm)
    return y if self.bias is None else y + self.bias


_ROW_CLASSES: dict[type, type] = {}


def _row_class(cls: type) -> type:
    """``cls`` with the row-parallel forward (a subclass: parameter names, state dicts and copies stay)."""
    if cls not in _ROW_CLASSES:
        _ROW_CLASSES[cls] = type(f"RowSplit{cls.__name__}", (cls,), {"forward": _row_forward})
    return _ROW_CLASSES[cls]


@dataclass
class ShardLayout:
    """Which parameters a split rank holds a shard of, and how to gather and cut them (see the module
    docstring)."""

    mesh: DeviceMesh
    comm: SplitComm
    placements: dict[str, Placement] = field(default_factory=dict)
    """Canonical name → the placement of its shard (only the sharded parameters)."""
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Canonical name → the whole tensor's shape."""

    def _whole(self, name: str, local: Tensor) -> Tensor:
        shape = torch.Size(self.shapes[name])
        d = DTensor.from_local(local.detach(), self.mesh, [self.placements[name]], run_check=False, shape=shape,
                               stride=torch.empty(shape, device="meta").stride())
        return d.full_tensor().to("cpu", copy=True)

    def _cut(self, name: str, full: Tensor) -> Tensor:
        d = distribute_tensor(full.detach().to(self.mesh.device_type), self.mesh, [self.placements[name]],
                              src_data_rank=None)
        return d.to_local().to("cpu", copy=True)

    def _map(self, state: TrainState, fn: Callable[[str, Tensor], Tensor]) -> TrainState:
        params = {n: fn(n, t) if n in self.placements else t for n, t in state.params.items()}
        optim = {n: ({k: fn(n, v) if k != "step" else v for k, v in st.items()} if n in self.placements else st)
                 for n, st in state.optim.items()}
        return TrainState(params=params, optim=optim, buffers=state.buffers)

    def whole(self, state: TrainState) -> TrainState:
        """``state`` with every shard gathered into its whole tensor (collective)."""
        return self._map(state, self._whole)

    def cut(self, state: TrainState) -> TrainState:
        """A whole (saved) state with this rank's shards cut from it as each is asked for (nothing communicated:
        a checkpoint's tensors are read and cut one at a time)."""
        return TrainState(params=Mapped(state.params, self._cut_param), optim=Mapped(state.optim, self._cut_optim),
                          buffers=state.buffers, scaler=state.scaler)

    def _cut_param(self, name: str, t: Tensor) -> Tensor:
        return self._cut(name, t) if name in self.placements else t

    def _cut_optim(self, name: str, st: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        if name not in self.placements:
            return st
        return {k: self._cut(name, v) if k != "step" else v for k, v in st.items()}

    def sq_norm(self, norms: list[tuple[str, Tensor]]) -> Tensor:
        """Squared global norm (float64, 1-element) from this rank's per-parameter norms (collective): the shards'
        squares summed over the group, the whole tensors' counted once."""
        dev = norms[0][1].device if norms else torch.device("cpu")
        shard, whole = (torch.zeros((), dtype=torch.float64, device=dev) for _ in range(2))
        for name, n in norms:
            sq = n.double().square()
            if name in self.placements:
                shard = shard + sq
            else:
                whole = whole + sq
        total = self.comm.sum_(shard.reshape(1).to(self.mesh.device_type), "the split gradient-norm all-reduce")
        return total + whole.to(total.device)


def local_shape(shape: tuple[int, ...], pl: Placement, n: int) -> list[int]:
    """The shape of one rank's shard of a tensor of ``shape`` under ``pl`` over ``n`` ranks (Shard and
    _StridedShard alike cut their dim into n equal parts)."""
    dim = cast(Any, pl).dim
    return [x // n if d == dim else x for d, x in enumerate(shape)]


def _cut_module(mod: Any, prefix: str, cut: ModuleCut, layout: ShardLayout) -> None:
    """Replace ``mod``'s parameters by this rank's shards (rank 0's values: collective; a meta parameter's shard
    stays on meta, its values cut when the memory engine packs it) and give it the split's communication for its
    role."""
    n = layout.mesh.size()
    for pname, pl in cut.placements.items():
        p = getattr(mod, pname, None)
        if p is None or isinstance(pl, Replicate):
            continue
        if p.is_meta:
            local = torch.empty(local_shape(tuple(p.shape), pl, n), dtype=p.dtype, device="meta")
        else:
            local = distribute_tensor(p.detach(), layout.mesh, [pl], src_data_rank=0).to_local().clone()
        mod.register_parameter(pname, nn.Parameter(local, requires_grad=p.requires_grad))
        layout.placements[f"{prefix}.{pname}"] = pl
        layout.shapes[f"{prefix}.{pname}"] = tuple(p.shape)
    mod.split_comm = layout.comm
    if isinstance(mod, nn.Linear):
        mod.out_features, mod.in_features = mod.weight.shape
    elif hasattr(mod, "nf"):  # transformers' Conv1D sizes its output by nf
        mod.nf = mod.weight.shape[1]
    if cut.role == "row":
        mod.__class__ = _row_class(type(mod))
    elif cut.role == "entry":
        mod.split_kwargs = cut.kwargs
        mod.register_forward_pre_hook(_entry_hook, with_kwargs=True)


def split_locally(model: BlockSeq, held: set[int], world: World) -> ShardLayout:
    """Cut the layer blocks in ``held`` into this rank's plain shards over its split group, in place (collective;
    every rank of the group holds the same blocks); the layout for norms and checkpoints."""
    group = world.group("split")
    assert group is not None  # (called for a plan with split(n > 1))
    layout = ShardLayout(mesh=DeviceMesh.from_group(group, world.device.type), comm=SplitComm(world))
    n = world.size("split")
    whole = copy.deepcopy(model) if model.block_init is not None else None  # on meta: no memory
    for i in (b for b in split_blocks(model) if b in held):
        block = model.blocks[i]
        cuts = layer_cuts(block)
        entries = [p for p, c in cuts.items() if c.role == "entry"]
        for path, cut in cuts.items():
            mod = block.get_submodule(path)
            _cut_module(mod, f"blocks.{i}.{path}", cut, layout)
            # a column-parallel module under an entry reads the input the entry made replicated
            if cut.role == "column" and not any(path.startswith(e + ".") for e in entries):
                mod.register_forward_pre_hook(_to_split_hook)
        localize_heads(block, n)
    if whole is not None:
        model.block_init = _shard_block_init(whole, layout)
    return layout


def _shard_block_init(whole: BlockSeq, layout: ShardLayout) -> Callable[[BlockSeq, int], None]:
    """The ``block_init`` of a lazily built model whose blocks :func:`split_locally` cut on meta: block i of
    ``whole`` (its uncut twin, on meta) is given its values for the moment, this rank's shards are cut from them
    (every rank of the group draws the same values from the seed: nothing communicated) and it goes back to meta,
    so a rank holds at most one whole block beside its shards."""
    init = whole.block_init
    assert init is not None  # (a lazy build's twin)

    def block_init(seq: BlockSeq, i: int) -> None:
        whole.allocate(i)
        init(whole, i)
        values = dict(whole.owned_parameters(i))
        with torch.no_grad():
            for name, p in seq.owned_parameters(i):
                src = values[name]
                p.copy_(layout._cut(name, src) if name in layout.placements else src)
        drop_to_meta(whole)
    return block_init


def shard_shapes(model: BlockSeq, n: int) -> None:
    """Give the layer blocks of a meta-device ``model`` the parameters one rank of ``split(n, offload(…))`` holds —
    its shards' shapes, as :func:`split_locally` cuts them, nothing communicated — in place: what the memory
    engine's planner packs when the plan search prices a split rank."""
    check_split(model, n)
    for i in split_blocks(model):
        block = model.blocks[i]
        for path, cut in layer_cuts(block).items():
            mod = block.get_submodule(path)
            for pname, pl in cut.placements.items():
                p = getattr(mod, pname, None)
                if p is None or isinstance(pl, Replicate):
                    continue
                shape = local_shape(tuple(p.shape), pl, n)
                mod.register_parameter(pname, nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"),
                                                           requires_grad=p.requires_grad))
        localize_heads(block, n)


class SplitOffload(AroundChild):
    """``split(n, offload(…))`` (or a replicate node around it): the child trains this rank's shards; this engine
    gives the leaf the split group's norm and turns checkpoints whole (see the module docstring)."""

    def __init__(self, child: Engine, leaf: OffloadEngine, layout: ShardLayout):
        self.child = child
        self.leaf = leaf
        self.layout = layout
        leaf.combine_norm = self._norm

    def _norm(self, norms: list[tuple[str, Tensor]]) -> Tensor:
        return self.layout.sq_norm(norms).sqrt().float().reshape(())

    def state(self) -> TrainState:
        return merge_states(self.state_parts())

    def state_parts(self) -> Iterator[TrainState]:
        """The child's parts made whole (collective over the split group: every rank runs it to its end)."""
        for part in self.child.state_parts():
            yield self.layout.whole(part)

    def load_state(self, state: TrainState) -> None:
        self.child.load_state(self.layout.cut(state))


class SplitOffloadPipeline(OffloadPipelineEngine):
    """``pipeline(m, split(n, offload(…)))``: each pipeline rank's blocks are its split shards (cut before the
    pipeline builds its stages); the norm and the checkpoints go through the shard layout. A stage's split ranks
    run split rank 0's placement: a block recomputed in the backward re-runs its split collectives on all of
    them."""

    def __init__(self, model: BlockSeq, *, layout: ShardLayout, **kw):
        self.layout = layout
        super().__init__(model, **kw)

    def grad_norm(self) -> Tensor:
        counted = self.norm_counted()
        mine = [(self.to_global[ln], n) for ln, n in self.leaf.grad_norms_now() if self.to_global[ln] in counted]
        return self.reduce_norm(self.layout.sq_norm(mine).sqrt())

    def _local_parts(self) -> Iterator[TrainState]:
        for part in super()._local_parts():  # collective over the split group: every rank, part by part
            yield self.layout.whole(part)

    def load_state(self, state: TrainState) -> None:
        super().load_state(self.layout.cut(state))
